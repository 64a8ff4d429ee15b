#!/usr/bin/env bash
# The whole one-GPU run on a fresh CUDA machine without internet: install the bundle that
# `scripts/gpu_bundle.py` built (sglang, its stripped kernel package, Mooncake's CUDA build and
# what they import), install this project, then run `scripts/gpu_pd_check.py`.
#   bash scripts/gpu_pd_run.sh OUT_DIR [STAGES]      (run from the repository root)
set -euo pipefail
out=${1:?usage: gpu_pd_run.sh OUT_DIR [STAGES]}
stages=${2:-single,pd,doctor}
bundle=.gpu_bundle
export PYTHONUNBUFFERED=1
mkdir -p "$out" /tmp/site
# A call that carried only site.tar.xz may have unpacked it already (it is the bulk of the bundle).
if [ ! -f /tmp/site/.unpacked ]; then tar xJf "$bundle/site.tar.xz" -C /tmp/site && touch /tmp/site/.unpacked; fi
if [ -f "$bundle/extra.tar.xz" ]; then tar xJf "$bundle/extra.tar.xz" -C /tmp/site; fi
if [ -f "$bundle/src.tar.xz" ]; then mkdir -p /tmp/pd-src && tar xJf "$bundle/src.tar.xz" -C /tmp/pd-src; fi
if [ -f "$bundle/gsm8k-test.jsonl.xz" ]; then xz -dc "$bundle/gsm8k-test.jsonl.xz" >/tmp/gsm8k-test.jsonl; fi
# Wheels beside the bundle (pins the machine's own packages do not meet) go on top of it.
if compgen -G "$bundle/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$bundle"/wheels/*.whl
fi
# The bundle carries the shared libraries Mooncake's engine links; use only those this machine lacks.
for lib in /tmp/site/_syslibs/*; do
  name=$(basename "$lib")
  if [ "$name" != libcudart.so.12 ] && ldconfig -p | grep -q " $name "; then rm "$lib"; fi
done
export LD_LIBRARY_PATH=/tmp/site/_syslibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/pd "${PD_SRC:-.}"
export PYTHONPATH=/tmp/pd:/tmp/site
echo "== carried system libraries in use: $(ls /tmp/site/_syslibs | tr '\n' ' ')"
python3 - <<'PY' >"$out/versions.txt" 2>&1 || true
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for mod in ("sglang", "sgl_kernel", "mooncake.engine", "transformers", "triton", "sglang_pd.deploy"):
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
# Every module the servers would miss, in one pass; stop here when any is missing (it takes
# minutes: one fresh interpreter per missing module; SKIP_PROBE=1 skips it once the bundle is known good).
if [ "${SKIP_PROBE:-0}" != 1 ] && python3 scripts/gpu_import_probe.py | tee "$out/import-probe.json" && ! python3 -c 'import json, sys; sys.exit(bool(json.load(open(sys.argv[1]))["missing"]))' "$out/import-probe.json"; then
  echo "error: modules missing on this machine (see import-probe.json); add them to scripts/gpu_bundle.py" >&2
  exit 1
fi
python3 scripts/gpu_pd_check.py --out "$out" --stages "$stages" --gsm8k-data /tmp/gsm8k-test.jsonl
