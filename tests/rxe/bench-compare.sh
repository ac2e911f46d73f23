#!/bin/sh
# Runs in the rxe guest (make bench-rxe-compare): two builds of rdmabench,
# before and after a change, alternately (before, after, before, after),
# each measuring TCP loopback and rdmagrpc over verbs on rxe0 with client
# and server in two processes. Under TCG only the ratios within one run
# mean anything.
ulimit -n 65536
echo "guest: rxe0 at $RXE_ADDR, $(nproc) vCPUs"
for i in 1 2; do
	for v in before after; do
		bin=/rxe/bin/rdmabench-$v
		echo "=== $v run $i"
		# Older builds have no -fleet; newer ones would run a fleet by default.
		fleet=""
		if "$bin" -h 2>&1 | grep -q -- -fleet; then fleet="-fleet 0"; fi
		"$bin" -rounds "${ROUNDS:-3}" -benchtime "${BENCHTIME:-300ms}" -oneprocess=false -idle "" $fleet \
			-provider verbs -host "$RXE_ADDR" 2>&1
	done
done
