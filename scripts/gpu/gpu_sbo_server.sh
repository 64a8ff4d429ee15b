#!/usr/bin/env bash
# SBO inside real sglang 0.5.17 on one H200, from a clean checkout without internet:
#
#   bash scripts/gpu/gpu_sbo_server.sh OUT_DIR [STAGES]      (from the repository root)
#
# Carry .gpu_bundle/deepep-src (scripts/gpu/deepep_source.sh) and, call by call, the sglang bundle's
# parts with its manifest (docs/gpu-check.md). The first call builds DeepEP antgroup-opt into /tmp
# (reused while the machine stays warm) and keeps the part it carries; once all parts are held it
# unpacks sglang 0.5.17, writes unit-scale FP8 weights into the `single-h200-sbo` preset's model
# folder (scripts/gpu/fp8_checkpoint.py) and runs scripts/gpu/gpu_sbo_server.py: a decode server with
# and without full SBO, then the preset's PD stack through our router (STAGES: sbo,nosbo,pd).
# Stages are measured in the order given (sbo,nosbo,sbo: a step-time A/B in one call).
# SBO_TOGETHER=1 starts their servers at once and measures them once all are ready (pd,sbo in one
# call: the stack stops before the SBO server's step times are taken; nosbo does not fit beside
# them). SBO_GEMM_FAULT=1 arms the SBO server with the must-fail control (gpu_sbo_server.py --gemm-fault).
# SBO_COMMIT names the commit checked; SBO_DEADLINE_S bounds the run.
set -euo pipefail
out=${1:?usage: gpu_sbo_server.sh OUT_DIR [STAGES]}
stages=${2:-sbo,nosbo,pd}
# One rank: antgroup-opt's layered low-latency dispatch sizes its buffers by nodes of 8 GPUs.
export DEEPEP_DISABLE_LL_DISPATCH_OPT=1
RUN_COMMIT=${SBO_COMMIT:-unknown}
source scripts/gpu/run_log.sh
begin_run "$out" run.log

source scripts/gpu/use_deepep.sh
use_deepep "$out" || exit 1

source scripts/gpu/use_bundle.sh
use_bundle  # ends this call (exit 0) while a part is still to be carried
"$PY" - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for mod in ("sglang", "sgl_kernel", "deep_gemm", "deep_ep", "flashinfer", "mooncake.engine", "sglang_pd.sglang_patches"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "ok"), getattr(m, "__file__", ""))
    except Exception as exc:
        print(mod, "FAILED:", type(exc).__name__, exc)
PY
model=deploy/spec/presets/models/tiny-deepseek-v3-fp8
if [ ! -f "$model/model.safetensors" ]; then  # kept by a warm machine between calls (ignored by git)
  say "unit-scale FP8 weights for the preset's model"
  "$PY" scripts/gpu/fp8_checkpoint.py "$model" | tee -a "$log"
fi
say "gpu_sbo_server.py --stages $stages"
set +e
"$PY" scripts/gpu/gpu_sbo_server.py --out "$out" --stages "$stages" --commit "${SBO_COMMIT:-unknown}" \
  --deadline-s "${SBO_DEADLINE_S:-480}" ${SBO_TOGETHER:+--together} ${SBO_GEMM_FAULT:+--gemm-fault}
rc=$?
say "gpu_sbo_server.py exit $rc"
exit "$rc"
