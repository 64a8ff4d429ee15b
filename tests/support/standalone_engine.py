"""One reference engine serving on its own (sglang's non-PD mode), as a process, for tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.polling import free_port, wait_until

__all__ = ["engine_argv", "standalone_engine"]

MODEL = "tiny-deepseek-v3"


def engine_argv(port: int, *extra: str) -> list[str]:
    """`sglang-pd engine --role both` on `port` with the tiny model, plus `extra` flags."""
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "engine", "--role", "both", "--port", str(port)]
    return [*argv, "--model", MODEL, "--threads", "1", *extra]


@contextlib.contextmanager
def standalone_engine(log: Path, *extra: str) -> Iterator[str]:
    """Start the engine (its output in `log`), yield its base URL once `/ping` answers, stop it."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(engine_argv(port, *extra), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/ping", timeout=2).status_code == 200
            return False

        wait_until(up, timeout=120)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
