"""The gsm8k test set: load a jsonl file, or download the canonical one once and check its sha256.

The canonical file is openai/grade-school-math's `test.jsonl` (1319 questions, MIT); no package
ships it, so it is fetched at first use into a cache directory and verified every time it is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import DataUnavailable
from .scoring import last_number

__all__ = [
    "GSM8K_SHA256",
    "GSM8K_URL",
    "Dataset",
    "Problem",
    "default_cache_path",
    "ensure_dataset",
    "load_dataset",
    "sha256_of",
]

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
GSM8K_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
GSM8K_SIZE = 1319
CACHE_ENV = "SGLANG_PD_CACHE_DIR"
DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Problem:
    """One gsm8k line: `index` is its 0-based line number in the file (the question's id); `label` is
    the number after `####`, commas removed, kept as written (compared as a decimal)."""

    index: int
    question: str
    answer: str
    label: str


@dataclass(frozen=True, slots=True)
class Dataset:
    path: Path
    sha256: str
    problems: tuple[Problem, ...]

    @property
    def canonical(self) -> bool:
        return self.sha256 == GSM8K_SHA256


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _label(answer: str, where: str) -> str:
    _, sep, tail = answer.rpartition("####")
    if not sep:
        raise DataUnavailable(f"{where}: the answer has no '#### <number>' line; is this a gsm8k jsonl file?")
    value = last_number(tail)
    if value is None:
        raise DataUnavailable(f"{where}: no number after '####' in the answer ({tail.strip()!r}).")
    return value


def load_dataset(path: Path) -> Dataset:
    """Read a gsm8k-format jsonl file: one `{"question": ..., "answer": "... #### N"}` object a line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataUnavailable(f"Cannot read the gsm8k data file {path}: {exc.strerror or exc}.") from exc
    problems: list[Problem] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
            question, answer = obj["question"], obj["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DataUnavailable(
                f"{where}: not a gsm8k line (expected a JSON object with 'question' and 'answer')."
            ) from exc
        if not isinstance(question, str) or not isinstance(answer, str):
            raise DataUnavailable(f"{where}: 'question' and 'answer' must be strings.")
        problems.append(Problem(len(problems), question, answer, _label(answer, where)))
    if not problems:
        raise DataUnavailable(f"The gsm8k data file {path} holds no questions.")
    return Dataset(path=path, sha256=sha256_of(path), problems=tuple(problems))


def default_cache_path() -> Path:
    """Where the downloaded test set lives: $SGLANG_PD_CACHE_DIR, else $XDG_CACHE_HOME/sglang-pd, else ~/.cache."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-pd"
    )
    return Path(root) / "gsm8k" / "test.jsonl"


def _offline_help(dest: Path) -> str:
    return (
        f"Pass --data PATH with a copy of gsm8k test.jsonl (sha256 {GSM8K_SHA256}), "
        f"or place that file at {dest} (set {CACHE_ENV} to move the cache)."
    )


def _download(url: str, dest: Path, sha256: str, timeout_s: float) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".test.jsonl.", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as f, httpx.stream("GET", url, timeout=timeout_s, follow_redirects=True) as r:
            r.raise_for_status()
            for chunk in r.iter_bytes():
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != sha256:
            raise DataUnavailable(
                f"The file downloaded from {url} has sha256 {digest.hexdigest()}, not {sha256}; "
                f"it was discarded. {_offline_help(dest)}"
            )
        tmp.replace(dest)
    except httpx.HTTPError as exc:
        raise DataUnavailable(
            f"Cannot download the gsm8k test set from {url} ({type(exc).__name__}: {exc}); "
            f"this machine may be offline. {_offline_help(dest)}"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)


def ensure_dataset(
    path: Path | None = None,
    *,
    url: str = GSM8K_URL,
    sha256: str = GSM8K_SHA256,
    cache_path: Path | None = None,
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
) -> Dataset:
    """`path` if given (any gsm8k-format file); else the cached canonical file, downloaded once."""
    if path is not None:
        return load_dataset(path)
    candidates = [cache_path] if cache_path is not None else [default_cache_path(), _fallback_cache_path()]
    for dest in candidates:
        if dest.exists() and sha256_of(dest) == sha256:
            return load_dataset(dest)
    for i, dest in enumerate(candidates):
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _download(url, dest, sha256, timeout_s)
        except OSError as exc:
            # e.g. a pod running as `nobody` with no writable home: try the temp dir next.
            if i + 1 < len(candidates):
                continue
            raise DataUnavailable(
                f"Cannot write the gsm8k cache at {dest} ({exc.strerror or exc}). "
                f"Set {CACHE_ENV} to a writable directory, or pass --data PATH."
            ) from exc
        return load_dataset(dest)
    raise AssertionError("unreachable")


def _fallback_cache_path() -> Path:
    return Path(tempfile.gettempdir()) / "sglang-pd" / "gsm8k" / "test.jsonl"
