#!/bin/sh
# Runs in the rxe guest (make bench-rxe): first, unless REF=0, rdmagrpc's
# raw net.Conn beside perftest and rstream (bench-ref.sh); then, unless
# BENCH=0, rdmabench's idle connections and steady-state figures over
# verbs on rxe0; with ROUNDS > 0 (RXE_ROUNDS) the speed figures too,
# client and server in two processes of the guest, BENCHTIME each (under
# TCG they compare transports through one emulator: a ratio, not a
# speed). The descriptor limit is raised first: TCP's idle connections
# hold one per end (a verbs one holds none of its own).
if [ "${REF:-1}" != 0 ]; then
	ROUNDS="${REF_ROUNDS:-3}" /rxe/bin/bench-ref.sh || echo "bench-ref.sh: exit $?"
fi
[ "${BENCH:-1}" = 0 ] && exit 0
ulimit -n 1048576 2>/dev/null || ulimit -n 65536
echo "guest: descriptor limit $(ulimit -n), rxe0 at $RXE_ADDR"
exec /rxe/bin/rdmabench -rounds "${ROUNDS:-0}" -benchtime "${BENCHTIME:-10ms}" -oneprocess=false \
	-provider verbs -host "$RXE_ADDR" -idle "$IDLE"
