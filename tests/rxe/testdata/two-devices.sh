#!/bin/sh
# Adds a second Soft-RoCE device, rxe1 on a dummy netdev with address
# $RXE_DEV2_ADDR, waits until its port is ACTIVE with an IPv4 GID, then
# runs "$@". For tests of connections through more than one device.
set -e
ip link add d1 type dummy
ip addr add "$RXE_DEV2_ADDR/24" dev d1
ip link set d1 up
rdma link add rxe1 type rxe netdev d1
port=/sys/class/infiniband/rxe1/ports/1
i=0
while :; do
	state=$(cat $port/state 2>/dev/null || true)
	gid=$(cat $port/gids/1 2>/dev/null || true)
	case "$state/$gid" in
	*ACTIVE/0000:0000:0000:0000:0000:ffff:*) break ;;
	esac
	i=$((i + 1))
	if [ $i -gt 300 ]; then
		echo "rxe1 not ready: state='$state' gid1='$gid'"
		exit 1
	fi
	usleep 50000
done
rdma link show
exec "$@"
