# Tier 3: Soft-RoCE in qemu guests (tests/rxe). Included by the top Makefile.
# Needs root. `deps` installs qemu-system-x86, libibverbs-dev and friends
# (scripts/deps.sh); the harness itself also installs qemu-system-x86 when
# missing and runs apt-get update when the guest packages cannot be resolved.
# The guest (Debian kernel + base initramfs) is built on first use and cached
# in $(RXE_CACHE), keyed by the Debian package versions.
RXE_CACHE   ?= $(or $(RDMAGRPC_RXE_CACHE),/tmp/rdmagrpc-rxe)
# Packages whose tests run inside the guest (go test -c, then the binary in
# the guest; TestRXEPair* tests also across two guests).
RXE_PKGS    ?= ./transport/verbs/ ./bpf/ ./conn/
RXE_TIMEOUT ?= 20m

.PHONY: test-rxe rxerun rxe-clean

test-rxe: deps
	RDMAGRPC_RXE=1 RDMAGRPC_RXE_CACHE=$(RXE_CACHE) RDMAGRPC_RXE_PKGS="$(RXE_PKGS)" \
	  $(GO) test -count=1 -p 1 -timeout $(RXE_TIMEOUT) -v ./tests/rxe/

# The hand-run tool: bin/rxerun -- ./some.test -test.v
rxerun:
	$(GO) build -o bin/rxerun ./tests/rxe/cmd/rxerun

rxe-clean:
	rm -rf $(RXE_CACHE)
