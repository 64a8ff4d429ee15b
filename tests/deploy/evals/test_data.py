"""The data: the copy shipped in the package (no network, sha256-checked), a given file, or an explicit
`--data URL` downloaded once over real HTTP on loopback and checked by sha256."""

from __future__ import annotations

import http.server
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.evals import Dataset, DataUnavailable, Download, ensure_dataset, load_dataset, load_packaged
from sglang_pd.deploy.evals import data as data_module
from sglang_pd.deploy.evals.data import GSM8K_BYTES, GSM8K_SHA256, default_cache_path, parse_source, sha256_of
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

from .conftest import CliResult

Serve = Callable[[ServerScript], Gsm8kTestServer]
EvalCli = Callable[..., CliResult]


class _FileServer:
    """Serves one body at /test.jsonl from a thread on loopback; counts the GETs."""

    def __init__(self, body: bytes) -> None:
        outer = self
        self.gets = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.gets += 1
                self.send_response(200 if self.path == "/test.jsonl" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/test.jsonl"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def file_server(gsm8k_path: Path) -> Iterator[_FileServer]:
    with _FileServer(gsm8k_path.read_bytes()) as server:
        yield server


def test_download_once_then_cached(file_server: _FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "gsm8k" / "test.jsonl"
    first = ensure_dataset(Download(file_server.url), cache_path=cache)
    second = ensure_dataset(Download(file_server.url), cache_path=cache)
    assert first.canonical and second.canonical and len(second.problems) == 1319
    assert file_server.gets == 1
    assert sha256_of(cache) == GSM8K_SHA256


def test_corrupt_cache_is_downloaded_again(file_server: _FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "test.jsonl"
    cache.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert ensure_dataset(Download(file_server.url), cache_path=cache).canonical
    assert file_server.gets == 1


def test_checksum_mismatch_is_refused_and_not_kept(file_server: _FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "test.jsonl"
    with pytest.raises(DataUnavailable, match=r"has sha256 3730d3.*not 0000.*--data PATH"):
        ensure_dataset(Download(file_server.url), sha256="0" * 64, cache_path=cache)
    assert list(tmp_path.iterdir()) == []


def test_offline_says_how_to_supply_the_file(tmp_path: Path, closed_port: int) -> None:
    cache = tmp_path / "test.jsonl"
    with pytest.raises(DataUnavailable) as info:
        ensure_dataset(Download(f"http://127.0.0.1:{closed_port}/test.jsonl"), cache_path=cache, timeout_s=2)
    message = str(info.value)
    assert "may be offline" in message and "--data PATH" in message and str(cache) in message
    assert "Leave out --data to use the copy shipped in sglang-pd" in message
    assert GSM8K_SHA256 in message


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SGLANG_PD_CACHE_DIR", str(tmp_path))
    assert default_cache_path() == tmp_path / "gsm8k" / "test.jsonl"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json\n", "not a gsm8k line"),
        ('{"question": "q"}\n', "not a gsm8k line"),
        ('{"question": "q", "answer": "no marker"}\n', "no '#### <number>' line"),
        ('{"question": "q", "answer": "#### many"}\n', "no number after '####'"),
        ("\n", "holds no questions"),
    ],
)
def test_bad_files_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(DataUnavailable, match=message):
        load_dataset(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataUnavailable, match="Cannot read the gsm8k data file"):
        load_dataset(tmp_path / "absent.jsonl")


def test_custom_file_is_not_canonical(tmp_path: Path) -> None:
    path = tmp_path / "mini.jsonl"
    path.write_text('{"question": "q", "answer": "1 + 1 = 2\\n#### 2"}\n')
    data = load_dataset(path)
    assert not data.canonical and data.problems[0].label == "2"


def test_unwritable_cache_falls_back_to_the_temp_dir(
    file_server: _FileServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the cache dir cannot be created under a file (root ignores chmod)
    monkeypatch.setenv("SGLANG_PD_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    data = ensure_dataset(Download(file_server.url))
    assert data.canonical and data.path == tmp_path / "tmp" / "sglang-pd" / "gsm8k" / "test.jsonl"


def test_no_writable_cache_says_what_to_set(file_server: _FileServer, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(DataUnavailable, match="Set SGLANG_PD_CACHE_DIR to a writable directory, pass --data PATH"):
        ensure_dataset(Download(file_server.url), cache_path=blocker / "test.jsonl")


# The shipped copy: the default of every run, read with no network at all.


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The download function and httpx's streaming GET both raise if called; each attempt is recorded."""
    attempts: list[str] = []

    def refuse_stream(method: str, url: str, **kwargs: Any) -> Any:
        attempts.append(url)
        raise httpx.ConnectError(f"no network in this test ({url})")

    def refuse_download(url: str, *args: Any, **kwargs: Any) -> None:
        attempts.append(url)
        raise AssertionError(f"the gsm8k data was downloaded from {url} although no --data URL was given")

    monkeypatch.setattr(data_module.httpx, "stream", refuse_stream)
    monkeypatch.setattr(data_module, "_download", refuse_download)
    return attempts


def test_the_packaged_copy_is_the_canonical_test_set(no_network: list[str]) -> None:
    data = ensure_dataset()
    assert data.canonical and len(data.problems) == 1319 and data.path == data_module.PACKAGED_GSM8K
    assert data.path.stat().st_size == GSM8K_BYTES and no_network == []
    license_text = (data.path.parent / "LICENSE").read_text()
    assert "MIT License" in license_text and "Copyright (c) 2021 OpenAI" in license_text


def test_the_gate_runs_offline_on_the_packaged_copy(
    no_network: list[str], dataset: Dataset, serve: Serve, eval_cli: EvalCli
) -> None:
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    result = eval_cli(server.base_url, "--num-questions", "10", data=False)
    assert result.code == 0, result.err
    assert result.report is not None and result.report["config"]["data_canonical"]
    assert result.report["config"]["data_path"] == str(data_module.PACKAGED_GSM8K)
    assert no_network == []


def _damaged_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: int) -> Path:
    copy = tmp_path / "site-packages" / "gsm8k_data" / "test.jsonl"
    copy.parent.mkdir(parents=True)
    shutil.copy(data_module.PACKAGED_GSM8K, copy)
    body = copy.read_bytes()
    copy.write_bytes(body[:-cut] if cut else body.replace(b"#### 18", b"#### 19", 1))
    monkeypatch.setattr(data_module, "PACKAGED_GSM8K", copy)
    return copy


@pytest.mark.parametrize(
    ("cut", "size"), [(100, f"{GSM8K_BYTES - 100} bytes, not {GSM8K_BYTES}"), (0, "the right size")]
)
def test_a_damaged_packaged_copy_is_refused_naming_the_file_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: list[str], cut: int, size: str
) -> None:
    copy = _damaged_copy(tmp_path, monkeypatch, cut)
    with pytest.raises(DataUnavailable) as info:
        load_packaged()
    message = str(info.value)
    assert f"The gsm8k data file {copy} has sha256" in message and size in message
    assert f"not {GSM8K_SHA256}" in message
    assert "reinstall it (pip install --force-reinstall --no-deps sglang-pd" in message
    assert "--data PATH|URL" in message and no_network == []


def test_a_damaged_packaged_copy_exits_3_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: list[str], eval_cli: EvalCli, closed_port: int
) -> None:
    copy = _damaged_copy(tmp_path, monkeypatch, 1)
    result = eval_cli(f"http://127.0.0.1:{closed_port}/v1", data=False, report=False)
    assert result.code == 3
    assert f"error: The gsm8k data file {copy} has sha256" in result.err and "reinstall it" in result.err


# The explicit download: `--data URL` through the CLI, against a real HTTP server on loopback.


def test_data_url_downloads_once_through_the_cli(
    file_server: _FileServer,
    dataset: Dataset,
    serve: Serve,
    eval_cli: EvalCli,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_PD_CACHE_DIR", str(tmp_path / "cache"))
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    for _ in range(2):
        result = eval_cli(server.base_url, "--num-questions", "5", "--data", file_server.url, data=False)
        assert result.code == 0, result.err
        assert result.report is not None and result.report["config"]["data_canonical"]
    assert file_server.gets == 1
    assert sha256_of(tmp_path / "cache" / "gsm8k" / "test.jsonl") == GSM8K_SHA256


def test_data_sha256_checks_a_local_file(tmp_path: Path, gsm8k_path: Path) -> None:
    assert load_dataset(gsm8k_path, sha256=GSM8K_SHA256).canonical
    with pytest.raises(DataUnavailable, match=r"has sha256 3730d3.*not 1111.*leave out --data-sha256"):
        load_dataset(gsm8k_path, sha256="1" * 64)


def test_data_sha256_must_be_a_sha256(eval_cli: EvalCli, closed_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        eval_cli(f"http://127.0.0.1:{closed_port}/v1", "--data-sha256", "abc", data=False, report=False)
    assert info.value.code == 2 and "'abc' is not a sha256 (64 hex digits)" in capsys.readouterr().err


def test_data_sha256_needs_data(eval_cli: EvalCli, closed_port: int) -> None:
    result = eval_cli(f"http://127.0.0.1:{closed_port}/v1", "--data-sha256", "0" * 64, data=False, report=False)
    assert result.code == 2 and "--data-sha256 needs --data PATH|URL" in result.err


def test_parse_source() -> None:
    assert parse_source("https://example.org/t.jsonl") == Download("https://example.org/t.jsonl")
    assert parse_source("http://127.0.0.1:1/t.jsonl") == Download("http://127.0.0.1:1/t.jsonl")
    assert parse_source("/data/test.jsonl") == Path("/data/test.jsonl")
