"""Fixtures for the gsm8k gate: the shared test set, a scripted OpenAI-compatible server on loopback,
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
from sglang_pd.deploy.evals import Dataset, load_dataset
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript
from tests.support.paths import REPO

REPO_ROOT = REPO
GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
GSM8K_TEST = GSM8K_DIR / "test.jsonl"
NUM_SHOTS = 5


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} is missing: CI keeps ../shared/data/gsm8k beside the checkout.")
    return GSM8K_TEST


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
    """Run `sglang-pd eval gsm8k` in-process with fast retries, the shared data and a report path."""
    counter = iter(range(1000))

    def run(base_url: str, *flags: str, report: bool = True) -> CliResult:
        output = tmp_path / f"report-{next(counter)}.json"
        argv = [
            "eval",
            "gsm8k",
            "--base-url",
            base_url,
            "--data",
            str(gsm8k_path),
            "--quiet",
            "--retry-backoff",
            "0.01",
        ]
        argv += [*flags, *(["--output", str(output)] if report else [])]
        code = main(argv)
        captured = capsys.readouterr()
        loaded = json.loads(output.read_text()) if report and output.exists() else None
        return CliResult(code, captured.out, captured.err, loaded)

    return run
