# Tier 3: Soft-RoCE in qemu guests (tests/rxe). Included by the top Makefile.
# Needs root. `deps` installs qemu-system-x86, libibverbs-dev and friends
# (scripts/deps.sh); the harness itself also installs qemu-system-x86 when
# missing and runs apt-get update when the guest packages cannot be resolved.
# The guest (Debian kernel + base initramfs) is built on first use and cached
# in $(RXE_CACHE), keyed by the Debian package versions.
RXE_CACHE   ?= $(or $(RDMAGRPC_RXE_CACHE),/tmp/rdmagrpc-rxe)
# Packages whose tests run inside the guest (go test -c, then the binary in
# the guest; TestRXEPair* tests also across two guests).
RXE_PKGS    ?= ./transport/verbs/ ./bpf/ ./conn/ ./interop/
RXE_TIMEOUT ?= 20m
# Flags for the test binaries built for the guest: the race detector there
# too (it doubles the conn run under TCG, ≈ 5 min for the whole tier).
RXE_GOFLAGS ?= -race

.PHONY: test-rxe rxerun rxe-clean bench-rxe bench-rxe-idle-maps bench-rxe-compare bench-rxe-pair bench-rxe-ref bench-rxe-ref-pair bench-rxe-samehost perf-rxe

test-rxe: deps
	RDMAGRPC_RXE=1 RDMAGRPC_RXE_CACHE=$(RXE_CACHE) RDMAGRPC_RXE_PKGS="$(RXE_PKGS)" \
	  RDMAGRPC_RXE_GOFLAGS="$(RXE_GOFLAGS)" \
	  $(GO) test -count=1 -p 1 -timeout $(RXE_TIMEOUT) -v ./tests/rxe/

# The hand-run tool: bin/rxerun -- ./some.test -test.v
rxerun:
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun

rxe-clean:
	rm -rf $(RXE_CACHE)

# Idle connections and steady-state registrations over verbs on Soft-RoCE,
# in one guest (TCG: set-up takes about 20 ms per connection; 10,000 take
# about 5 minutes). The grpc-go timing figures are left out unless
# RXE_ROUNDS > 0 (RXE_BENCHTIME each): under TCG they measure the emulator,
# and only their ratios to TCP in the same guest mean something.
RXE_IDLE ?= 1000,10000
RXE_ROUNDS ?= 0
RXE_BENCHTIME ?= 300ms
# The speed-only targets below: RXE_ROUNDS, or 3 where it is 0.
RXE_SPEED_ROUNDS = $(if $(filter 0,$(RXE_ROUNDS)),3,$(RXE_ROUNDS))
# bench-rxe and bench-rxe-pair first measure rdmagrpc's raw net.Conn beside
# the device's reference tools in the same boot (tests/rxe/bench-ref.sh,
# rdmabench -ref): perftest over rdma_cm (ib_write_bw, ib_send_bw,
# ib_write_lat, ib_send_lat) and rsockets' rstream at RXE_REF_SIZES, and a
# 64 B ping-pong, RXE_SPEED_ROUNDS interleaved rounds, about 2 minutes a
# round under TCG. RXE_REF=0 leaves them out; bench-rxe-ref and
# bench-rxe-ref-pair run only them.
RXE_REF       ?= 1
RXE_REF_SIZES ?= 64,32768,1048576
# RXE_REF_FLAGS: more rdmabench -ref flags, e.g. "-refmb 32 -refmsgs 20000"
# (MiB and at most how many messages per bandwidth figure; default 128 and
# 100,000) or "-reflat 5000" (round trips per latency figure; 20,000).
RXE_REF_FLAGS ?=
RXE_REF_ENV    = -f tests/rxe/bench-ref.sh -e REF_SIZES=$(RXE_REF_SIZES) -e REF_ROUNDS=$(RXE_SPEED_ROUNDS) \
  -e "REF_FLAGS=$(RXE_REF_FLAGS)"
bench-rxe: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 3072 -timeout 30m -f bin/rdmabench -f tests/rxe/bench-idle.sh $(RXE_REF_ENV) \
	  -e REF=$(RXE_REF) -e IDLE=$(RXE_IDLE) -e ROUNDS=$(RXE_ROUNDS) -e BENCHTIME=$(if $(filter 0,$(RXE_ROUNDS)),10ms,$(RXE_BENCHTIME)) \
	  -- /rxe/bin/bench-idle.sh

# Only the reference tools beside rdmagrpc, in one guest (about 6 minutes
# with 3 rounds).
bench-rxe-ref: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 2048 -timeout 30m -f bin/rdmabench -f tests/rxe/bench-idle.sh $(RXE_REF_ENV) \
	  -e REF=1 -e BENCH=0 -- /rxe/bin/bench-idle.sh

# Idle connections over verbs with the device's mappings counted
# (tests/rxe/bench-idle-maps.sh): RXE_IDLE of them (1000 unless set),
# once per value in RXE_VALUES of the setting RXE_SETTING, e.g.
# RXE_SETTING=RDMAGRPC_VERBS_RECV_POOL RXE_VALUES="511 0". 10,000 take
# about 15 minutes under TCG.
RXE_IDLE ?= 1000
bench-rxe-idle-maps: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 3072 -timeout 60m -f bin/rdmabench -f tests/rxe/bench-idle-maps.sh \
	  -e IDLE=$(RXE_IDLE) -e SETTING=$(RXE_SETTING) -e "VALUES=$(RXE_VALUES)" -- /rxe/bin/bench-idle-maps.sh

# The speed figures over verbs before and after a change: rdmabench built
# at BEFORE (a commit; a git worktree) and here, run alternately in one
# boot of the guest (tests/rxe/bench-compare.sh), RXE_ROUNDS rounds each
# (3 unless set above 0). Takes about 8 minutes under TCG.
BEFORE ?= HEAD~1
bench-rxe-compare: deps
	git worktree prune; rm -rf $(RXE_CACHE)/before-src && git worktree add --detach $(RXE_CACHE)/before-src $(BEFORE)
	cd $(RXE_CACHE)/before-src && $(GO) build -o $(CURDIR)/bin/rdmabench-before ./cmd/rdmabench; \
	  st=$$?; cd $(CURDIR) && git worktree remove --force $(RXE_CACHE)/before-src; exit $$st
	$(GO) build -o bin/rdmabench-after ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 3072 -timeout 40m -f bin/rdmabench-before -f bin/rdmabench-after \
	  -f tests/rxe/bench-compare.sh -e ROUNDS=$(RXE_SPEED_ROUNDS) -e BENCHTIME=$(RXE_BENCHTIME) \
	  -- /rxe/bin/bench-compare.sh

# The speed figures with client and server on two hosts: two guests, rdmabench
# in guest A and its server children in guest B (rdmabench -spawner there,
# -remote here; tests/rxe/bench-pair.sh), RDMA over rxe0 on each guest's
# e1000 and TCP between the guests; RXE_ROUNDS rounds (3 unless set above 0).
# Both guests share this host's cores: under TCG only ratios mean anything.
bench-rxe-pair: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 2048 -timeout 50m -pair -f bin/rdmabench -f tests/rxe/bench-pair.sh $(RXE_REF_ENV) \
	  -e REF=$(RXE_REF) -e ROUNDS=$(RXE_SPEED_ROUNDS) -e BENCHTIME=$(RXE_BENCHTIME) \
	  -b /rxe/bin/bench-pair.sh -- /rxe/bin/bench-pair.sh

# Same host, RDMA device present: rdmagrpc as it chooses per connection
# (shm for a peer of this kernel) against rdmagrpc pinned to verbs, client
# and server in two processes of one guest, alternately, TCP in every run
# (tests/rxe/bench-samehost.sh); RXE_ROUNDS rounds (3 unless set above 0).
bench-rxe-samehost: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 3072 -timeout 40m -f bin/rdmabench -f tests/rxe/bench-samehost.sh \
	  -e ROUNDS=$(RXE_SPEED_ROUNDS) -e BENCHTIME=$(RXE_BENCHTIME) \
	  -- /rxe/bin/bench-samehost.sh

# Only the reference tools beside rdmagrpc, across the two guests: the
# servers in guest A, the clients in guest B, which prints the tables.
bench-rxe-ref-pair: deps
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	bin/rxerun -cache $(RXE_CACHE) -mem 2048 -timeout 30m -pair -f bin/rdmabench -f tests/rxe/bench-pair.sh $(RXE_REF_ENV) \
	  -e REF=1 -e BENCH=0 -b /rxe/bin/bench-pair.sh -- /rxe/bin/bench-pair.sh

# Where the time goes over verbs: perf in the guest (tests/rxe/perf-ref.sh),
# a whole-guest CPU profile while perftest, then rdmagrpc's raw halves, run
# PERF_OP (write or pingpong) at PERF_SIZE bytes PERF_COUNT times; reports
# by thread, symbol and callers on stdout. perf is this host's (Debian's
# linux-perf), copied into the guest with the libraries it links.
PERF_OP    ?= write
PERF_SIZE  ?= 32768
PERF_COUNT ?= 4096
perf-rxe: deps
	@command -v perf >/dev/null || { echo "perf-rxe: no perf on this host: apt-get install linux-perf" >&2; exit 1; }
	$(GO) build -o bin/rdmabench ./cmd/rdmabench
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun
	rm -rf bin/perf-guest && mkdir -p bin/perf-guest && cp "$$(command -v perf)" bin/perf-guest/ && \
	  for l in $$(ldd "$$(command -v perf)" | awk '/=>/ { print $$3 }'); do cp -L "$$l" bin/perf-guest/ || exit 1; done
	bin/rxerun -cache $(RXE_CACHE) -mem 2048 -timeout 20m -f bin/rdmabench -f bin/perf-guest -f tests/rxe/perf-ref.sh \
	  -e PERF_OP=$(PERF_OP) -e PERF_SIZE=$(PERF_SIZE) -e PERF_COUNT=$(PERF_COUNT) -- /rxe/bin/perf-ref.sh
