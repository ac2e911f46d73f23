#!/usr/bin/env bash
# A machine without rdma-core, made from this one: an overlay of / in which
# every file of the rdma-core packages is whited out, entered with chroot.
# There it checks what a new user and an operator meet (issue 19):
#   - go build ./..., go vet ./... and the tier-1 tests pass;
#   - a binary importing transport/verbs links neither libibverbs nor
#     librdmacm (ldd);
#   - that binary starts and serves over shm, and says why verbs is
#     unavailable: with no RDMA device here, and with one faked (sysfs and
#     /dev entries) so that the missing library is the reason.
# Needs root (mount, chroot). Run by `make test` (test-without-rdma-core).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

if [ "$(id -u)" != 0 ]; then
  echo "without-rdma-core: SKIP: needs root (overlay mount and chroot)"
  exit 0
fi
pkgs=(libibverbs1 librdmacm1 libibverbs-dev librdmacm-dev ibverbs-providers)
files=$(dpkg -L "${pkgs[@]}" 2>/dev/null | sort -u || true)
if [ -z "$files" ]; then
  echo "without-rdma-core: rdma-core is not installed here at all; checking on this machine as it is"
fi

gocache=$(go env GOCACHE) gomodcache=$(go env GOMODCACHE) goroot=$(go env GOROOT)
work=$(mktemp -d /tmp/without-rdma-core.XXXXXX)
# Everything below runs in a private mount namespace: its mounts end with
# it, and $work is an empty directory again (never rm -r it while the
# namespace lives: the repository is bind-mounted under it).
rc=0
unshare -m --propagation private bash -s "$work" "$repo" "$gocache" "$gomodcache" "$goroot" <<'INNER' 3<<<"$files" || rc=$?
set -euo pipefail
work=$1 repo=$2 gocache=$3 gomodcache=$4 goroot=$5
mount -t tmpfs tmpfs "$work"
mkdir -p "$work"/{upper,wk,root}
whited=0
while read -r f; do
  [ -n "$f" ] || continue
  if [ -f "$f" ] || [ -L "$f" ]; then
    mkdir -p "$work/upper$(dirname "$f")"
    mknod "$work/upper$f" c 0 0 # an overlay whiteout: the file is gone
    whited=$((whited + 1))
  fi
done <&3
mount -t overlay overlay -o "lowerdir=/,upperdir=$work/upper,workdir=$work/wk" "$work/root"
r=$work/root
mount -t proc proc "$r/proc"
# A /dev of our own (the fake RDMA device below must not touch the host's).
mount -t tmpfs -o mode=755 tmpfs "$r/dev"
for n in null zero full random urandom tty; do
  touch "$r/dev/$n"
  mount --bind "/dev/$n" "$r/dev/$n"
done
mkdir "$r/dev/shm" "$r/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$r/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$r/dev/pts" # tmux, in rdmatrace's tests
ln -s pts/ptmx "$r/dev/ptmx"
ln -s /proc/self/fd "$r/dev/fd"
mount --rbind /sys "$r/sys"
# A fresh /tmp first: the repository may live under it (CI's clean clone).
mount -t tmpfs tmpfs "$r/tmp"
for d in "$repo" "$gocache" "$gomodcache" "$goroot"; do
  mkdir -p "$r$d"
  mount --bind "$d" "$r$d"
done
echo "without-rdma-core: $whited files of rdma-core whited out"

chroot "$r" /usr/bin/env -i PATH="$goroot/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  HOME=/root GOCACHE="$gocache" GOMODCACHE="$gomodcache" GOPROXY=off GOTOOLCHAIN=local \
  bash -s "$repo" <<'CHROOT'
set -euo pipefail
cd "$1"
fail() { echo "without-rdma-core: FAIL: $*" >&2; exit 1; }
step() { echo "without-rdma-core: $*"; }

ldconfig # the cache a machine without the packages has
[ ! -e /usr/include/infiniband/verbs.h ] || fail "verbs.h is still visible"
! ldconfig -p | grep -q 'libibverbs\|librdmacm' || fail "the loader cache still lists rdma-core"
if ls /usr/lib/*/libibverbs.so* /usr/lib/*/librdmacm.so* >/dev/null 2>&1; then fail "rdma-core libraries still visible"; fi
step "no rdma-core headers or libraries"

step "go build ./..."; go build ./...
step "go vet ./...";   go vet ./...
step "CGO_ENABLED=0 go build ./..."; CGO_ENABLED=0 go build ./...

bin=/tmp/quiet
go build -o "$bin" ./conn/testdata/quiet
if ldd "$bin" | grep -q 'libibverbs\|librdmacm'; then ldd "$bin"; fail "the binary links rdma-core"; fi
step "ldd of a binary importing transport/verbs: $(ldd "$bin" | awk '{print $1}' | tr '\n' ' ')"

out=$(RDMAGRPC_LOG=debug "$bin" 2>&1) || fail "the binary did not serve: $out"
echo "$out" | grep -q 'provider=shm' || fail "not served over shm: $out"
echo "$out" | grep -q 'no RDMA device' || fail "the reason is not given: $out"
step "no device: served over shm; $(echo "$out" | grep -o 'why="[^"]*"' | head -1)"

# A node with an RDMA NIC but no rdma-core: fake the kernel's side.
mount -t tmpfs tmpfs /sys/class
mkdir -p /sys/class/infiniband/fake0
mkdir -p /dev/infiniband
touch /dev/infiniband/uverbs0 /dev/infiniband/rdma_cm
out=$(RDMAGRPC_LOG=debug "$bin" 2>&1) || fail "the binary did not serve: $out"
echo "$out" | grep -q 'provider=shm' || fail "not served over shm: $out"
echo "$out" | grep -q 'libibverbs.so.1: cannot open shared object file' || fail "the missing library is not named: $out"
step "device but no rdma-core: served over shm; $(echo "$out" | grep -o 'why="[^"]*"' | head -1)"
umount /sys/class
rm -r /dev/infiniband

step "tier-1 tests: go test ./..."
go test -count=1 -p 2 ./...
step "PASS"
CHROOT
INNER
rmdir "$work" 2>/dev/null || true
exit $rc
