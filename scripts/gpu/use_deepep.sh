# Sourced by the GPU scripts: build DeepEP from the carried source into /tmp/deepep (its log in
# OUT/build.log) and put it, and the NVSHMEM its kernels link, on this shell's paths.
#
#   source scripts/gpu/use_deepep.sh; use_deepep OUT_DIR || exit 1     (after `begin_run`, scripts/gpu/run_log.sh: it uses `say`, $log and $PY)
use_deepep() {
  local out=$1
  say "building DeepEP (log: $out/build.log)"
  # The benchmarks use hidden 7168 only: building DeepEP's low-latency kernels for that size alone cuts
  # their compile from minutes to seconds (unset DEEPEP_HIDDEN to build all eight sizes).
  export DEEPEP_HIDDEN=${DEEPEP_HIDDEN-7168}
  if ! bash scripts/gpu/build_deepep.sh "" /tmp/deepep >"$out/build.log" 2>&1; then
    say "DeepEP build FAILED; the last lines of build.log:"
    tail -n 30 "$out/build.log" | tee -a "$log"
    return 1
  fi
  say "DeepEP: $(tail -n 1 "$out/build.log")"
  local nvshmem_lib
  nvshmem_lib=$("$PY" -c 'import nvidia.nvshmem as m; print(list(m.__path__)[0] + "/lib")')
  export PYTHONPATH=/tmp/deepep${PYTHONPATH:+:$PYTHONPATH}
  export LD_LIBRARY_PATH=$nvshmem_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
