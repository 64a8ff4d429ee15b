#!/usr/bin/env bash
# The one-GPU check on a fresh CUDA machine without internet, from a clean checkout:
#   bash scripts/gpu/gpu_pd_run.sh OUT_DIR [STAGES]      (run from the repository root)
#
# The bundle `scripts/gpu/gpu_bundle.py` builds is cut into parts that each travel in one call
# (docs/gpu-check.md). Each call carries `.gpu_bundle/manifest.json` and the next part; this
# script keeps the parts under /tmp (a warm machine keeps /tmp between calls) and, once it holds
# all of them, unpacks the bundle, installs this checkout and runs `scripts/gpu/gpu_pd_check.py`.
# A call that still lacks parts says which one to carry next and exits 0.
# The checkout travels without .git: the commit comes from `.tree-commit.json`, which
# `python scripts/gpu/tree_commit.py write` puts in the tree before the call. A tree that differs
# from it is refused here, before anything is unpacked; PD_ALLOW_DIRTY=1 runs it anyway, and the
# report says how it differs.
set -euo pipefail
out=${1:?usage: gpu_pd_run.sh OUT_DIR [STAGES]}
stages=${2:-single,pd,doctor}  # and `smollm2` once its parts are held
export PYTHONUNBUFFERED=1
mkdir -p "$out"
dirty=()
if [ "${PD_ALLOW_DIRTY:-0}" = 1 ]; then dirty=(--allow-dirty); fi
python3 scripts/gpu/tree_commit.py verify ${dirty[@]+"${dirty[@]}"} --out "$out/tree.json"
# SmolLM2's GGUF travels in parts of its own (`smollm2_model.py`); keep what this call carries
# before use_bundle, which ends a call that still lacks a part of the sglang bundle.
if [ -d .gpu_bundle/smollm2 ]; then python3 scripts/gpu/smollm2_model.py hold; fi
# smg's wheel (PyPI smg, the router the check compares ours with) travels the same way, in one piece.
if compgen -G ".gpu_bundle/smg/*.whl" >/dev/null; then mkdir -p /tmp/smg-wheel && cp .gpu_bundle/smg/*.whl /tmp/smg-wheel/; fi
source scripts/gpu/use_bundle.sh
use_bundle
if compgen -G "/tmp/smg-wheel/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/smg-site /tmp/smg-wheel/*.whl
  export SMG_SITE=/tmp/smg-site
fi
python3 - <<'PY' >"$out/versions.txt" 2>&1 || true
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for mod in ("sglang", "sgl_kernel", "flashinfer", "mooncake.engine", "transformers", "triton", "sglang_pd.deploy"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "ok"))
    except Exception as exc:
        print(mod, "FAILED:", type(exc).__name__, exc)
PY
cat "$out/versions.txt"
# The installed sglang's own option strings (what the version-aware renderer adapts to).
python3 -c 'import argparse, json, sglang; from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
print(json.dumps({"sglang": sglang.__version__, "options": sorted(o for a in p._actions for o in a.option_strings)}))' \
  >"$out/sglang-options.json" || true
# Every module the servers would miss, in one pass; stop here when any is missing
# (SKIP_PROBE=1 skips it for a bundle already known good).
if [ "${SKIP_PROBE:-0}" != 1 ]; then python3 scripts/gpu/gpu_import_probe.py >"$out/import-probe.json"; fi
if [ "${SKIP_PROBE:-0}" != 1 ] && ! python3 -c 'import json, sys; sys.exit(bool(json.load(open(sys.argv[1]))["missing"]))' "$out/import-probe.json"; then
  cat "$out/import-probe.json"
  echo "error: modules missing on this machine (see import-probe.json); add them to scripts/gpu/gpu_bundle.py" >&2
  exit 1
fi
# PD_REFERENCE_REPORT: a committed report whose single-server outputs `pd` compares with when
# `single` does not run in this call (gpu_pd_check.py --reference-report).
reference=()
if [ -n "${PD_REFERENCE_REPORT:-}" ]; then reference=(--reference-report "$PD_REFERENCE_REPORT"); fi
python3 scripts/gpu/gpu_pd_check.py --out "$out" --stages "$stages" --gsm8k-data "$bundle/gsm8k-test.jsonl" \
  ${dirty[@]+"${dirty[@]}"} ${reference[@]+"${reference[@]}"} --deadline-s "${PD_DEADLINE_S:-540}"
