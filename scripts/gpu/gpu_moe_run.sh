#!/usr/bin/env bash
# SBO and TBO measured on one multi-GPU host (2 x H200): build DeepEP from the carried source, then
# run benchmarks/bench_moe_layer.py three times, the EP16-like case first. Fetches nothing; about
# 9 minutes at most (BUDGET_S, default 530 s, inside the device's 600 s a call).
#
#   bash scripts/gpu/gpu_moe_run.sh OUT_DIR      (from the repository root; carry .gpu_bundle/deepep-src,
#                                                 and .whl for the deepgemm variant, see use_deepgemm.sh)
#
# OUT_DIR gets:
#   build.log          the DeepEP build (revision, toolchain, `import deep_ep` and its combine signature)
#   bench.log          everything the benchmarks printed (tables, self-checks, per-rank diagnostics)
#   decode_e32.json    decode layer, 32 experts (16 per GPU: the per-GPU expert load of EP16 decode), with
#                      sglang's baselines (none, deepgemm), the combine-send SM sweep (full@S) and the
#                      replay check with its must-fail control; its time is reserved before the others
#   decode_e256.json   decode layer, DeepSeek-V3 routing (256 experts: 128 per GPU on 2 GPUs), sglang's
#                      default 3 send SMs and 16
#   tbo.json           prefill layer, two-batch overlap against none, 4k and 16k tokens per rank
# Each stage runs even if an earlier benchmark failed; a stage is skipped only when DeepEP did not
# build or the time budget is spent. What two GPUs of one host can and cannot show: docs/sbo.md.
set -uo pipefail
budget=${BUDGET_S:-530}
source scripts/gpu/run_log.sh
begin_run "${1:?usage: gpu_moe_run.sh OUT_DIR}" bench.log

# %% The host (begin_run logged the GPUs)
{
  nvidia-smi topo -m 2>&1 | head -n 12
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "triton", triton.__version__)' 2>&1
} | tee -a "$log"

# %% DeepEP, and DeepGEMM for the deepgemm variant
source scripts/gpu/use_deepgemm.sh
use_deepgemm
source scripts/gpu/use_deepep.sh
use_deepep "$out" || exit 1

# %% Benchmarks: name, deadline cap (s), seconds kept for the stages after it, arguments
run_bench() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local left=$(( budget - $(elapsed) - reserve ))
  local deadline=$(( left < cap ? left : cap ))
  if [ "$deadline" -lt 45 ]; then
    say "$name: SKIPPED (${left} s left of the ${budget} s budget)"
    return
  fi
  say "$name: bench_moe_layer.py $* (deadline ${deadline} s)"
  timeout $(( deadline + 15 )) "$PY" benchmarks/bench_moe_layer.py "$@" --json "$out/$name.json" --deadline-s "$deadline" \
    --hang-s 60 2>&1 | tee -a "$log"
  say "$name: exit ${PIPESTATUS[0]} after $(elapsed) s in total"
}
# The EP16-like case first, its time reserved: the send-SM sweep and the replay check where the combine
# really sends to a peer over NVLink. Then DeepSeek-V3's routing, then prefill TBO.
run_bench decode_e32 240 150 --mode decode --num-experts 32 --iters 20 --repeats 10 --combine-sms "${SWEEP_SMS:-3,8,16,24,32}" \
  --replay-check "${REPLAYS:-500}" --port 27312
run_bench decode_e256 110 60 --mode decode --num-experts 256 --iters 20 --repeats 10 --combine-sms 3,16 \
  --replay-check 100 --port 27311
run_bench tbo 120 0 --mode tbo --num-experts 256 --layers 2 --tbo-repeats 5 --port 27313

# %% Summary: the tables again, from the JSON files
"$PY" - "$out" <<'PY' 2>&1 | tee -a "$log"
import json, pathlib, sys
sys.path.insert(0, "scripts/gpu")
from sbo_one_rank_report import layer_rows
out = pathlib.Path(sys.argv[1])
for name in ("decode_e32", "decode_e256", "tbo"):
    path = out / f"{name}.json"
    if not path.is_file():
        print(f"{name}: no result")
        continue
    r = json.loads(path.read_text())
    print(f"\n{name}: complete={r.get('complete')} {r.get('aborted', '')} {r.get('error', '')}".rstrip())
    print(f"  self-check: {r.get('self_check')}; up GEMM {r.get('up_gemm')}, SiLU {r.get('silu_mul_quant')}")
    if "decode" in r:
        print(f"  DeepGEMM baseline: {r.get('deepgemm')}")
        for row in layer_rows(r):
            check = row["replay_check"] or {}
            print(f"  T={row['tokens_per_rank']:>4}: {row['us']} us; full vs none % {row['full_vs_none_pct']}; "
                  f"vs deepgemm % {row['full_vs_deepgemm_pct']}; replay check "
                  f"{'ok' if check.get('ok') else check.get('problems', '-')} (controls caught {check.get('controls_caught')})"
                  f"{'' if row['variants_ok'] else '; CHECK FAILED ' + str(row['errors'])}")
    for row in r.get("tbo", []):
        v = row["variants"]
        cells = "  ".join(f"{k} {x['us']:.1f} us" if "us" in x else f"{k} -" for k, x in v.items())
        oks = "ok" if all(x.get("ok") for x in v.values()) else "CHECK FAILED"
        print(f"  T={row['tokens_per_rank']:>5}: {cells}  saving {row.get('saving_pct')}  {oks}")
PY
say "done"
