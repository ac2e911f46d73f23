#!/bin/sh
# Single-guest smoke payload: devices, a loopback RC ping-pong on rxe0,
# and the cgo memory-registration program and test binary.
set -e
ibv_devices
ibv_devinfo -d "$RXE_DEV"
ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n 50 &
srv=$!
ok=0
for i in 1 2 3 4 5 6 7 8 9 10; do
	if ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n 50 "$RXE_ADDR"; then ok=1; break; fi
	sleep 1
done
wait $srv
[ $ok = 1 ]
regmr
regmr.test -test.v -test.run TestRegMR
echo SMOKE-OK
