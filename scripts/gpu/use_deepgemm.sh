# Sourced by the GPU scripts: make sgl-deep-gemm (sglang 0.5.17's DeepGEMM, the down GEMM of the layer
# benchmark's `deepgemm` variant) importable, from the first of: the machine itself; the sglang bundle
# unpacked by an earlier call (/tmp/gpu-bundle/site, docs/gpu-check.md); wheels carried in .whl/
# (sgl_deep_gemm-0.1.5.post1-*.whl and apache_tvm_ffi-0.1.11-*cp312*.whl, downloaded with
# `pip download --no-deps sgl-deep-gemm==0.1.5.post1 -d .whl` and `pip download --no-deps
# apache-tvm-ffi==0.1.11 --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 -d .whl`).
# It never fails the run: without DeepGEMM the benchmark leaves the variant out and its report says why.
#
#   source scripts/gpu/use_deepgemm.sh; use_deepgemm     (after `begin_run`, scripts/gpu/run_log.sh: it uses `say`, $out and $PY)
use_deepgemm() {
  local site=/tmp/deepgemm-site wheel
  # DeepGEMM compiles its kernels on first use (nvcc, as sglang does); a warm machine keeps them here.
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deep-gemm-cache}
  if "$PY" -c 'import deep_gemm' >/dev/null 2>&1; then
    say "DeepGEMM: $("$PY" -c 'import deep_gemm; print(deep_gemm.__version__, deep_gemm.__file__)' 2>&1)"
    return 0
  fi
  if [ ! -d "$site/deep_gemm" ]; then
    mkdir -p "$site"
    wheel=$(ls .whl/sgl_deep_gemm-0.1.5.post1-*.whl 2>/dev/null | head -n 1)
    if [ -d /tmp/gpu-bundle/site/deep_gemm ] && [ -d /tmp/gpu-bundle/site/tvm_ffi ]; then
      ln -sfn /tmp/gpu-bundle/site/deep_gemm "$site/deep_gemm"
      ln -sfn /tmp/gpu-bundle/site/tvm_ffi "$site/tvm_ffi"
    elif [ -n "$wheel" ] && compgen -G ".whl/apache_tvm_ffi-0.1.11-*.whl" >/dev/null; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" .whl/apache_tvm_ffi-0.1.11-*.whl \
        >"$out/deepgemm_install.log" 2>&1 || true
    fi
  fi
  if PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import deep_gemm; print(deep_gemm.__version__)' \
    >"$out/deepgemm_import.log" 2>&1; then
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    say "DeepGEMM $(tail -n 1 "$out/deepgemm_import.log") from $site (JIT cache $DG_JIT_CACHE_DIR)"
  else
    say "DeepGEMM not importable (no bundle unpacked, no .whl/ wheels, or: $(tail -n 1 "$out/deepgemm_import.log")): the deepgemm variant is left out"
  fi
}
