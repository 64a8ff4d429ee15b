# Sourced by the GPU scripts: unpack the sglang 0.5.17 bundle that `scripts/gpu/gpu_bundle.py` cut into
# parts, install this checkout beside it, and put both on this shell's PYTHONPATH.
#
#   set -euo pipefail; source scripts/gpu/use_bundle.sh; use_bundle      (from the repository root)
#
# Each device call carries `.gpu_bundle/manifest.json` and the next part (docs/gpu-check.md); the parts
# are kept under /tmp (a warm machine keeps /tmp between calls). While a part is still missing,
# use_bundle says which one to carry next and ends the calling script with exit 0: the next call
# carries it. Call it as a plain command, so that `set -e` stops the script on any failure inside.
use_bundle() {
  local manifest=.gpu_bundle/manifest.json parts=/tmp/gpu-bundle-parts
  bundle=/tmp/gpu-bundle
  site=$bundle/site
  mkdir -p "$parts" "$bundle"
  if [ ! -f "$manifest" ]; then
    echo "error: $manifest is missing: build it with 'python scripts/gpu/gpu_bundle.py' and carry it in every call" >&2
    return 2
  fi
  local want missing
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
  export PYTHONPATH=/tmp/pd:$site${PYTHONPATH:+:$PYTHONPATH}
  echo "== carried system libraries in use: $(ls "$site"/_syslibs | tr '\n' ' ')"
}
