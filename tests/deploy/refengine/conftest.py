"""Factory fixtures: reference engines and routers as real processes on loopback, free ports."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.support.polling import free_port

# The engines of these tests run the tiny DeepSeek-V3-shaped model unless a test asks for another: it
# loads in seconds and its KV pages hold MLA latent rows, the layout the GPU presets transfer.
TINY_MODEL = "tiny-deepseek-v3"


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    bootstrap_port: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_]+)(\{[^}]*\})? (\S+)$", line)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out

    def metric(self, name: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def _spawn(name: str, argv: list[str], tmp: Path, env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    log = tmp / f"{name}.log"
    return subprocess.Popen(
        argv,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def _wait_healthy(procs: list[Proc], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if p.name.startswith("router"):
                    # a router serves at once; it can route once it has seen a healthy worker of each role
                    workers = httpx.get(f"{p.url}/workers", timeout=2).json()
                    if all(any(w["healthy"] for w in workers[role]) for role in ("prefill", "decode")):
                        pending.remove(p)
                # an engine's /health is a generation answered on sglang's 1 s tick
                elif httpx.get(f"{p.url}/health", timeout=25).status_code == 200:
                    pending.remove(p)
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {timeout_s} s: {[p.name for p in pending]}")
        time.sleep(0.2)


class Launcher:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    def engine(
        self,
        role: str,
        env: dict[str, str] | None = None,
        name: str | None = None,
        model: str = TINY_MODEL,
        args: Sequence[str] = (),
    ) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "engine", "--role", role, "--port", str(port)]
        argv += ["--model", model, "--threads", "1", "--log-level", "info", *args]
        bp = None
        if role == "prefill":
            bp = free_port()
            argv += ["--bootstrap-port", str(bp), "--bootstrap-timeout", "10"]
        name = name or f"{role}-{port}"
        p = Proc(name, _spawn(name, argv, self.tmp, env), f"http://127.0.0.1:{port}", self.tmp / f"{name}.log", bp)
        self.procs.append(p)
        return p

    def router(self, prefill: Proc, decode: Proc, args: Sequence[str] = ()) -> Proc:
        port = free_port()
        argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        argv += [
            "--prefill",
            prefill.url,
            str(prefill.bootstrap_port),
            "--decode",
            decode.url,
            "--log-level",
            "warning",
        ]
        argv += ["--max-retries", "0", *args]
        name = f"router-{port}"
        p = Proc(name, _spawn(name, argv, self.tmp, None), f"http://127.0.0.1:{port}", self.tmp / f"{name}.log")
        self.procs.append(p)
        return p

    def wait(self, *procs: Proc) -> None:
        _wait_healthy(list(procs) or self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(timeout=10)


@contextlib.contextmanager
def launcher(tmp: Path) -> Iterator[Launcher]:
    lx = Launcher(tmp)
    try:
        yield lx
    finally:
        lx.close()


@dataclass
class PDStack:
    prefill: Proc
    decode: Proc
    router: Proc


@contextlib.contextmanager
def pd_stack_of(tmp: Path, model: str = TINY_MODEL) -> Iterator[PDStack]:
    """One prefill engine and one decode engine of `model`, our router in front, all ready."""
    with launcher(tmp) as lx:
        prefill, decode = lx.engine("prefill", model=model), lx.engine("decode", model=model)
        router = lx.router(prefill, decode)
        lx.wait()
        yield PDStack(prefill, decode, router)


@pytest.fixture(scope="package")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    """The tiny model's stack, shared by the package's tests."""
    with pd_stack_of(tmp_path_factory.mktemp("pd")) as stack:
        yield stack


@pytest.fixture(scope="package")
def reference_model():  # type: ignore[no-untyped-def]
    """The same tiny model in this process: the single-process run the PD output must equal."""
    from sglang_pd.deploy.refengine.model import load_model

    return load_model(TINY_MODEL, seed=0)


def greedy_reference(model, ids: list[int], n: int, *, stop_at_eos: bool = False) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy decoding in one process with transformers' own cache: no pages, no transfer."""
    import torch

    eos = model.tokenizer.eos_token_id if stop_at_eos else None
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), use_cache=True)
        cache, tokens = out.past_key_values, [int(out.logits[0, -1].argmax())]
        for i in range(n - 1):
            if tokens[-1] == eos:
                break
            logits = model.model(
                input_ids=torch.tensor([[tokens[-1]]]),
                past_key_values=cache,
                position_ids=torch.tensor([[len(ids) + i]]),
                use_cache=True,
            ).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def read_registered_region(peer: str, nbytes: int):  # type: ignore[no-untyped-def]
    """The first `nbytes` of the memory the engine at Mooncake address `peer` (host:port) registered
    (its KV pool), read over TCP as any Mooncake peer can: a uint8 tensor."""
    import torch
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = torch.ones(nbytes, dtype=torch.uint8)  # ones: a read that wrote nothing would not pass as zeros
    assert te.register_memory(local.data_ptr(), nbytes) == 0
    try:
        remote = te.get_first_buffer_address(peer)
        assert te.transfer_sync_read(peer, local.data_ptr(), remote, nbytes) == 0
    finally:
        te.unregister_memory(local.data_ptr())
    return local
