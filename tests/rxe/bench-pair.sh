#!/bin/sh
# Runs in both guests of an rxe pair (make bench-rxe-pair). First, unless
# REF=0, rdmagrpc's raw net.Conn beside perftest and rstream across the
# two (bench-ref.sh: the servers in guest A, the clients in guest B, which
# prints those tables). Then, unless BENCH=0: guest B (RXE_ROLE=b) serves
# rdmabench's server children through its spawner; guest A runs the bench
# against them, so client and server are two processes on two hosts, over
# rxe0 on each guest's eth0 (RoCE) and over TCP between the guests. Under
# TCG only the ratios within one run mean anything. B's spawner runs
# until A is done and the pair is torn down.
if [ "${REF:-1}" != 0 ]; then
	ROUNDS="${REF_ROUNDS:-${ROUNDS:-3}}" /rxe/bin/bench-ref.sh || echo "bench-ref.sh: exit $?"
fi
[ "${BENCH:-1}" = 0 ] && exit 0
ulimit -n 1048576 2>/dev/null || ulimit -n 65536
port=7470
echo "guest $RXE_ROLE: rxe0 at $RXE_ADDR, peer $RXE_PEER, $(nproc) vCPUs"
if [ "$RXE_ROLE" = b ]; then
	exec /rxe/bin/rdmabench -spawner ":$port" -host "$RXE_ADDR"
fi
exec /rxe/bin/rdmabench -remote "$RXE_PEER:$port" -rounds "${ROUNDS:-3}" -benchtime "${BENCHTIME:-300ms}" \
	-oneprocess=false -idle "${IDLE:-}" -fleet 0 -provider verbs -host "$RXE_ADDR"
