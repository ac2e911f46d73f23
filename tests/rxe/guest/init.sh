#!/bin/sh
# PID 1 of the rxe guest. Brings up rxe0 and runs /rxe/payload.sh.
# The payload's output goes to ttyS1 between marker lines that carry a
# per-run nonce; ttyS0 is the kernel console. Any failure powers off.
# Busybox applets live in their own directory, last in PATH, so that the
# real Debian tools (iproute2's ip, for one) win.
export PATH=/rxe/bin:/usr/sbin:/usr/bin:/usr/libexec/busybox HOME=/root TMPDIR=/tmp
/bin/busybox mkdir -p /usr/libexec/busybox
/bin/busybox --install -s /usr/libexec/busybox
mkdir -p /proc /sys /dev /tmp /run /root /rxe/work
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
out=/dev/ttyS1
# No \n -> \r\n translation: the host gets the bytes the payload wrote.
stty -F $out raw -echo 2>/dev/null
# Set-up messages go to ttyS1 too; the host keeps them for error reports.
exec </dev/null >$out 2>&1
. /rxe/run.env
say() { printf '%s\n' "$*" >$out; }
fail() {
	say "@@RXE-$RXE_NONCE-FAIL $*@@"
	sync
	poweroff -f
}
mdir=/lib/modules/$(uname -r)
for m in $(cat /etc/rxe/modules); do
	# RXE_NO_RDMA=1: a host without RDMA (mixed-fleet tests): no rdma_rxe.
	case "$RXE_NO_RDMA/$m" in 1/*rdma_rxe*) continue ;; esac
	insmod "$mdir/$m" || fail "insmod $m"
done
ip link set lo up
dev=$RXE_NETDEV
if [ "$dev" = d0 ]; then
	ip link add d0 type dummy || fail "ip link add d0 type dummy"
fi
i=0
while [ ! -e /sys/class/net/$dev ]; do
	i=$((i + 1)); [ $i -gt 100 ] && fail "no netdev $dev"
	usleep 50000
done
ip addr add "$RXE_ADDR/24" dev $dev || fail "ip addr add $RXE_ADDR dev $dev"
ip link set $dev up || fail "ip link set $dev up"
port=/sys/class/infiniband/rxe0/ports/1
[ "$RXE_NO_RDMA" = 1 ] || rdma link add rxe0 type rxe netdev $dev || fail "rdma link add rxe0 netdev $dev"
i=0
while [ "$RXE_NO_RDMA" != 1 ]; do
	state=$(cat $port/state 2>/dev/null)
	gid=$(cat $port/gids/1 2>/dev/null)
	case "$state/$gid" in
	*ACTIVE/0000:0000:0000:0000:0000:ffff:*) break ;;
	esac
	i=$((i + 1)); [ $i -gt 300 ] && fail "rxe0 not ready: state='$state' gid1='$gid'"
	usleep 50000
done
say "@@RXE-$RXE_NONCE-READY@@"
cd /rxe/work
# RXE_WATCHDOG=N (seconds): a payload still running after N has every
# user task's state, wait channel and kernel stack printed, so that a run
# the host gives up on says where it stood (a task stuck in the kernel
# outlives even its own test's time-out).
sh /rxe/payload.sh >$out 2>&1 </dev/null &
payload=$!
if [ -n "$RXE_WATCHDOG" ]; then
	(
		sleep "$RXE_WATCHDOG"
		say "@@ watchdog: payload still running after ${RXE_WATCHDOG}s; user tasks: @@"
		for t in /proc/[0-9]*/task/[0-9]*; do
			# Kernel threads have an empty command line (and /proc
			# files a size of 0, so test its content).
			[ -n "$({ tr '\0' ' ' <"${t%/task/*}/cmdline"; } 2>/dev/null)" ] || continue
			{ read -r stat <"$t/stat"; } 2>/dev/null || continue
			rest=${stat##*) }
			say "-- $t $(cat "$t/comm" 2>/dev/null): state ${rest%% *}, wchan $(cat "$t/wchan" 2>/dev/null)"
			sed 's/^/     /' "$t/stack" 2>/dev/null >$out
		done
		echo w >/proc/sysrq-trigger 2>/dev/null
	) &
	watchdog=$!
fi
wait $payload
rc=$?
[ -n "$watchdog" ] && kill $watchdog 2>/dev/null
printf '\n@@RXE-%s-EXIT %d@@\n' "$RXE_NONCE" $rc >$out
sync
poweroff -f
