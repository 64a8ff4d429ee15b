#!/usr/bin/env bash
# SBO and TBO measured on one multi-GPU host (2 x H200): build DeepEP from the carried source, then
# run benchmarks/bench_moe_layer.py three times. Fetches nothing; about 9 minutes at most.
#
#   bash scripts/gpu/gpu_moe_run.sh OUT_DIR      (from the repository root)
#
# OUT_DIR gets five files:
#   build.log          the DeepEP build (revision, toolchain, `import deep_ep` and its combine signature)
#   bench.log          everything the benchmarks printed (tables, self-checks, per-rank diagnostics)
#   decode_e256.json   decode layer, DeepSeek-V3 routing (256 experts: 128 per GPU on 2 GPUs)
#   decode_e32.json    decode layer, 32 experts (16 per GPU: the per-GPU expert load of EP16 decode)
#   tbo.json           prefill layer, two-batch overlap against none, 4k and 16k tokens per rank
# Each stage runs even if an earlier benchmark failed; a stage is skipped only when DeepEP did not
# build or the time budget (BUDGET_S, default 530 s) is spent.
set -uo pipefail
budget=${BUDGET_S:-530}
source scripts/gpu/run_log.sh
begin_run "${1:?usage: gpu_moe_run.sh OUT_DIR}" bench.log

# %% The host (begin_run logged the GPUs)
{
  nvidia-smi topo -m 2>&1 | head -n 12
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "triton", triton.__version__)' 2>&1
} | tee -a "$log"

# %% DeepEP
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
  "$PY" benchmarks/bench_moe_layer.py "$@" --json "$out/$name.json" --deadline-s "$deadline" --hang-s 60 2>&1 | tee -a "$log"
  say "$name: exit ${PIPESTATUS[0]} after $(elapsed) s in total"
}
# In the order of the issue's asks: the DeepSeek-V3 decode layer, prefill TBO, then the EP16 per-GPU load.
run_bench decode_e256 170 140 --mode decode --num-experts 256 --iters 20 --repeats 10 --port 27311
run_bench tbo 150 50 --mode tbo --num-experts 256 --layers 2 --tbo-repeats 5 --port 27313
run_bench decode_e32 110 0 --mode decode --num-experts 32 --iters 20 --repeats 10 --port 27312

# %% Summary: the tables again, from the JSON files
"$PY" - "$out" <<'PY' 2>&1 | tee -a "$log"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("decode_e256", "tbo", "decode_e32"):
    path = out / f"{name}.json"
    if not path.is_file():
        print(f"{name}: no result")
        continue
    r = json.loads(path.read_text())
    print(f"\n{name}: complete={r.get('complete')} {r.get('aborted', '')} {r.get('error', '')}".rstrip())
    print(f"  self-check: {r.get('self_check')}; up GEMM {r.get('up_gemm')}, SiLU {r.get('silu_mul_quant')}")
    for row in r.get("decode", []) + r.get("tbo", []):
        v = row["variants"]
        cells = "  ".join(f"{k} {x['us']:.1f} us" if "us" in x else f"{k} -" for k, x in v.items())
        oks = "ok" if all(x.get("ok") for x in v.values()) else "CHECK FAILED"
        errs = [x["rel_err"] for x in v.values() if x.get("rel_err") is not None]
        print(f"  T={row['tokens_per_rank']:>5}: {cells}  saving {row.get('saving_pct')}  "
              f"max rel err {max(errs) if errs else float('nan'):.2e}  {oks}")
PY
say "done"
