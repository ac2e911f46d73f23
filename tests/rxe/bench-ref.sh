#!/bin/sh
# Runs in the rxe guest (make bench-rxe, bench-rxe-ref; in both guests of
# bench-rxe-pair, from bench-pair.sh): rdmagrpc's raw net.Conn over verbs
# beside the device's own reference tools, in one boot, rounds
# interleaved, medians (rdmabench -ref): perftest over rdma_cm
# (ib_write_bw, ib_send_bw, ib_write_lat, ib_send_lat on rxe0, GID index
# 1) and rsockets' rstream, at REF_SIZES (64 B, 32 KiB, 1 MiB), and a 64 B
# ping-pong. Server and client are two processes: in one guest, both
# here, the server on RXE_ADDR; in a pair, the servers in guest A
# (rdmabench -refcontrol) and the clients in guest B, which prints the
# tables. REF_CONNS (default 8): the bandwidth sizes again over that many
# connections at once, against ib_write_bw -q (0: not measured).
# REF_FLAGS: more rdmabench flags (-refmb, -refmsgs, -reflat).
# Under TCG only the ratios within one run mean anything.
ulimit -n 65536
port=7480
sizes="${REF_SIZES:-64,32768,1048576}"
rounds="${ROUNDS:-3}"
conns="${REF_CONNS:-8}"
echo "guest ${RXE_ROLE:-single}: rxe0 at $RXE_ADDR, peer $RXE_PEER, $(nproc) vCPUs; $(ib_write_bw -V 2>&1 | head -n 1)"
case "$RXE_ROLE" in
a)
	/rxe/bin/rdmabench -refcontrol ":$port"
	;;
b)
	/rxe/bin/rdmabench -ref -refpeer "$RXE_PEER:$port" -host "$RXE_PEER" -provider verbs \
		-refdev "${RXE_DEV:-rxe0}" -refgid "${RXE_GID_INDEX:-1}" -raw "$sizes" -rounds "$rounds" -refconns "$conns" $REF_FLAGS
	;;
*)
	/rxe/bin/rdmabench -ref -host "$RXE_ADDR" -provider verbs \
		-refdev "${RXE_DEV:-rxe0}" -refgid "${RXE_GID_INDEX:-1}" -raw "$sizes" -rounds "$rounds" -refconns "$conns" $REF_FLAGS
	;;
esac
