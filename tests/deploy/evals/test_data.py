"""The data: a given file, or the canonical one downloaded once over real HTTP and checked by sha256."""

from __future__ import annotations

import http.server
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_pd.deploy.evals import DataUnavailable, ensure_dataset, load_dataset
from sglang_pd.deploy.evals.data import GSM8K_SHA256, default_cache_path, sha256_of


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
    first = ensure_dataset(url=file_server.url, cache_path=cache)
    second = ensure_dataset(url=file_server.url, cache_path=cache)
    assert first.canonical and second.canonical and len(second.problems) == 1319
    assert file_server.gets == 1
    assert sha256_of(cache) == GSM8K_SHA256


def test_corrupt_cache_is_downloaded_again(file_server: _FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "test.jsonl"
    cache.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert ensure_dataset(url=file_server.url, cache_path=cache).canonical
    assert file_server.gets == 1


def test_checksum_mismatch_is_refused_and_not_kept(file_server: _FileServer, tmp_path: Path) -> None:
    cache = tmp_path / "test.jsonl"
    with pytest.raises(DataUnavailable, match=r"has sha256 3730d3.*not 0000.*--data PATH"):
        ensure_dataset(url=file_server.url, sha256="0" * 64, cache_path=cache)
    assert list(tmp_path.iterdir()) == []


def test_offline_says_how_to_supply_the_file(tmp_path: Path, closed_port: int) -> None:
    cache = tmp_path / "test.jsonl"
    with pytest.raises(DataUnavailable) as info:
        ensure_dataset(url=f"http://127.0.0.1:{closed_port}/test.jsonl", cache_path=cache, timeout_s=2)
    message = str(info.value)
    assert "may be offline" in message and "--data PATH" in message and str(cache) in message
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
    data = ensure_dataset(url=file_server.url)
    assert data.canonical and data.path == tmp_path / "tmp" / "sglang-pd" / "gsm8k" / "test.jsonl"


def test_no_writable_cache_says_what_to_set(file_server: _FileServer, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(DataUnavailable, match="Set SGLANG_PD_CACHE_DIR to a writable directory, or pass --data PATH"):
        ensure_dataset(url=file_server.url, cache_path=blocker / "test.jsonl")
