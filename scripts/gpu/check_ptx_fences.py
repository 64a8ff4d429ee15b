"""Check the compiled signal GEMMs: every GPU-scope release follows a proxy fence after the last store.

DeepEP's combine reads our GEMM's rows by TMA (the async proxy) once it sees a signal, and PTX
orders generic stores before async-proxy reads only through ``fence.proxy.async``
(kernels/README.md, "A consumer that reads by TMA"). This reads the PTX Triton wrote into its cache
(``TRITON_CACHE_DIR``, after the kernels ran) and, in each kernel with a release, checks that
between the last global store before a release and the release there is a
``fence.proxy.async.global``. Text order, not control flow: the kernels store, fence, sync and
release in one straight line per tile, which is what this holds them to.

    python scripts/gpu/check_ptx_fences.py CACHE_DIR [--json FILE]

Exits 1 when a release has no fence before it, or when no kernel with a release was found (so a
run that compiled nothing cannot pass).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

#: A GPU-scope atomic that releases: `.release`, or `.acq_rel` (Triton's default for atomics).
RELEASE = re.compile(r"\b(?:red|atom)\.\S*\b(?:release|acq_rel)\b")
STORE = re.compile(r"\bst\.global\b")
FENCE = re.compile(r"\bfence\.proxy\.async\.global\b")
ENTRY = re.compile(r"\.entry\s+(\w+)")


def check_ptx(text: str) -> dict[str, Any]:
    """Releases in one PTX module, and how many of them follow a fence issued after the last store."""
    releases = fenced = 0
    fence_since_store = False
    for line in text.splitlines():
        code = line.split("//", 1)[0]
        if STORE.search(code):
            fence_since_store = False
        if FENCE.search(code):
            fence_since_store = True
        if RELEASE.search(code):
            releases += 1
            fenced += fence_since_store
    entry = ENTRY.search(text)
    return {"kernel": entry.group(1) if entry else "?", "releases": releases, "fenced": fenced}


def check_cache(cache: Path) -> dict[str, Any]:
    kernels = [dict(check_ptx(p.read_text()), ptx=str(p.relative_to(cache))) for p in sorted(cache.rglob("*.ptx"))]
    releasing = [k for k in kernels if k["releases"]]
    unfenced = [k for k in releasing if k["fenced"] < k["releases"]]
    return {
        "ptx_files": len(kernels),
        "kernels_with_releases": len(releasing),
        "releases": sum(k["releases"] for k in releasing),
        "unfenced": unfenced,
        "by_kernel": sorted({k["kernel"] for k in releasing}),
        "ok": bool(releasing) and not unfenced,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path, help="the Triton cache directory (TRITON_CACHE_DIR) the kernels ran with")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if not args.cache.is_dir():
        print(f"error: {args.cache} is not a directory: pass the TRITON_CACHE_DIR they ran with", file=sys.stderr)
        return 2
    result = check_cache(args.cache)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(
        f"ptx: {result['ptx_files']} modules, {result['kernels_with_releases']} with releases "
        f"({result['releases']} release instructions), unfenced: {len(result['unfenced'])}; "
        + ("ok" if result["ok"] else "FAILED")
    )
    for k in result["unfenced"][:5]:
        print(f"  unfenced: {k['kernel']} ({k['fenced']}/{k['releases']} fenced) in {k['ptx']}")
    if not result["kernels_with_releases"]:
        print("  no kernel with a release was compiled into this cache: did the signal tests run?")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
