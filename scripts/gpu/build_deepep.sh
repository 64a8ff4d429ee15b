#!/usr/bin/env bash
# Build DeepEP from the source carried with the tree, for sm_90 only, against the machine's torch
# and the NVSHMEM that torch's wheels installed (pip package nvidia-nvshmem-cu13). Fetches nothing.
#
#   bash scripts/gpu/build_deepep.sh [SRC] [PREFIX]     (from the repository root)
#
# SRC     DeepEP source (default: .gpu_bundle/deepep-src, else .gpu_bundle_deepep), not committed:
#         github.com/deepseek-ai/DeepEP branch antgroup-opt at 76f027117d76 (DeepEP PR #483), whose
#         low_latency_combine takes sglang's sm_90 comp_signal/block_m/threshold/num_sms; its
#         REVISION file records the commit.
# PREFIX  where `deep_ep` and `deep_ep_cpp*.so` are installed (default /tmp/deepep); use it with
#         PYTHONPATH=PREFIX. A build whose source hash matches PREFIX/.source-hash is reused.
#
# Environment: PYTHON (default python3), MAX_JOBS (default: all cores), BUILD_DIR (default
# /tmp/deepep-build), DEEPEP_HIDDEN (e.g. 7168: build the low-latency kernels for these hidden sizes
# only). Prints `import deep_ep: ok ...` or the import error as its last line.
set -euo pipefail

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: on a shared host it can take GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

PY=${PYTHON:-python3}
SRC=${1:-}
if [ -z "$SRC" ]; then
  for candidate in .gpu_bundle/deepep-src .gpu_bundle_deepep; do
    if [ -f "$candidate/setup.py" ]; then SRC=$candidate; break; fi
  done
fi
PREFIX=${2:-/tmp/deepep}
BUILD_DIR=${BUILD_DIR:-/tmp/deepep-build}
if [ -z "$SRC" ] || [ ! -f "$SRC/setup.py" ]; then
  echo "build_deepep: no DeepEP source (looked for .gpu_bundle/deepep-src and .gpu_bundle_deepep; pass SRC)" >&2
  exit 2
fi
SRC=$(cd "$SRC" && pwd)

# %% What we build against
# torch finds the toolkit through CUDA_HOME (a wrapper nvcc on PATH can mislead its guess).
if [ -z "${CUDA_HOME:-}" ]; then
  for candidate in /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; do
    if [ -f "$candidate/include/cuda_runtime.h" ]; then export CUDA_HOME=$candidate; break; fi
  done
fi
echo "== CUDA_HOME=${CUDA_HOME:-unset}"
# CUDA 13 moved libcu++ (cuda/std/...) under include/cccl: nvcc searches it, the host compiler that
# builds deep_ep.cpp (which includes nvshmem.h, which includes cuda/std/tuple) does not.
if [ -n "${CUDA_HOME:-}" ] && [ -d "$CUDA_HOME/include/cccl" ]; then
  export CPLUS_INCLUDE_PATH=$CUDA_HOME/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
fi
# torch's CUDA headers include cusparse.h, cublas_v2.h, ...: a compiler-only toolkit lacks them, the
# CUDA wheels that torch installed carry them (nvidia/cu13/include); used only where the toolkit has none.
if [ -n "${CUDA_HOME:-}" ] && [ ! -f "$CUDA_HOME/include/cusparse.h" ]; then
  WHEEL_INC=$("$PY" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
for root in (spec.submodule_search_locations if spec else []):
    for sub in ("cu13/include", "cusparse/include"):
        if (pathlib.Path(root) / sub / "cusparse.h").is_file():
            print(pathlib.Path(root) / sub)
            raise SystemExit
PY
  )
  if [ -n "$WHEEL_INC" ]; then
    export CPLUS_INCLUDE_PATH=${CPLUS_INCLUDE_PATH:+$CPLUS_INCLUDE_PATH:}$WHEEL_INC
    echo "== CUDA library headers (cusparse.h, ...) from the wheels: $WHEEL_INC"
  else
    echo "== warning: no cusparse.h in $CUDA_HOME/include nor in the nvidia wheels; torch's headers may not compile" >&2
  fi
fi
echo "== DeepEP source: $SRC"
[ -f "$SRC/REVISION" ] && sed 's/^/   /' "$SRC/REVISION"
echo "== nvcc: $(nvcc --version | tail -n 2 | tr '\n' ' ')"
"$PY" - <<'PY'
import sys, torch
print(f"== python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
PY

# NVSHMEM from the python package. Its wheel ships only the versioned host library
# (libnvshmem_host.so.3), while DeepEP's setup.py links `-l:libnvshmem_host.so` when NVSHMEM_DIR is
# set, so NVSHMEM_DIR points at a staging directory that links everything back to the package and
# adds the unversioned name. $ORIGIN lookups of NVSHMEM's plugins (bootstrap, transports) resolve there too.
NVSHMEM_PKG=$("$PY" -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0])') || {
  echo "build_deepep: the python package nvidia.nvshmem is not importable (pip package nvidia-nvshmem-cu13)" >&2
  exit 2
}
for f in include/nvshmem.h lib/libnvshmem_device.a; do
  [ -e "$NVSHMEM_PKG/$f" ] || { echo "build_deepep: $NVSHMEM_PKG/$f is missing" >&2; exit 2; }
done
HOST_LIB=$(cd "$NVSHMEM_PKG/lib" && ls libnvshmem_host.so* | head -n 1)
STAGE=/tmp/deepep-nvshmem
rm -rf "$STAGE" && mkdir -p "$STAGE/lib" "$STAGE/include"
for f in "$NVSHMEM_PKG"/include/*; do ln -s "$f" "$STAGE/include/"; done
for f in "$NVSHMEM_PKG"/lib/*; do ln -s "$f" "$STAGE/lib/"; done
# NVSHMEM's IBGDA device header includes <infiniband/mlx5dv.h> (rdma-core's development headers).
# Where the system lacks them, the copies carried beside the source go on the same include path.
if ! echo '#include <infiniband/mlx5dv.h>' | "${CXX:-c++}" -x c++ -E - >/dev/null 2>&1; then
  CARRIED=$SRC/third-party/include
  [ -f "$CARRIED/infiniband/mlx5dv.h" ] || { echo "build_deepep: no <infiniband/mlx5dv.h> here and none in $CARRIED" >&2; exit 2; }
  ln -s "$CARRIED/infiniband" "$STAGE/include/infiniband"
  echo '#include <rdma/ib_user_verbs.h>' | "${CXX:-c++}" -x c++ -E - >/dev/null 2>&1 || ln -s "$CARRIED/rdma" "$STAGE/include/rdma"
  echo "== rdma-core headers: the system has none; using $CARRIED"
fi
[ -e "$STAGE/lib/libnvshmem_host.so" ] || ln -s "$NVSHMEM_PKG/lib/$HOST_LIB" "$STAGE/lib/libnvshmem_host.so"
export NVSHMEM_DIR=$STAGE
echo "== NVSHMEM: $NVSHMEM_PKG (host library $HOST_LIB), NVSHMEM_DIR=$NVSHMEM_DIR"

# %% Build (skipped when PREFIX already holds a build of this very source)
HASH=$(cd "$SRC" && find . -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.hpp' \) -print0 \
  | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)-h${DEEPEP_HIDDEN:-all}
if [ -f "$PREFIX/.source-hash" ] && [ "$(cat "$PREFIX/.source-hash")" = "$HASH" ] && compgen -G "$PREFIX/deep_ep_cpp*.so" >/dev/null; then
  echo "== reusing the build in $PREFIX (source hash $HASH)"
else
  rm -rf "$BUILD_DIR" && mkdir -p "$BUILD_DIR" && cp -r "$SRC"/. "$BUILD_DIR"/
  if [ -n "${DEEPEP_HIDDEN:-}" ]; then
    # Instantiate the low-latency kernels for these hidden sizes only (upstream: eight sizes); the
    # other sizes then fail with DeepEP's own "Unsupported hidden". Shortens the longest compile.
    "$PY" - "$BUILD_DIR/csrc/kernels/launch.cuh" "$DEEPEP_HIDDEN" <<'PY'
import re, sys
path, sizes = sys.argv[1], [int(v) for v in sys.argv[2].split(",")]
text = open(path).read()
block = re.search(r"#define SWITCH_HIDDEN\(case_macro\)[^\n]*\n(?:[^\n]*\\\n)*[^\n]*\n", text)
assert block and "while (false)" in block.group(0), "SWITCH_HIDDEN not found in launch.cuh"
lines = ["#define SWITCH_HIDDEN(case_macro)", "    switch (hidden) {"]
lines += [f"        case {h}:  case_macro({h});" for h in sizes]
lines += ['        default:  EP_HOST_ASSERT(false and "Unsupported hidden");', "    }", "    while (false)"]
new = " \\\n".join(lines) + "\n"
open(path, "w").write(text[: block.start()] + new + text[block.end() :])
print("== SWITCH_HIDDEN limited to", sizes)
PY
  fi
  export TORCH_CUDA_ARCH_LIST=9.0            # H100/H200/H20 only: one arch, shortest build
  export DISABLE_SM90_FEATURES=0
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  # setup.py links -lcuda: the linker gets a directory holding libcuda.so (the driver's, found through
  # ldconfig, else the toolkit's stub: the same API, and the driver's is loaded at run time).
  CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
  LIBCUDA=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so / {print $NF; exit}' || true)
  [ -z "$LIBCUDA" ] && [ -e "$CUDA_ROOT/lib64/stubs/libcuda.so" ] && LIBCUDA=$CUDA_ROOT/lib64/stubs/libcuda.so
  [ -z "$LIBCUDA" ] && LIBCUDA=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 / {print $NF; exit}' || true)
  if [ -n "$LIBCUDA" ]; then
    LIBCUDA_DIR=/tmp/deepep-libcuda && mkdir -p "$LIBCUDA_DIR" && ln -sf "$LIBCUDA" "$LIBCUDA_DIR/libcuda.so"
    export LIBRARY_PATH=$LIBCUDA_DIR${LIBRARY_PATH:+:$LIBRARY_PATH}
  fi
  echo "== libcuda for linking: ${LIBCUDA:-none found (the link will fail)}"
  echo "== building in $BUILD_DIR with MAX_JOBS=$MAX_JOBS (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
  start=$(date +%s)
  (cd "$BUILD_DIR" && "$PY" setup.py build_ext --inplace) >"$BUILD_DIR/build.log" 2>&1 || {
    echo "build_deepep: the build failed; the last 60 lines of $BUILD_DIR/build.log:" >&2
    tail -n 60 "$BUILD_DIR/build.log" >&2
    exit 1
  }
  echo "== built in $(( $(date +%s) - start )) s"
  rm -rf "$PREFIX" && mkdir -p "$PREFIX"
  cp -r "$BUILD_DIR/deep_ep" "$BUILD_DIR"/deep_ep_cpp*.so "$PREFIX"/
  [ -f "$SRC/REVISION" ] && cp "$SRC/REVISION" "$PREFIX/"
  echo "$HASH" >"$PREFIX/.source-hash"
fi

# %% Check that it imports (needs the GPU machine's driver), and what its combine takes
export LD_LIBRARY_PATH=$NVSHMEM_PKG/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PYTHONPATH=$PREFIX${PYTHONPATH:+:$PYTHONPATH} "$PY" - <<'PY'
import inspect
try:
    import deep_ep
    params = list(inspect.signature(deep_ep.Buffer.low_latency_combine).parameters)
    print(f"import deep_ep: ok ({deep_ep.__file__}); low_latency_combine{tuple(params[1:])}")
except Exception as exc:  # report, don't hide: the benchmark prints the same failure later
    print(f"import deep_ep: FAILED {type(exc).__name__}: {exc}")
    raise SystemExit(1)
PY
