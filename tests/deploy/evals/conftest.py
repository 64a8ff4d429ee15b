"""Fixtures for the gsm8k gate: the test set shipped in the package, a scripted OpenAI-compatible server on loopback,
and a runner of the real CLI (`sglang-pd eval gsm8k ...`) that returns its exit code and output."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.evals import PACKAGED_GSM8K, Dataset, load_dataset
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript
from tests.support.paths import REPO

REPO_ROOT = REPO
NUM_SHOTS = 5


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    return PACKAGED_GSM8K


@pytest.fixture(scope="session")
def dataset(gsm8k_path: Path) -> Dataset:
    return load_dataset(gsm8k_path)


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve() -> Iterator[Callable[[ServerScript], Gsm8kTestServer]]:
    """Start scripted servers; every one is stopped (and its thread joined) at teardown."""
    servers: list[Gsm8kTestServer] = []

    def start(script: ServerScript) -> Gsm8kTestServer:
        server = Gsm8kTestServer(script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@dataclass
class CliResult:
    code: int
    out: str
    err: str
    report: dict[str, Any] | None


@pytest.fixture
def eval_cli(gsm8k_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `sglang-pd eval gsm8k` in-process with fast retries, the test set as `--data PATH` (`data=False`:
    no `--data`, the packaged default) and a report path."""
    counter = iter(range(1000))

    def run(base_url: str, *flags: str, report: bool = True, data: bool = True) -> CliResult:
        output = tmp_path / f"report-{next(counter)}.json"
        argv = ["eval", "gsm8k", "--base-url", base_url, "--quiet", "--retry-backoff", "0.01"]
        argv += ["--data", str(gsm8k_path)] if data else []
        argv += [*flags, *(["--output", str(output)] if report else [])]
        code = main(argv)
        captured = capsys.readouterr()
        loaded = json.loads(output.read_text()) if report and output.exists() else None
        return CliResult(code, captured.out, captured.err, loaded)

    return run
