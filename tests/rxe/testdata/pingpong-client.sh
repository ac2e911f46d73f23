#!/bin/sh
# Pair payload for guest B: the server in guest A may still be booting.
for i in $(seq 1 30); do
	ibv_rc_pingpong -d "$RXE_DEV" -g "$RXE_GID_INDEX" -n "${ITERS:-100}" "$RXE_PEER" && exit 0
	sleep 1
done
echo "no server at $RXE_PEER" >&2
exit 1
