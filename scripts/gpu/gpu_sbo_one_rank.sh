#!/usr/bin/env bash
# SBO's real chain on one H200, in one device call (docs/sbo.md): build DeepEP (antgroup-opt, the
# signal layout sglang's sm_90 path takes) from the carried source while the kernels' GPU test matrix
# runs beside it; then the signal-ordering tests and their must-fail controls alone on the GPU; the
# PTX fence check (scripts/gpu/check_ptx_fences.py) over everything those tests compiled; then
# benchmarks/bench_moe_layer.py on one GPU: one decode MoE layer, our signal GEMM feeding DeepEP's
# real low_latency_combine, against sglang's baselines (`none`: our down GEMM, the shared expert on
# the alternate stream as sglang runs it without SBO; `deepgemm`: DeepGEMM's down GEMM) with a sweep
# of the combine-send SMs, and a replay check on fresh inputs with poisoned outputs, bit for bit
# against `none` after every replay, with its must-fail control. Last, a short table.
#
#   bash scripts/gpu/gpu_sbo_one_rank.sh OUT_DIR    (from the repository root; carry .gpu_bundle/deepep-src,
#                                                    and .whl for the deepgemm variant, see use_deepgemm.sh)
#
# Every step has a `timeout` drawn from BUDGET_S (default 560 s), keeping back what the steps after it
# need, so the script ends within the device's 570 s. OUT_DIR gets: run.log, steps.jsonl (each step's
# exit status and seconds), build.log, kernel_tests_<group>.log, ptx_fences.json,
# decode_1gpu_bn256.json and decode_1gpu_bn160.json (bench_moe_layer's reports), and
# sbo_one_rank.json (scripts/gpu/sbo_one_rank_report.py: every part judged, the form of
# benchmarks/results/sbo_one_rank_*.json). A part of the sglang bundle carried as well
# (docs/gpu-check.md) is kept for the next call first.
#
# Knobs: SBO_COMMIT (recorded), SWEEP_SMS (combine-send SMs at max_block_n 256, default "3,8,16,24,32"),
# SWEEP_SMS_160 (at 160; default "3,16", the whole sweep when at least 200 s are left), REPLAYS (default
# 1000), TOKENS (tokens per rank, default "1,8,64,128,256"), LAYER_ONLY=1 (build DeepEP and run only the
# layer benchmark: no kernel tests, ordering tests or PTX check), SWEEP_SMS_160=skip (no max_block_n 160
# run), RUN_DEEPEP_TEST=1 (DeepEP's own one-rank test_low_latency.py, about 60 s; off by default: the
# same revision passed it at adccfcc and 45a80ce). The must-fail control runs at the first SWEEP_SMS value.
# Every run times `full_alt@S` beside `full@S`: the shared expert on the alternate stream, as rendered.
# One rank has no peer and no NIC: DeepEP copies locally. What this shows is the chain's correctness
# and SBO's overhead on one GPU; RDMA, NVLink peers, multi-rank skew and the gain need two GPUs.
set -uo pipefail
# DeepEP's layered low-latency dispatch sizes its buffers by nodes of 8 GPUs (it asserts num_ranks % 8 == 0).
export DEEPEP_DISABLE_LL_DISPATCH_OPT=1
RUN_COMMIT=${SBO_COMMIT:-unknown}
budget=${BUDGET_S:-560}
source scripts/gpu/run_log.sh
begin_run "${1:?usage: gpu_sbo_one_rank.sh OUT_DIR}" run.log
steps=$out/steps.jsonl
: >"$steps"
{
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)' 2>&1
} | tee -a "$log"

# step NAME EXIT SECONDS: one line of steps.jsonl
step() { printf '{"step": "%s", "exit": %s, "seconds": %s}\n' "$1" "$2" "$3" >>"$steps"; }
# limit WANT RESERVE: WANT seconds, or what is left of the budget after RESERVE for the steps after this one
# (at least 1: `timeout 0` would mean no limit at all)
limit() {
  local left=$(( budget - $(elapsed) - $2 ))
  left=$(( left < 1 ? 1 : left ))
  echo $(( left < $1 ? left : $1 ))
}
# Seconds kept back for what follows the kernel test matrix: the ordering tests, the two layer runs, the report.
ORDERING_S=50 BENCH256_S=170 BENCH160_S=100 REPORT_S=10
LAYER_ONLY=${LAYER_ONLY:-0}
[ "${SWEEP_SMS_160:-}" = skip ] && BENCH160_S=0
[ "$LAYER_ONLY" = 1 ] && ORDERING_S=0

if [ -f .gpu_bundle/manifest.json ]; then
  # Keep the carried part of the sglang bundle for the next call, even if this one runs out of time
  # (a subshell: use_bundle ends its shell while a part is still missing).
  ( source scripts/gpu/use_bundle.sh; use_bundle ) 2>&1 | tail -n 2 | tee -a "$log"
fi
source scripts/gpu/use_deepgemm.sh
use_deepgemm
source scripts/gpu/use_deepep.sh

# %% The kernels' GPU test matrix, in three processes beside the DeepEP build (Triton compiles on the
# CPU; the build uses a few of the 16 cores). The ordering tests wait: they need the GPU to themselves.
export TRITON_CACHE_DIR=/tmp/triton-cache-one-rank-$$
tests_limit=$(limit 330 $(( ORDERING_S + BENCH256_S + BENCH160_S + REPORT_S )))
declare -A test_pid test_t0
groups=()
if [ "$LAYER_ONLY" = 1 ]; then
  say "LAYER_ONLY=1: no kernel tests, ordering tests or PTX check"
else
  say "kernels' GPU test matrix in 3 processes, at most ${tests_limit} s (Triton cache $TRITON_CACHE_DIR)"
  groups=("fp8_a:test_fp8_masked_gemm and 4x256x7168x2048" "fp8_b:test_fp8_masked_gemm and 3x70x200x256"
    "rest:not test_fp8_masked_gemm and not ordering and not interpreter")
fi
for group in "${groups[@]}"; do
  name=${group%%:*}
  PYTHONPATH=.mypy-root:.${PYTHONPATH:+:$PYTHONPATH} timeout "$tests_limit" "$PY" -m pytest tests/kernels -m gpu -q \
    -p no:cacheprovider --durations=5 -k "${group#*:}" >"$out/kernel_tests_$name.log" 2>&1 &
  test_pid[$name]=$!
  test_t0[$name]=$(elapsed)
done

use_deepep "$out"
deepep_rc=$?
step deepep_build "$deepep_rc" "$(elapsed)"

for name in "${!test_pid[@]}"; do
  wait "${test_pid[$name]}"
  rc=$?
  step "kernel_tests_$name" "$rc" $(( $(elapsed) - ${test_t0[$name]} ))
  say "kernel tests $name exit $rc: $(tail -n 1 "$out/kernel_tests_$name.log")"
done
[ "$deepep_rc" = 0 ] || { say "no DeepEP: the layer runs are skipped"; }

step_t0=$(elapsed)
ordering_limit=$(limit 120 $(( BENCH256_S + BENCH160_S + REPORT_S )))
if [ "$LAYER_ONLY" = 1 ]; then
  : # the layer benchmark alone
elif [ "$ordering_limit" -ge 20 ]; then
  say "signal-ordering tests (1,000 runs a layout) and their must-fail controls, alone on the GPU (at most ${ordering_limit} s)"
  PYTHONPATH=.mypy-root:.${PYTHONPATH:+:$PYTHONPATH} timeout "$ordering_limit" \
    "$PY" -m pytest tests/kernels -m gpu -q -s -p no:cacheprovider -k ordering >"$out/kernel_tests_ordering.log" 2>&1
  rc=$?
else
  echo "not run: ${ordering_limit} s left for it" >"$out/kernel_tests_ordering.log"
  rc=125
fi
if [ "$LAYER_ONLY" != 1 ]; then
  step kernel_tests_ordering "$rc" $(( $(elapsed) - step_t0 ))
  say "ordering tests exit $rc: $(tail -n 1 "$out/kernel_tests_ordering.log")"
  grep -E "runs, |control: |FAILED|Error" "$out/kernel_tests_ordering.log" | head -n 12 | tee -a "$log"
  "$PY" scripts/gpu/check_ptx_fences.py "$TRITON_CACHE_DIR" --json "$out/ptx_fences.json" 2>&1 | tee -a "$log"
fi

if [ "${RUN_DEEPEP_TEST:-0}" = 1 ] && [ "$deepep_rc" = 0 ]; then
  step_t0=$(elapsed)
  say "DeepEP's test_low_latency.py, one rank, 16 experts"
  ( cd .gpu_bundle/deepep-src/tests && timeout "$(limit 150 $(( BENCH256_S + BENCH160_S + REPORT_S )))" \
    "$PY" test_low_latency.py --num-processes 1 --num-experts 16 ) >"$out/deepep_test.log" 2>&1
  rc=$?
  step deepep_test "$rc" $(( $(elapsed) - step_t0 ))
  say "test_low_latency exit $rc; the last lines:"
  tail -n 4 "$out/deepep_test.log" | tee -a "$log"
fi

# %% The layer: 1 token (8 of the 16 experts get none) to 256 (128 a expert, above the 64-row tile);
# 20 interleaved rounds of 50 replays = 1,000 timed replays of each variant.
bench() {  # NAME MAX_BLOCK_N COMBINE_SMS RESERVE EXTRA...
  local name=$1 bn=$2 sms=$3 reserve=$4
  shift 4
  local deadline
  deadline=$(limit 600 "$reserve")
  if [ "$deepep_rc" != 0 ] || [ "$deadline" -lt 40 ]; then
    say "$name: SKIPPED (DeepEP exit $deepep_rc, ${deadline} s left)"
    step "$name" 125 0
    return
  fi
  local bench_t0
  bench_t0=$(elapsed)
  say "$name: bench_moe_layer.py --max-block-n $bn --combine-sms $sms (deadline ${deadline} s)"
  SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=256 timeout $(( deadline + 10 )) "$PY" benchmarks/bench_moe_layer.py \
    --gpus 1 --mode decode --num-experts 16 --tokens "${TOKENS:-1,8,64,128,256}" --iters 50 --repeats 20 --combine-sms "$sms" --full-alt \
    --max-block-n "$bn" --replay-check "${REPLAYS:-1000}" --json "$out/$name.json" --deadline-s "$deadline" --hang-s 60 \
    "$@" >"$out/$name.log" 2>&1
  local rc=$?
  step "$name" "$rc" $(( $(elapsed) - bench_t0 ))
  say "$name exit $rc"
  grep -E "^ *T/rank|^ *[0-9]+ +[0-9]+ +[0-9]+ \||FAILED|HANG|Error|DeepGEMM baseline" "$out/$name.log" | tail -n 14 | tee -a "$log"
}
bench decode_1gpu_bn256 256 "${SWEEP_SMS:-3,8,16,24,32}" $(( BENCH160_S + REPORT_S )) --port 27321
# sglang passes no max_block_n without overlap, so `none` and `deepgemm` are the same kernels at 160:
# `none` runs again as the spread between the two runs; DeepGEMM is left out.
sms160=${SWEEP_SMS_160:-}
if [ -z "$sms160" ]; then
  if [ "$(limit 600 "$REPORT_S")" -ge 200 ]; then sms160=${SWEEP_SMS:-3,8,16,24,32}; else sms160=3,16; fi
fi
[ "$sms160" = skip ] || bench decode_1gpu_bn160 160 "$sms160" "$REPORT_S" --no-deepgemm --port 27331

knobs="$(for k in LAYER_ONLY TOKENS SWEEP_SMS SWEEP_SMS_160 REPLAYS; do [ -n "${!k:-}" ] && printf '%s=%s ' "$k" "${!k}"; done)"
"$PY" scripts/gpu/sbo_one_rank_report.py "$out" --commit "$RUN_COMMIT" $([ "$LAYER_ONLY" = 1 ] && echo --layer-only) \
  --command "${knobs}SBO_COMMIT=$RUN_COMMIT bash scripts/gpu/gpu_sbo_one_rank.sh \$OUT/one_rank (carrying .gpu_bundle/deepep-src and .whl)" \
  2>&1 | tee -a "$log"
say "done"
