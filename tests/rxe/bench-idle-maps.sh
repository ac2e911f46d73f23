#!/bin/sh
# Runs in the rxe guest (make bench-rxe-idle-maps): rdmabench's idle
# connections over verbs (IDLE of them, client and server in two
# processes), once per value in VALUES of the setting SETTING (unset: one
# run with the defaults). Every 5 s it sums the Rss of the uverbs
# mappings (the queues the device maps into the process: send queues,
# receive queues, CQs) over rdmabench's processes, and prints the peak
# beside rdmabench's own tables (RSS per end, goroutines, registered).
ulimit -n 1048576 2>/dev/null || ulimit -n 65536
for v in ${VALUES:-default}; do
	echo "=== ${SETTING:-defaults}=$v IDLE=$IDLE"
	if [ -n "$SETTING" ]; then export "$SETTING=$v"; fi
	/rxe/bin/rdmabench -rounds 0 -benchtime 10ms -oneprocess=false \
		-provider verbs -host "$RXE_ADDR" -idle "$IDLE" -fleet 0 > /tmp/idle.out 2>&1 &
	bp=$!
	peak=0
	while kill -0 $bp 2>/dev/null; do
		tot=0
		for p in /proc/[0-9]*; do
			[ "$(cat "$p/comm" 2>/dev/null)" = rdmabench ] || continue
			kb=$(awk '/uverbs/ {u = 1; next} /^[0-9a-f]+-[0-9a-f]+ / {u = 0} u && /^Rss:/ {s += $2} END {print s + 0}' "$p/smaps" 2>/dev/null)
			tot=$((tot + ${kb:-0}))
		done
		[ "$tot" -gt "$peak" ] && peak=$tot
		sleep 5
	done
	wait $bp
	echo "rdmabench exit $?; uverbs mappings at their peak, both processes: $peak kB"
	cat /tmp/idle.out
done
