"""The gsm8k test set: the copy shipped in this package (the default), a given file, or an explicit download.

The canonical file is openai/grade-school-math's `test.jsonl` (1319 questions, MIT; the notice is in
`gsm8k_data/LICENSE`). It ships as package data, so the gate and the canary need no network; its
sha256 is checked every time it is loaded, and a damaged copy is refused. `--data URL` downloads a
copy instead (once, into a cache directory, checked against the canonical sha256 unless
`--data-sha256` names another); `--data PATH` reads any gsm8k-format file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import DataUnavailable
from .scoring import last_number

__all__ = [
    "GSM8K_BYTES",
    "GSM8K_SHA256",
    "GSM8K_URL",
    "PACKAGED_GSM8K",
    "DataSource",
    "Dataset",
    "Download",
    "Problem",
    "check_sha256",
    "default_cache_path",
    "download_dataset",
    "ensure_dataset",
    "load_dataset",
    "load_packaged",
    "parse_source",
    "sha256_of",
]

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl"
GSM8K_SHA256 = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
GSM8K_BYTES = 749738
GSM8K_SIZE = 1319
# The copy shipped in the package ([tool.setuptools.package-data] in pyproject.toml).
PACKAGED_GSM8K = Path(__file__).resolve().parent / "gsm8k_data" / "test.jsonl"
CACHE_ENV = "SGLANG_PD_CACHE_DIR"
DOWNLOAD_TIMEOUT_S = 60.0
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Download:
    """An explicit `--data URL`: fetched over HTTP(S) into the cache, then checked like any file."""

    url: str


# None: the packaged copy; a Path: a local file; a Download: a URL fetched on request only.
DataSource = Path | Download | None


def parse_source(value: str) -> Path | Download:
    """`--data`'s value: an http(s) URL is a download, anything else a local path."""
    if value.startswith(("http://", "https://")):
        return Download(value)
    return Path(value)


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


def check_sha256(value: str) -> str:
    """A sha256 as 64 lowercase hex digits (`--data-sha256`); raises ValueError otherwise."""
    value = value.strip().lower()
    if not _SHA256.match(value):
        raise ValueError(f"{value!r} is not a sha256 (64 hex digits)")
    return value


def _label(answer: str, where: str) -> str:
    _, sep, tail = answer.rpartition("####")
    if not sep:
        raise DataUnavailable(f"{where}: the answer has no '#### <number>' line; is this a gsm8k jsonl file?")
    value = last_number(tail)
    if value is None:
        raise DataUnavailable(f"{where}: no number after '####' in the answer ({tail.strip()!r}).")
    return value


def _parse(path: Path, text: str) -> tuple[Problem, ...]:
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
    return tuple(problems)


def _load(path: Path, expected_sha256: str | None, fix: str) -> Dataset:
    """Read, checksum (before parsing, so a short file is named as such), parse."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataUnavailable(f"Cannot read the gsm8k data file {path}: {exc.strerror or exc}. {fix}") from exc
    digest = hashlib.sha256(raw).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        size = f"{len(raw)} bytes"
        if expected_sha256 == GSM8K_SHA256:
            size += f", not {GSM8K_BYTES}" if len(raw) != GSM8K_BYTES else ", the right size"
        raise DataUnavailable(
            f"The gsm8k data file {path} has sha256 {digest} ({size}), not {expected_sha256}: "
            f"it is damaged, cut short or another file. {fix}"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataUnavailable(f"The gsm8k data file {path} is not UTF-8 text ({exc.reason}). {fix}") from exc
    return Dataset(path=path, sha256=digest, problems=_parse(path, text))


def load_dataset(path: Path, *, sha256: str | None = None) -> Dataset:
    """Read a gsm8k-format jsonl file: one `{"question": ..., "answer": "... #### N"}` object a line.
    With `sha256`, the file must have that digest."""
    fix = (
        "Replace it with a good copy, or leave out --data-sha256 to use it as it is."
        if sha256 is not None
        else "Pass --data PATH with a readable gsm8k jsonl file, or leave out --data for the copy shipped in sglang-pd."
    )
    return _load(path, sha256, fix)


def load_packaged() -> Dataset:
    """The test set shipped in this package, sha256-checked: no network."""
    fix = (
        "The sglang-pd installation is damaged: reinstall it (pip install --force-reinstall --no-deps sglang-pd, "
        "or rebuild the image), or pass --data PATH|URL with a good copy of gsm8k test.jsonl "
        f"(sha256 {GSM8K_SHA256})."
    )
    return _load(PACKAGED_GSM8K, GSM8K_SHA256, fix)


def default_cache_path() -> Path:
    """Where a downloaded test set lives: $SGLANG_PD_CACHE_DIR, else $XDG_CACHE_HOME/sglang-pd, else ~/.cache."""
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-pd"
    )
    return Path(root) / "gsm8k" / "test.jsonl"


def _fallback_cache_path() -> Path:
    return Path(tempfile.gettempdir()) / "sglang-pd" / "gsm8k" / "test.jsonl"


def _offline_help(dest: Path) -> str:
    return (
        "Leave out --data to use the copy shipped in sglang-pd (no network), "
        f"pass --data PATH with a copy of the file (gsm8k test.jsonl: sha256 {GSM8K_SHA256}), "
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


def download_dataset(
    url: str,
    *,
    sha256: str = GSM8K_SHA256,
    cache_path: Path | None = None,
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
) -> Dataset:
    """`--data URL`: the cached copy when its sha256 matches, else downloaded once into the cache."""
    candidates = [cache_path] if cache_path is not None else [default_cache_path(), _fallback_cache_path()]
    for dest in candidates:
        if dest.exists() and sha256_of(dest) == sha256:
            return load_dataset(dest, sha256=sha256)
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
                f"Set {CACHE_ENV} to a writable directory, pass --data PATH, or leave out --data to use "
                "the copy shipped in sglang-pd."
            ) from exc
        return load_dataset(dest, sha256=sha256)
    raise AssertionError("unreachable")


def ensure_dataset(
    source: DataSource = None,
    *,
    sha256: str | None = None,
    cache_path: Path | None = None,
    timeout_s: float = DOWNLOAD_TIMEOUT_S,
) -> Dataset:
    """The data a run asks for: the packaged copy (None), a local file (a Path, checked against `sha256`
    when given) or a download (a Download, checked against `sha256`, by default the canonical one)."""
    if source is None:
        if sha256 is not None and sha256 != GSM8K_SHA256:
            raise DataUnavailable(
                f"The gsm8k test set shipped in sglang-pd has sha256 {GSM8K_SHA256}, not {sha256}: "
                "pass --data PATH|URL with the file --data-sha256 describes, or leave out --data-sha256."
            )
        return load_packaged()
    if isinstance(source, Download):
        return download_dataset(source.url, sha256=sha256 or GSM8K_SHA256, cache_path=cache_path, timeout_s=timeout_s)
    return load_dataset(source, sha256=sha256)
