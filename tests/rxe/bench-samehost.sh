#!/bin/sh
# Runs in the rxe guest (make bench-rxe-samehost): client and server in two
# processes of one host that has an RDMA device. rdmagrpc with the provider
# chosen per connection (shm: the peer is on this kernel) and pinned to
# verbs (through rxe0, the NIC's loopback on real hardware), alternately,
# TCP in every run. Under TCG only the ratios within one run mean anything.
ulimit -n 65536
echo "guest: rxe0 at $RXE_ADDR, $(nproc) vCPUs"
for i in $(seq "${ITER:-2}"); do
	for p in chosen verbs; do
		echo "=== $p run $i"
		prov=""
		if [ "$p" = verbs ]; then prov="-provider verbs"; fi
		/rxe/bin/rdmabench -rounds "${ROUNDS:-3}" -benchtime "${BENCHTIME:-300ms}" -oneprocess=false -idle "" -fleet 0 \
			-enlarge 0 -sizes 64,65536,1048576 -conc 8 -raw 32768,1048576 -streams "" $prov -host "$RXE_ADDR" 2>&1
	done
done
