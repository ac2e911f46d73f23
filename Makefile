# rdmagrpc — see README.md. `make test` is what CI runs (.ci/run).
GO      ?= go
PKGS    ?= ./...
# -p 2: these machines have two cores; more parallel test binaries only
# make the timing-sensitive transport tests flaky.
TESTFLAGS ?= -race -count=1 -p 2 -timeout 15m

.PHONY: all deps build test test-unit test-without-rdma-core test-rxe bench demo generate lint fuzz soak clean

all: build

deps:
	@./scripts/deps.sh

build: deps
	$(GO) build $(PKGS)

# Tier 1 and 2: unit, conformance (shm, one and two processes), end to end,
# eBPF probes (as root). Tier 3, the Soft-RoCE qemu guest, runs after them:
# never beside them on a 2-core machine.
test: deps
	$(MAKE) lint
	$(MAKE) test-unit
	$(MAKE) test-without-rdma-core
	$(MAKE) test-rxe

# Build, vet, a verbs-importing binary and the tier-1 tests on this machine
# with every rdma-core file removed (an overlay of /, entered by chroot).
test-without-rdma-core:
	./scripts/without-rdma-core.sh

test-unit:
	$(GO) test $(TESTFLAGS) $(PKGS)

# Side by side in one run: grpc-go over TCP loopback, a unix socket and
# rdmagrpc; markdown tables on stdout, progress on stderr. BENCHTIME is the
# measuring time per figure and transport per round, ROUNDS the number of
# interleaved rounds (medians reported), IDLE the idle connection counts.
# Measure alone: flock -x /tmp/rdmagrpc-tier.lock make bench
BENCHTIME ?= 300ms
ROUNDS    ?= 5
IDLE      ?= 1000,10000
bench: deps
	$(GO) run ./cmd/rdmabench -benchtime $(BENCHTIME) -rounds $(ROUNDS) -idle $(IDLE)

demo: deps
	$(GO) run -ldflags=-s=false ./cmd/demo

generate:
	$(GO) generate ./...

STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
# gofmt, go.mod as go mod tidy leaves it, vet and staticcheck; part of make test.
lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	$(GO) vet $(PKGS)
	$(STATICCHECK) $(PKGS)

FUZZTIME ?= 30s
fuzz:
	@for p in $$($(GO) list $(PKGS)); do \
	  for f in $$($(GO) test -list '^Fuzz' $$p 2>/dev/null | grep '^Fuzz'); do \
	    echo "== $$p $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$p || exit 1; \
	  done; done

# Soak: connections over shm for SOAKTIME, at least SOAKCONNS (conn/soak_test.go):
# messages across every threshold both ways with a CRC each, deadlines,
# closes mid-stream; fails on any corruption, hang or leak, prints figures.
SOAKTIME  ?= 60s
SOAKCONNS ?= 1000
SOAKFLAGS ?=
soak: deps
	RDMAGRPC_SOAK=$(SOAKTIME) RDMAGRPC_SOAK_CONNS=$(SOAKCONNS) $(GO) test $(SOAKFLAGS) -count=1 -timeout 30m -run '^TestSoak$$' -v ./conn/

clean:
	$(GO) clean -testcache

-include tests/rxe/rxe.mk
ifeq ($(wildcard tests/rxe/rxe.mk),)
test-rxe:
	@echo "test-rxe: the Soft-RoCE tier is not in this tree yet"
endif
