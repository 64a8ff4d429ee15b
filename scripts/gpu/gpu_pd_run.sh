#!/usr/bin/env bash
# The one-GPU check on a fresh CUDA machine without internet, from a clean checkout:
#   bash scripts/gpu/gpu_pd_run.sh OUT_DIR [STAGES]      (run from the repository root)
#
# The bundle `scripts/gpu/gpu_bundle.py` builds is cut into parts that each travel in one call
# (docs/gpu-check.md). Each call carries `.gpu_bundle/manifest.json` and the next part; this
# script keeps the parts under /tmp (a warm machine keeps /tmp between calls) and, once it holds
# all of them, unpacks the bundle, installs this checkout and runs `scripts/gpu/gpu_pd_check.py`.
# A call that still lacks parts says which one to carry next and exits 0.
# PD_COMMIT names the commit being checked (the checkout travels without .git); it goes in the report.
set -euo pipefail
out=${1:?usage: gpu_pd_run.sh OUT_DIR [STAGES]}
stages=${2:-single,pd,doctor}
manifest=.gpu_bundle/manifest.json
parts=/tmp/gpu-bundle-parts
bundle=/tmp/gpu-bundle
site=$bundle/site
export PYTHONUNBUFFERED=1
mkdir -p "$out" "$parts" "$bundle"
if [ ! -f "$manifest" ]; then
  echo "error: $manifest is missing: build it with 'python scripts/gpu/gpu_bundle.py' and carry it in every call" >&2
  exit 2
fi
want=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["archive_sha256"])' "$manifest")
if [ "$(cat "$bundle/.unpacked" 2>/dev/null)" != "$want" ]; then
  # Keep the carried part (checked against the manifest), then see what is still missing.
  missing=$(python3 - "$manifest" "$parts" <<'PY'
import hashlib, json, shutil, sys
from pathlib import Path
manifest, kept = json.load(open(sys.argv[1])), Path(sys.argv[2])
missing = []
for part in manifest["parts"]:
    carried, held = Path(".gpu_bundle", part["name"]), kept / part["name"]
    if carried.is_file() and not held.is_file():
        shutil.copy(carried, held)
    if held.is_file() and hashlib.sha256(held.read_bytes()).hexdigest() != part["sha256"]:
        held.unlink()  # a part of another build or a broken copy: carry it again
    if not held.is_file():
        missing.append(part["name"])
print(" ".join(missing))
PY
)
  if [ -n "$missing" ]; then
    echo "bundle: held $(ls "$parts" | tr '\n' ' '); still missing: $missing"
    echo "NEXT: carry .gpu_bundle/manifest.json and .gpu_bundle/${missing%% *} in the next call (within the machine's idle window)"
    exit 0
  fi
  echo "== unpacking the bundle ($(du -sh "$parts" | cut -f1))"
  rm -rf "$bundle" && mkdir -p "$bundle"
  python3 - "$manifest" "$parts" <<'PY' | xz -dc | tar xf - -C "$bundle"
import json, shutil, sys
from pathlib import Path
manifest, kept = json.load(open(sys.argv[1])), Path(sys.argv[2])
for part in manifest["parts"]:
    with open(kept / part["name"], "rb") as f:
        shutil.copyfileobj(f, sys.stdout.buffer)
PY
  rm -rf "$parts"
  echo "$want" >"$bundle/.unpacked"
fi
# Wheels that must replace the machine's own packages go on top of the unpacked site.
if compgen -G "$bundle/wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$bundle"/wheels/*.whl
fi
# The bundle carries the shared libraries Mooncake's engine links; use only those this machine lacks.
for lib in "$site"/_syslibs/*; do
  name=$(basename "$lib")
  if [ "$name" != libcudart.so.12 ] && ldconfig -p | grep -q " $name "; then rm "$lib"; fi
done
export LD_LIBRARY_PATH=$site/_syslibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
rm -rf /tmp/pd && python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/pd .
export PYTHONPATH=/tmp/pd:$site
echo "== carried system libraries in use: $(ls "$site"/_syslibs | tr '\n' ' ')"
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
python3 scripts/gpu/gpu_pd_check.py --out "$out" --stages "$stages" --gsm8k-data "$bundle/gsm8k-test.jsonl" \
  --commit "${PD_COMMIT:-unknown}" --deadline-s "${PD_DEADLINE_S:-540}"
