"""Build `.gpu_bundle/`: sglang 0.5.17 and what it imports, for a CUDA machine without internet.

The GPU machine this project is checked on has torch 2.11 (CUDA 13) and no package index. sglang
0.5.17 is the last release pinned to torch 2.11; its packages are downloaded here from PyPI,
trimmed, packed into one archive and cut into parts that each travel in one device call:

- `sglang-kernel` 0.4.5 without FA3 (`flash_ops`, 1.1 GB), its sm_100, InfLLM and FlashMLA
  libraries: the smoke preset uses sglang's Triton attention backend, which needs none of them;
- FlashInfer 0.6.15.post1 (sglang 0.5.17 imports it at start in
  `srt/layers/quantization/fp8_utils.py`; its kernels compile on first use with the machine's
  nvcc, from the sources and headers its wheel carries);
- Mooncake's CUDA build with only the transfer engine (`engine.so` and the libraries it links),
  plus the CUDA 12 runtime it was linked against and the system libraries it needs
  (libcurl, libmlx5) for machines that lack them; `gpu_pd_run.sh` drops those the machine has;
- the pure-Python and small binary packages sglang imports at start that the machine lacks;
  `transformers` at sglang 0.5.17's pin (5.17 clashes with its `qwen3_asr` config) and wheels
  that must replace the machine's own (`wheels/` inside the archive);
- sgl-deep-gemm 0.1.5.post1, sglang 0.5.17's DeepGEMM, for the SBO decode server's MoE runner;
- the gsm8k test set for the check's `eval gsm8k` step.

Nothing here is committed; the bundle is rebuilt from the official wheels. The parts are carried
one per device call, in order, each call within the warm machine's idle window of the one before
(docs/gpu-check.md):

    python scripts/gpu/gpu_bundle.py                  # writes .gpu_bundle/manifest.json, part-00, part-01, ...
    # on the GPU machine, from the repository root, once per part (carry manifest.json + that part):
    bash scripts/gpu/gpu_pd_run.sh OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sglang_pd.deploy.common.contract import MOONCAKE_VERSION, SGLANG_GPU_VERSION

REPO = Path(__file__).resolve().parents[2]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]

SGLANG = [
    f"sglang=={SGLANG_GPU_VERSION}",
    "sglang-kernel==0.4.5",
    "flashinfer_python==0.6.15.post1",
    f"mooncake-transfer-engine=={MOONCAKE_VERSION}",
    "transformers==5.12.1",
    # sglang 0.5.17's DeepGEMM pin: the MoE runner `--moe-runner-backend deep_gemm` (the SBO decode
    # server, scripts/gpu/gpu_sbo_server.py) runs its masked grouped GEMMs; JIT, compiled on first use.
    "sgl-deep-gemm==0.1.5.post1",
]
# What sglang 0.5.17 imports on the way to serving a DeepSeek-V3 model that the GPU machine's image
# lacks (its image has torch, triton, numpy, aiohttp, requests, psutil, prometheus_client, uvloop,
# huggingface_hub, safetensors, sentencepiece, tiktoken, scipy, einops, ...).
DEPS = [
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "msgspec",
    "pyzmq",
    "orjson",
    "pybase64",
    "partial_json_parser",
    "setproctitle",
    "dill",
    "ipython",
    "pexpect",
    "ptyprocess",
    "prompt_toolkit",
    "wcwidth",
    "traitlets",
    "matplotlib-inline",
    "decorator",
    "stack_data",
    "asttokens",
    "executing",
    "pure_eval",
    "ipython_pygments_lexers",
    "compressed-tensors",
    "gguf",
    "openai==2.6.1",
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "sniffio",
    "distro",
    "jiter",
    "docstring_parser",
    "interegular",
    "python-multipart",
    "easydict",
    "blobfile",
    "pycryptodomex",
    "xxhash",
    "zstandard",
    "watchfiles",
    "xgrammar==0.2.1",
    "pyyaml",
    "openai-harmony==0.0.4",
    "nvidia-cuda-runtime-cu12",
]
# transformers 5.12.1 wants tokenizers <= 0.23.0; xgrammar imports tvm_ffi; fastapi imports opentelemetry.
SEPARATE_WHEELS = [
    "tokenizers==0.22.2",
    "apache-tvm-ffi==0.1.11",
    "opentelemetry-api",
    "annotated-doc",
    "click",
    "loguru",
    "httptools",
    "nvidia-ml-py",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "soundfile",
    "cffi",
    "pycparser",
]

# Parts of the wheels that the smoke preset never loads, dropped to fit the 64 MiB carry.
DROP = [
    "sgl_kernel/flash_ops.abi3.so",
    "sgl_kernel/sm100",
    "sgl_kernel/infllm_ops*",
    "sgl_kernel/flashmla_ops*",
    "sgl_kernel/triton_kernels",
    "mooncake/libmooncake_pg*.so",
    "mooncake/transfer_engine_bench",
    "mooncake/store.so",
    "mooncake/mooncake_client",
    "mooncake/mooncake_master",
    "mooncake/libmooncake_ep_device.so",
    "mooncake/_ep*.so",
    "mooncake/pg_2_*",
    "mooncake_transfer_engine.libs/libetcd_wrapper-*.so",  # a copy of mooncake/libetcd_wrapper.so
    "xgrammar/lib",  # the static library, for C++ users
    "sglang/test",
    "sglang/multimodal_gen",
    "*.data",
]
# Plain extension modules from ordinary wheels lose their debug sections (auditwheel's vendored
# libraries are left alone: stripping patched ELF files can break them).
STRIP = ["xgrammar/*.so", "zstandard/*.so", "xxhash/*.so", "yaml/*.so", "openai_harmony/*.so"]


def download(names: list[str], dest: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run([*cmd, *names], check=True)


def system_libraries(dest: Path) -> None:
    """libcurl and libmlx5 with what they link (Mooncake's engine.so needs them), from this machine."""
    libs = ["/lib/x86_64-linux-gnu/libcurl.so.4", "/lib/x86_64-linux-gnu/libmlx5.so.1"]
    ldd = subprocess.run(["ldd", libs[0]], capture_output=True, text=True, check=True).stdout
    skip = ("libc.so", "libm.so", "libpthread", "libdl.so", "librt.so", "ld-linux")
    libs += [
        w.split()[2] for w in ldd.splitlines() if "=>" in w and len(w.split()) > 2 and not any(s in w for s in skip)
    ]
    for lib in libs:
        shutil.copy(Path(lib).resolve(), dest / Path(lib).name)


# One part travels with the working tree (about 2.5 MB) in a device call of at most 64 MiB.
PART_BYTES = 56 * 2**20
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build_site(site: Path, wheels: Path) -> None:
    """Unpack every wheel into `site`, drop what the check never loads, strip what is safe to."""
    download(SGLANG + DEPS, wheels)
    for whl in sorted(wheels.glob("*.whl")):
        zipfile.ZipFile(whl).extractall(site)
    for pattern in DROP:
        for p in site.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for pattern in STRIP:
        for p in site.glob(pattern):
            subprocess.run(["strip", "--strip-unneeded", str(p)], check=True)
    syslibs = site / "_syslibs"
    syslibs.mkdir()
    runtime = next(site.glob("nvidia/cuda_runtime/lib/libcudart.so.12"))
    shutil.copy(runtime, syslibs / runtime.name)
    shutil.rmtree(site / "nvidia")
    system_libraries(syslibs)
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)


def split(archive: Path, out: Path) -> list[dict[str, object]]:
    """Cut `archive` into `part-NN` files of at most PART_BYTES under `out`."""
    parts = []
    with open(archive, "rb") as f:
        for index in range(1000):
            chunk = f.read(PART_BYTES)
            if not chunk:
                break
            part = out / f"part-{index:02d}"
            part.write_bytes(chunk)
            parts.append({"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".gpu_bundle")
    parser.add_argument("--gsm8k", type=Path, default=GSM8K, help="gsm8k test.jsonl for the check's eval step")
    args = parser.parse_args()
    if not args.gsm8k.is_file():
        sys.exit(f"error: {args.gsm8k} is not a file; pass --gsm8k PATH to gsm8k's test.jsonl")
    if args.out.exists():
        shutil.rmtree(args.out)  # a part left from an older build must never be carried with this one
    args.out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "bundle")
        build_site(root / "site", Path(tmp, "wheels"))
        download(SEPARATE_WHEELS, root / "wheels")
        shutil.copy(args.gsm8k, root / "gsm8k-test.jsonl")
        archive = Path(tmp, "bundle.tar.xz")
        with open(archive, "wb") as f:
            tar = subprocess.Popen(["tar", "cf", "-", "-C", str(root), "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
            if tar.wait() != 0:
                sys.exit("error: tar failed while packing the bundle")
        manifest = {
            "archive_sha256": sha256(archive),
            "archive_bytes": archive.stat().st_size,
            "packages": SGLANG + DEPS + SEPARATE_WHEELS,
            "parts": split(archive, args.out),
        }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    names = [str(part["name"]) for part in manifest["parts"]]  # type: ignore[attr-defined]
    print(f"{args.out}: {manifest['archive_bytes'] / 2**20:.1f} MiB in {len(names)} parts ({', '.join(names)})")
    for i, name in enumerate(names):
        carry = f".gpu_bundle/manifest.json .gpu_bundle/{name}"
        print(f"  call {i + 1}: carry {carry}; run bash scripts/gpu/gpu_pd_run.sh $OUT")


if __name__ == "__main__":
    main()
