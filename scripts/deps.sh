#!/usr/bin/env bash
# Installs the Debian packages `make test` needs when they are missing.
# Runs as root on Debian 12; elsewhere it only reports what is missing.
set -euo pipefail

# package:command-or-file that proves it is installed
need=(
  # Not needed to build (transport/verbs declares the ABI itself and loads
  # the libraries at run time): TestABIMatchesSystemHeaders compares our
  # declarations with these headers, and the rxe tier's regmr helper links them.
  "libibverbs-dev:/usr/include/infiniband/verbs.h"
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
# A mirror can fail a download once: apt retries each file, and the whole
# update + install is tried three times.
for attempt in 1 2 3; do
  if apt-get -o Acquire::Retries=3 update -qq &&
     apt-get -o Acquire::Retries=3 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    exit 0
  fi
  echo "deps: apt-get failed (attempt $attempt of 3)" >&2
  sleep $((attempt * 5))
done
echo "deps: could not install ${missing[*]}" >&2
exit 1
