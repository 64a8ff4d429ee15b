#!/usr/bin/env bash
# Lay out the DeepEP source the GPU scripts carry: .gpu_bundle/deepep-src (ignored by git).
#
#   bash scripts/gpu/deepep_source.sh DEEPEP_CLONE [REVISION]      (here, with a package index)
#
# REVISION defaults to the one the image builds (DEEPEP_REVISION in deploy/common/contract.py):
# DeepEP's antgroup-opt branch (DeepEP PR #483). The GPU machine lacks rdma-core's development
# headers, which NVSHMEM's IBGDA header includes, so Debian's libibverbs-dev and linux-libc-dev
# headers go under third-party/include (scripts/gpu/build_deepep.sh uses them only where the
# machine has none). Run `scripts/gpu/gpu_bundle.py` first: it replaces .gpu_bundle/ whole.
set -euo pipefail
clone=${1:?usage: deepep_source.sh DEEPEP_CLONE [REVISION]}
rev=${2:-$(sed -n 's/^DEEPEP_REVISION = "\(.*\)"/\1/p' deploy/common/contract.py)}
dest=.gpu_bundle/deepep-src
rm -rf "$dest" && mkdir -p "$dest/third-party/include"
git -C "$clone" archive "$rev" | tar -x -C "$dest"
git -C "$clone" rev-parse "$rev" >"$dest/REVISION"
debs=$(mktemp -d)
(cd "$debs" && apt-get download libibverbs-dev linux-libc-dev >/dev/null 2>&1)
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
cp -r "$debs/root/usr/include/infiniband" "$debs/root/usr/include/rdma" "$dest/third-party/include/"
rm -rf "$debs"
echo "deepep-src: $(cat "$dest/REVISION") ($(du -sh "$dest" | cut -f1))"
