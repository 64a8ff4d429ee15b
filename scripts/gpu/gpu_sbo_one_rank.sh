#!/usr/bin/env bash
# SBO's real chain on one H200: build DeepEP (antgroup-opt, the signal layout sglang's sm_90 path
# takes) from the carried source; run the kernels' GPU tests for the signals (the polling-consumer
# ordering test and the warp-specialized kernel) into a fresh Triton cache and check the PTX they
# compiled for the proxy fence before every release (scripts/gpu/check_ptx_fences.py); run DeepEP's
# own low-latency test with one rank; then benchmarks/bench_moe_layer.py on one GPU at each
# max_block_n sglang passes (256 and 160): our signal GEMM feeding DeepEP's real low_latency_combine,
# which reads the rows by TMA, checked against the non-overlapped combine and a torch reference over
# CUDA-graph replays. Fetches nothing; about 7 minutes at most.
#
#   bash scripts/gpu/gpu_sbo_one_rank.sh OUT_DIR      (from the repository root; carry .gpu_bundle/deepep-src)
#
# OUT_DIR gets: build.log (the DeepEP build), kernel_tests.log, ptx_fences.json, deepep_test.log
# (DeepEP's tests/test_low_latency.py), decode_1gpu_bn<N>.json (the layer: per token count the
# variants' outputs, errors, times and experts without tokens), run.log. A part of the sglang bundle
# carried as well (docs/gpu-check.md) is kept for the next call first. SKIP_DEEPEP_TEST=1 skips
# DeepEP's own test; MAX_BLOCK_NS (default "256 160") picks the layer runs.
# One rank has no peer and no NIC: DeepEP copies locally. What this shows is the chain's
# correctness and SBO's overhead; RDMA, NVLink peers, multi-rank skew and the gain need two GPUs.
set -uo pipefail
# DeepEP's layered low-latency dispatch sizes its buffers by nodes of 8 GPUs (it asserts num_ranks % 8 == 0).
export DEEPEP_DISABLE_LL_DISPATCH_OPT=1
RUN_COMMIT=${SBO_COMMIT:-unknown}
source scripts/gpu/run_log.sh
begin_run "${1:?usage: gpu_sbo_one_rank.sh OUT_DIR}" run.log
{
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)' 2>&1
} | tee -a "$log"

if [ -f .gpu_bundle/manifest.json ]; then
  # Keep the carried part of the sglang bundle for the next call, even if this one runs out of time
  # (a subshell: use_bundle ends its shell while a part is still missing).
  ( source scripts/gpu/use_bundle.sh; use_bundle ) 2>&1 | tail -n 2 | tee -a "$log"
fi

source scripts/gpu/use_deepep.sh
use_deepep "$out" || exit 1

# The kernels' tests import sglang_pd from this tree (.mypy-root links its parts).
export TRITON_CACHE_DIR=/tmp/triton-cache-one-rank-$$
say "kernels' GPU tests: signal ordering (1,000 runs a layout), the warp-specialized kernel (Triton cache $TRITON_CACHE_DIR)"
PYTHONPATH=.mypy-root:.${PYTHONPATH:+:$PYTHONPATH} timeout 240 "$PY" -m pytest tests/kernels -m gpu -q -p no:cacheprovider \
  -k "ordering or ws_ or default_config or deepgemm_compatible" >"$out/kernel_tests.log" 2>&1
say "kernel tests exit $?: $(tail -n 1 "$out/kernel_tests.log")"
grep -E "runs, |FAILED|Error" "$out/kernel_tests.log" | head -n 12 | tee -a "$log"
"$PY" scripts/gpu/check_ptx_fences.py "$TRITON_CACHE_DIR" --json "$out/ptx_fences.json" 2>&1 | tee -a "$log"

if [ "${SKIP_DEEPEP_TEST:-0}" != 1 ]; then
  say "DeepEP's test_low_latency.py, one rank, 16 experts"
  ( cd .gpu_bundle/deepep-src/tests && timeout 150 "$PY" test_low_latency.py --num-processes 1 --num-experts 16 ) \
    >"$out/deepep_test.log" 2>&1
  say "test_low_latency exit $? ($(grep -c . "$out/deepep_test.log") lines; the last:)"
  tail -n 8 "$out/deepep_test.log" | tee -a "$log"
fi

# 1 token: 8 of the 16 experts get none; 256 tokens: 128 per expert, above the 64-row tile.
# 50 replays x 20 timings = 1,000 replays of each captured variant.
port=27321
for bn in ${MAX_BLOCK_NS:-256 160}; do
  say "bench_moe_layer.py --gpus 1 --max-block-n $bn"
  SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256 timeout 200 "$PY" benchmarks/bench_moe_layer.py --gpus 1 \
    --mode decode --num-experts 16 --tokens 1,8,64,128,256 --iters 50 --repeats 20 --combine-sms 3 \
    --max-block-n "$bn" --json "$out/decode_1gpu_bn$bn.json" --deadline-s 180 --hang-s 60 --port "$port" \
    >"$out/bench_bn$bn.log" 2>&1
  say "bench exit $?"
  tail -n 10 "$out/bench_bn$bn.log" | tee -a "$log"
  port=$((port + 10))
done
say "done"
