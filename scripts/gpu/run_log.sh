# Sourced by the GPU scripts: the run's log, its clock and the machine's rules, set up one way.
#
#   source scripts/gpu/run_log.sh; begin_run OUT_DIR LOG_NAME     (then `say MESSAGE` logs with the time)
#
# Sets $out, $log (OUT_DIR/LOG_NAME, emptied), $PY (PYTHON, else python3) and the start time; exports
# this machine's rule (no NVLink multicast in NCCL, PyTorch or NVSHMEM: a shared host can lose GPUs to
# it) and unbuffered Python; writes the host line (date, RUN_COMMIT) and the GPUs to the log.
begin_run() {
  out=$1
  mkdir -p "$out"
  log=$out/$2
  : >"$log"
  PY=${PYTHON:-python3}
  t0=$(date +%s)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  {
    echo "== host: $(date -u +%FT%TZ) commit ${RUN_COMMIT:-unknown}"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  } | tee -a "$log"
}

elapsed() { echo $(( $(date +%s) - t0 )); }
say() { echo "== [$(elapsed) s] $*" | tee -a "$log"; }
