#!/bin/sh
# Runs in the rxe guest (make perf-rxe): a CPU profile of the whole guest
# (perf record -a -g, cpu-clock: the emulated CPU has no PMU) while
# perftest runs PERF_OP at PERF_SIZE bytes PERF_COUNT times (write:
# ib_write_bw; pingpong: ib_send_lat), then while rdmagrpc's raw net.Conn
# halves do the same (rdmabench refchild), and a report of each: by
# thread, by symbol, and what each symbol's callers add up to. perf is the
# host's, copied in with its libraries (/rxe/bin/perf-guest). Kernel
# symbols come from /proc/kallsyms; Go's from the rdmabench binary.
ulimit -n 65536
export LD_LIBRARY_PATH=/rxe/bin/perf-guest
PERF=/rxe/bin/perf-guest/perf
echo 0 >/proc/sys/kernel/kptr_restrict
op="${PERF_OP:-write}"
size="${PERF_SIZE:-32768}"
count="${PERF_COUNT:-4096}"
case "$op" in
write) tool=ib_write_bw ;;
pingpong) tool=ib_send_lat ;;
*)
	echo "perf-ref.sh: PERF_OP is write or pingpong, not $op" >&2
	exit 2
	;;
esac
report() {
	r="$PERF report -i $1 --stdio"
	echo "### $2: by thread"
	$r --no-children --sort pid -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -n 12
	echo "### $2: by symbol"
	$r --no-children --sort sym -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -n 40
	echo "### $2: by symbol with its callees"
	$r --children --sort sym -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -n 60
}
echo "guest: $(nproc) vCPUs, clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource); $op of $size bytes, $count times"

$tool -d rxe0 -x 1 -R -F -s "$size" -n "$count" -p 7701 >/dev/null 2>&1 &
sleep 1
echo "## $tool"
$PERF record -q -a -e cpu-clock -F 1000 -g -o /tmp/tool.data -- \
	$tool -d rxe0 -x 1 -R -F -s "$size" -n "$count" -p 7701 "$RXE_ADDR" 2>&1 | tail -n 2
wait

/rxe/bin/rdmabench refchild -serve "$RXE_ADDR:7702" -provider verbs -stats &
sleep 1
echo "## rdmagrpc"
$PERF record -q -a -e cpu-clock -F 1000 -g -o /tmp/rdmagrpc.data -- \
	/rxe/bin/rdmabench refchild -dial "$RXE_ADDR:7702" -op "$op" -size "$size" -count "$count" -provider verbs -stats
wait

report /tmp/tool.data "$tool"
report /tmp/rdmagrpc.data rdmagrpc
