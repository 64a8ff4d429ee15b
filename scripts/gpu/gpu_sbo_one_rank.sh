#!/usr/bin/env bash
# SBO's real chain on one H200: build DeepEP (antgroup-opt, the signal layout sglang's sm_90 path
# takes) from the carried source, run DeepEP's own low-latency test with one rank, then run
# benchmarks/bench_moe_layer.py on one GPU: our signal GEMM feeding DeepEP's real
# low_latency_combine, checked against the non-overlapped combine and a torch reference, over CUDA
# graph replays. Fetches nothing; about 6 minutes at most.
#
#   bash scripts/gpu/gpu_sbo_one_rank.sh OUT_DIR      (from the repository root; carry .gpu_bundle/deepep-src)
#
# OUT_DIR gets: build.log (the DeepEP build), deepep_test.log (DeepEP's tests/test_low_latency.py),
# decode_1gpu.json (the layer: per token count the variants' outputs, errors and times), run.log.
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

source scripts/gpu/use_deepep.sh
use_deepep "$out" || exit 1

say "DeepEP's test_low_latency.py, one rank, 16 experts"
( cd .gpu_bundle/deepep-src/tests && timeout 150 "$PY" test_low_latency.py --num-processes 1 --num-experts 16 ) \
  >"$out/deepep_test.log" 2>&1
say "test_low_latency exit $? ($(grep -c . "$out/deepep_test.log") lines; the last:)"
tail -n 8 "$out/deepep_test.log" | tee -a "$log"

# 1 token: most of the 16 experts get none; 256 tokens: 128 per expert, above the 64-row tile.
# 50 replays x 20 timings = 1,000 replays of each captured variant.
say "bench_moe_layer.py --gpus 1"
SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256 timeout 240 "$PY" benchmarks/bench_moe_layer.py --gpus 1 \
  --mode decode --num-experts 16 --tokens 1,8,64,128,256 --iters 50 --repeats 20 --combine-sms 3 \
  --json "$out/decode_1gpu.json" --deadline-s 220 --hang-s 60 --port 27321 2>&1 | tee -a "$log"
say "bench exit ${PIPESTATUS[0]}; done"
