#!/bin/sh
# Runs in the rxe guest (make bench-rxe): rdmabench's idle connections and
# steady-state figures over verbs on rxe0. One completion channel
# descriptor per connection end: the descriptor limit is raised first.
ulimit -n 1048576 2>/dev/null || ulimit -n 65536
echo "guest: descriptor limit $(ulimit -n), rxe0 at $RXE_ADDR"
exec /rxe/bin/rdmabench -rounds 0 -benchtime 10ms -provider verbs -host "$RXE_ADDR" -idle "$IDLE"
