#!/usr/bin/env bash
# Installs the Debian packages `make test` needs when they are missing.
# Runs as root on Debian 12; elsewhere it only reports what is missing.
set -euo pipefail

# package:command-or-file that proves it is installed
need=(
  "libibverbs-dev:/usr/include/infiniband/verbs.h"   # cgo build of transport/verbs
  "librdmacm-dev:/usr/include/rdma/rdma_cma.h"
  "qemu-system-x86:/usr/bin/qemu-system-x86_64"       # the rxe tier
  "cpio:/usr/bin/cpio"
  "tmux:/usr/bin/tmux"                                # rdmatrace live-view test
)
missing=()
for n in "${need[@]}"; do
  pkg=${n%%:*} path=${n#*:}
  [ -e "$path" ] || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "deps: missing packages: ${missing[*]} (install them, or run as root on Debian)" >&2
  exit 0
fi
echo "deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
