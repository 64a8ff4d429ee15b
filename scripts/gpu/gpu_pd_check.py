"""Real sglang on one GPU: PD through our router, checked token for token against one plain server.

Runs on a CUDA machine where sglang, its kernel package and Mooncake's CUDA build import (see
`scripts/gpu/gpu_bundle.py` for a machine without internet). In order:

1. `single`: one plain (non-PD) sglang server; greedy outputs of the prompts in five forms
   (`/generate` plain and streamed, chat plain and streamed, the `openai` client); TTFT/ITL at
   concurrency 1, 8 and 32; what it answers at the HTTP level (`record_sglang_http.py`), written
   to `sglang-<version>-http.json` for the tests' stand-ins.
2. `pd`: `sglang-pd up single-h200` with the router's default settings (prefill + decode sglang on
   GPU 0, KV over Mooncake TCP); the same prompts must give the same tokens in all five forms;
   usage counts; client disconnects abort both servers; 200 aborted requests leave KV usage at
   idle; `sglang-pd eval gsm8k` end to end; TTFT/ITL through the router and straight to the two
   servers (the latency the router adds); the decode server killed mid-stream.
3. `doctor`: `sglang-pd doctor` on this machine.

Every wait has a stated limit: a server not ready within READY_S, or a stack whose router has no
healthy prefill and decode within READY_S, fails the stage with each component's state (process
alive, `/health`, the router's view of its workers, the log's last lines); the whole run stops
after --deadline-s. Writes `report.json` (every check with its numbers, the commit checked) and the
servers' logs under --out.

    python scripts/gpu/gpu_pd_check.py --out $OUT --gsm8k-data gsm8k-test.jsonl --commit SHA
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from record_sglang_http import record

from sglang_pd.deploy.common.procs import Child, spawn

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = "single-h200"
SINGLE_PORT = 31000
ROUTER = "http://127.0.0.1:8000"
PREFILL = "http://127.0.0.1:30000"
DECODE = "http://127.0.0.1:30001"
BOOTSTRAP_PORT = 8998
MAX_NEW_TOKENS = 32
CONCURRENCIES = (1, 8, 32)
# A cold start compiles FlashInfer's and sglang's JIT kernels (about 160 s on an H200); a second
# server of the same model reuses the cache.
READY_S = 420.0


def prompts() -> list[str]:
    """20 prompts of mixed length; the byte tokenizer makes one token per byte, so lengths are tokens.

    The long ones cross the preset's KV page (16 tokens) and its prefill chunk (256 tokens).
    """
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "wise",
        "owls",
        "count",
        "stars",
    ]
    out = []
    for i, n in enumerate([3, 8, 15, 17, 33, 64, 100, 150, 255, 257, 300, 400, 512, 700, 900, 1100, 5, 40, 260, 1500]):
        text = f"Prompt {i}:"
        k = i
        while len(text) < n:
            text += " " + words[k % len(words)]
            k += 3
        out.append(text[:n] if n > 12 else text)
    return out


# --------------------------------------------------------------------------------------------
# Processes


class Stack:
    """The checked processes (`deploy/common/procs.py` children), each logging to `<out>/<name>.log`."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start `argv` logging to `<out>/<name>.log`; `env` is added to this process's environment."""
        with open(self.out / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            child = spawn(name, argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=False)
        self.children[name] = child
        return child

    def stop(self, name: str, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        child = self.children.pop(name, None)
        if child is None:
            return
        child.signal_group(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(grace_s)
        child.reap()

    def stop_all(self) -> None:
        for name in list(self.children):
            self.stop(name)


# --------------------------------------------------------------------------------------------
# Requests


async def generate(s: aiohttp.ClientSession, base: str, text: str, *, stream: bool) -> dict[str, Any]:
    body = {
        "text": text,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        "stream": stream,
    }
    async with s.post(f"{base}/generate", json=body) as r:
        if not stream:
            return {"status": r.status, **(await r.json())}
        last: dict[str, Any] = {}
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                last = json.loads(line[5:])
        return {"status": r.status, **last}


async def chat(s: aiohttp.ClientSession, base: str, text: str, *, stream: bool) -> dict[str, Any]:
    body = {
        "model": "tiny-deepseek-v3",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": MAX_NEW_TOKENS,
        "stream": stream,
    }
    async with s.post(f"{base}/v1/chat/completions", json=body) as r:
        if not stream:
            data = await r.json()
            return {"status": r.status, "text": data["choices"][0]["message"]["content"], "usage": data.get("usage")}
        parts = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                chunk = json.loads(line[5:])
                for c in chunk.get("choices", []):
                    parts.append(c.get("delta", {}).get("content") or "")
        return {"status": r.status, "text": "".join(parts)}


async def outputs(base: str) -> dict[str, list[Any]]:
    """Greedy outputs of every prompt: /generate plain and streamed, chat plain and streamed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        ps = prompts()
        gen = await asyncio.gather(*(generate(s, base, p, stream=False) for p in ps))
        gen_s = await asyncio.gather(*(generate(s, base, p, stream=True) for p in ps))
        ch = await asyncio.gather(*(chat(s, base, p, stream=False) for p in ps))
        ch_s = await asyncio.gather(*(chat(s, base, p, stream=True) for p in ps))
    oa = await asyncio.to_thread(openai_texts, base, ps)
    return {
        "generate_ids": [g.get("output_ids") for g in gen],
        "generate_text": [g.get("text") for g in gen],
        "generate_stream_text": [g.get("text") for g in gen_s],
        "chat_text": [c["text"] for c in ch],
        "chat_stream_text": [c["text"] for c in ch_s],
        "openai_text": oa,
        "statuses": sorted({g["status"] for g in [*gen, *gen_s, *ch, *ch_s]}),
    }


def openai_texts(base: str, ps: list[str]) -> list[str | None]:
    """Greedy chat answers through the official `openai` client, one prompt at a time."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)
    texts = []
    for p in ps:
        r = client.chat.completions.create(
            model="tiny-deepseek-v3",
            messages=[{"role": "user", "content": p}],
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
        )
        texts.append(r.choices[0].message.content)
    return texts


async def _direct_pd_stream(s: aiohttp.ClientSession, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """The PD protocol without a router: the same body plus bootstrap fields to both servers; the
    decode's stream is returned, the prefill's answer drained in the background."""
    room = int.from_bytes(os.urandom(8), "big") >> 1
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOTSTRAP_PORT, "bootstrap_room": room}

    async def drain_prefill() -> None:
        async with s.post(f"{PREFILL}/v1/completions", json={**body, "stream": False}) as r:
            await r.read()

    task = asyncio.create_task(drain_prefill())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return await s.post(f"{DECODE}/v1/completions", json=body)


_BACKGROUND: set[asyncio.Task[None]] = set()


async def latency(
    base: str, concurrency: int, *, prompt_len: int = 512, max_tokens: int = 64, direct_pd: bool = False
) -> dict[str, float]:
    """Streamed completions in a closed loop: TTFT (includes the KV hand-off in PD) and ITL, in ms.
    `direct_pd`: to the two PD servers without the router (`base` unused)."""
    prompt = ("benchmark text " * 200)[:prompt_len]
    n_requests = max(2 * concurrency, 16)
    ttft: list[float] = []
    itl: list[float] = []
    queue = list(range(n_requests))

    async def worker(s: aiohttp.ClientSession) -> None:
        while queue:
            i = queue.pop()
            body = {
                "model": "tiny-deepseek-v3",
                "prompt": f"{i} {prompt}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            t0 = time.perf_counter()
            last = None
            opened = _direct_pd_stream(s, body) if direct_pd else s.post(f"{base}/v1/completions", json=body)
            async with await opened as r:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append((now - t0) * 1e3)
                    else:
                        itl.append((now - last) * 1e3)
                    last = now

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
        if _BACKGROUND:
            await asyncio.wait(list(_BACKGROUND), timeout=30)
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": n_requests,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_mean_ms": statistics.fmean(ttft),
        "itl_p50_ms": statistics.median(itl),
        "itl_mean_ms": statistics.fmean(itl),
        "output_tok_per_s": n_requests * max_tokens / wall,
    }


def metric(base: str, name: str) -> float | None:
    """One sglang Prometheus gauge, summed over its label sets (None when absent)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


async def disconnect_after_first_chunk(base: str, n: int, concurrency: int = 50) -> int:
    """Open n long streams and drop each connection after its first chunk; returns how many got one."""
    got = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        nonlocal got
        async with sem:
            body = {
                "model": "tiny-deepseek-v3",
                "prompt": f"abort {i} " + "x" * 300,
                "max_tokens": 2000,
                "ignore_eos": True,
                "stream": True,
            }
            s = aiohttp.ClientSession()
            try:
                r = await s.post(f"{base}/v1/completions", json=body)
                async for raw in r.content:
                    if raw.strip().startswith(b"data:"):
                        got += 1
                        break
                r.close()  # drop the connection mid-stream
            finally:
                await s.close()

    await asyncio.gather(*(one(i) for i in range(n)))
    return got


async def kill_mid_stream(base: str, victim_pgid: int, n: int = 8) -> list[str]:
    """Start n long streams, SIGKILL the decode server after their first chunks; each must end."""
    outcomes: list[str] = []
    started = asyncio.Event()

    async def one(i: int) -> None:
        body = {
            "model": "tiny-deepseek-v3",
            "prompt": f"kill {i}",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            try:
                async with s.post(f"{base}/v1/completions", json=body) as r:
                    saw_error = False
                    async for raw in r.content:
                        started.set()
                        if b'"error"' in raw:
                            saw_error = True
                    outcomes.append("error event" if saw_error else "clean end")
            except TimeoutError:
                outcomes.append("HUNG (60 s)")
            except aiohttp.ClientError as exc:
                outcomes.append(f"connection error: {type(exc).__name__}")

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    async with asyncio.timeout(60):
        await started.wait()
    await asyncio.sleep(0.5)
    os.killpg(victim_pgid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    return outcomes


# --------------------------------------------------------------------------------------------
# Stages


def rendered_commands() -> dict[str, Any]:
    """The topology's rendered sglang commands (what `up` starts), for the single server's flags."""
    out = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", TOPOLOGY, "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def single_server_argv(plan: dict[str, Any]) -> list[str]:
    """The decode command without its PD flags: the same model and kernels as one plain server."""
    argv = list(plan["roles"]["decode"][0]["argv"])
    drop_with_value = {
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port",
        "--disaggregation-ib-device",
        "--port",
        "--base-gpu-id",
        "--mem-fraction-static",
    }
    clean: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in drop_with_value:
            skip = True
            continue
        clean.append(a)
    # The renderer names the module (`-m sglang.launch_server ...`); this interpreter runs it.
    return [sys.executable, *clean, "--port", str(SINGLE_PORT), "--mem-fraction-static", "0.3"]


class NotReady(RuntimeError):
    """A component did not come up within its limit; the message says which, with the evidence."""


def _health(base: str) -> str:
    try:
        r = httpx.get(f"{base}/health", timeout=25)
        return f"GET /health answered {r.status_code}"
    except httpx.HTTPError as exc:
        return f"GET /health failed: {type(exc).__name__} {exc}"


def _log_tail(path: Path, lines: int = 15) -> list[str]:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace").splitlines()[-lines:]
    return []


def diagnose(stack: Stack) -> dict[str, Any]:
    """Each component's state, for a stack that did not come up."""
    state: dict[str, Any] = {
        "processes": {
            name: ("alive" if c.alive() else f"exited {c.proc.returncode}") for name, c in stack.children.items()
        },
        "prefill": _health(PREFILL),
        "decode": _health(DECODE),
    }
    try:
        state["router_workers"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        state["router_workers"] = f"GET /workers failed: {type(exc).__name__} {exc}"
    logs = sorted(stack.out.glob("*.log")) + sorted((stack.out / "engines").glob("*.log"))
    state["log_tails"] = {str(p.relative_to(stack.out)): _log_tail(p) for p in logs}
    return state


def wait_server(stack: Stack, name: str, base: str, timeout_s: float) -> dict[str, Any]:
    """Poll `GET /health` until 200, noting what the server answered before (sglang: 503 while it
    starts). NotReady when the process exits or `timeout_s` passes."""
    child, t0 = stack.children[name], time.monotonic()
    first_answer, before_ready = None, {}
    while time.monotonic() - t0 < timeout_s:
        if not child.alive():
            raise NotReady(f"{name} exited with code {child.proc.returncode} before it was ready: {diagnose(stack)}")
        with contextlib.suppress(httpx.HTTPError):
            status = httpx.get(f"{base}/health", timeout=25).status_code
            first_answer = first_answer if first_answer is not None else time.monotonic() - t0
            if status == 200:
                return {
                    "ready_s": time.monotonic() - t0,
                    "first_http_answer_s": first_answer,
                    "statuses_before_ready": before_ready,
                }
            before_ready[str(status)] = before_ready.get(str(status), 0) + 1
        time.sleep(1.0)
    raise NotReady(f"{name} was not ready within {timeout_s:g} s: {diagnose(stack)}")


#: What `up` prints last in its start-up, after its smoke request through the router (deploy/ops/up.py;
#: tests/deploy/ops/test_up_smoke.py reads it after the smoke line). Until then that request shares the
#: engines with whatever is measured: on the H200 its streamed chat shared decode batches with the
#: first measured prompt, whose tokens then came out as those of a batch of two.
UP_STARTED = "try: curl "


def wait_stack(stack: Stack, timeout_s: float) -> dict[str, Any]:
    """Wait until `up` has finished starting (its smoke request included) and the router has a
    healthy prefill and decode (its /readiness is 200 as soon as it serves, with or without workers:
    the workers' health is in GET /workers)."""
    t0 = time.monotonic()
    up_log = stack.out / "up.log"
    while time.monotonic() - t0 < timeout_s:
        if not stack.children["up"].alive():
            raise NotReady(f"`sglang-pd up` exited with code {stack.children['up'].proc.returncode}: {diagnose(stack)}")
        if UP_STARTED not in up_log.read_text(errors="replace"):
            time.sleep(0.2)
            continue
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            workers = httpx.get(f"{ROUTER}/workers", timeout=5).json()
            if all(any(w["healthy"] for w in workers[role]) for role in ("prefill", "decode")):
                readiness = httpx.get(f"{ROUTER}/readiness", timeout=5)
                return {"ready_s": time.monotonic() - t0, "readiness": readiness.status_code}
        time.sleep(1.0)
    raise NotReady(f"the PD stack was not ready within {timeout_s:g} s: {diagnose(stack)}")


def stage_single(stack: Stack, report: dict[str, Any], recording: dict[str, Any]) -> dict[str, list[Any]]:
    argv = single_server_argv(rendered_commands())
    report["single"] = {"argv": argv}
    base = f"http://127.0.0.1:{SINGLE_PORT}"
    stack.start("single", argv)
    start = wait_server(stack, "single", base, READY_S)
    report["single"].update(start)
    ref = asyncio.run(outputs(base))
    report["single"]["latency"] = [asyncio.run(latency(base, c)) for c in CONCURRENCIES]
    recording["servers"]["single"] = {"start": start, **asyncio.run(record(base, "single"))}
    stack.stop("single")
    return ref


FORMS = ("generate_ids", "generate_text", "generate_stream_text", "chat_text", "chat_stream_text", "openai_text")


def stage_pd(
    stack: Stack,
    report: dict[str, Any],
    ref: dict[str, list[Any]] | None,
    gsm8k: Path | None,
    recording: dict[str, Any],
) -> None:
    pd: dict[str, Any] = {}
    report["pd"] = pd
    engine_logs = stack.out / "engines"
    up = [
        sys.executable,
        "-m",
        "sglang_pd.deploy.cli",
        "up",
        TOPOLOGY,
        "--engine",
        "sglang",
        "--log-dir",
        str(engine_logs),
    ]
    pd["argv"] = up[1:]
    stack.start("up", up)
    pd.update(wait_stack(stack, READY_S))
    pd["router_workers_at_ready"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()

    got = asyncio.run(outputs(ROUTER))
    pd["statuses"] = got["statuses"]
    if ref is not None:
        for key in FORMS:
            same = [a == b for a, b in zip(ref[key], got[key], strict=True)]
            pd[f"identical_{key}"] = f"{sum(same)}/{len(same)}"
        pd["first_mismatch"] = next(
            (
                {"form": key, "prompt": i, "single": ref[key][i], "pd": got[key][i]}
                for key in FORMS
                for i in range(len(got[key]))
                if ref[key][i] != got[key][i]
            ),
            None,
        )
    pd["openai"] = check_openai_client()
    routed = [asyncio.run(latency(ROUTER, c)) for c in CONCURRENCIES]
    direct = [asyncio.run(latency(ROUTER, c, direct_pd=True)) for c in CONCURRENCIES]
    pd["latency"] = routed
    pd["latency_direct_pd"] = direct
    pd["router_adds_ms"] = [
        {
            "concurrency": r["concurrency"],
            "ttft_p50": r["ttft_p50_ms"] - d["ttft_p50_ms"],
            "itl_p50": r["itl_p50_ms"] - d["itl_p50_ms"],
        }
        for r, d in zip(routed, direct, strict=True)
    ]
    recording["servers"]["prefill"] = asyncio.run(record(PREFILL, "prefill"))
    recording["servers"]["decode"] = asyncio.run(record(DECODE, "decode"))
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(f"http://127.0.0.1:{BOOTSTRAP_PORT}/health", timeout=5)
        recording["servers"]["prefill"]["bootstrap_health"] = {"status": r.status_code, "body": r.text[:200]}

    servers = {"prefill": PREFILL, "decode": DECODE}
    idle = {r: metric(u, "sglang:num_used_tokens") for r, u in servers.items()}
    n_streams = asyncio.run(disconnect_after_first_chunk(ROUTER, 200))
    time.sleep(5)
    after = {r: metric(u, "sglang:num_used_tokens") for r, u in servers.items()}
    running = {r: metric(u, "sglang:num_running_reqs") for r, u in servers.items()}
    # sglang logs every abort it receives as an access-log line of its own.
    aborts = {r: (engine_logs / f"{r}-0.log").read_text(errors="replace").count("POST /abort_request") for r in servers}
    pd["abort"] = {
        "streams_dropped_after_first_chunk": n_streams,
        "num_used_tokens_idle": idle,
        "num_used_tokens_after_5s": after,
        "num_running_reqs_after_5s": running,
        "abort_requests_in_logs": aborts,
    }
    if gsm8k is not None:
        pd["gsm8k"] = run_gsm8k(stack.out, gsm8k)
    pd["router_workers_before_kill"] = httpx.get(f"{ROUTER}/workers", timeout=5).json()
    decode = find_child("sglang.launch_server", "--disaggregation-mode decode")
    if decode is not None:
        pd["decode_killed_mid_stream"] = asyncio.run(kill_mid_stream(ROUTER, os.getpgid(decode)))
    stack.stop("up", signal.SIGINT, grace_s=60)


def find_child(*needles: str) -> int | None:
    """The pid of the process whose command line holds every needle (the decode scheduler's parent)."""
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if all(n in cmd for n in needles):
                return int(proc.name)
    return None


def check_openai_client() -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{ROUTER}/v1", api_key="none")
    models = [m.id for m in client.models.list().data]
    r = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Hello there"}], max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=models[0],
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in reversed(chunks) if c.usage), None)
    return {
        "models": models,
        "sync_text": r.choices[0].message.content,
        "sync_usage": r.usage.model_dump() if r.usage else None,
        "stream_text": streamed,
        "stream_equals_sync": streamed == r.choices[0].message.content,
        "stream_usage": usage.model_dump() if usage else None,
    }


def run_gsm8k(out: Path, data: Path) -> dict[str, Any]:
    report = out / "gsm8k.json"
    argv = [
        sys.executable,
        "-m",
        "sglang_pd.deploy.cli",
        "eval",
        "gsm8k",
        "--base-url",
        f"{ROUTER}/v1",
        "--data",
        str(data),
        "--num-questions",
        "20",
        "--max-tokens",
        "64",
        "--output",
        str(report),
        "--quiet",
    ]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    result: dict[str, Any] = {
        "argv": argv[1:],
        "exit_code": p.returncode,
        "stdout_tail": p.stdout[-1500:],
        "stderr_tail": p.stderr[-1500:],
    }
    if report.exists():
        data_ = json.loads(report.read_text())
        result["report_keys"] = sorted(data_)
        result["accuracy"] = data_.get("accuracy")
        result["status"] = data_.get("status")
    return result


def gpu_description() -> str | None:
    """The GPUs' name, driver and memory as nvidia-smi gives them (None where it cannot run)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gsm8k-data", type=Path, default=None)
    parser.add_argument("--stages", default="single,pd,doctor")
    parser.add_argument("--commit", default="unknown", help="the commit of the checkout being checked")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="stop every stage after this long")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    date = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    report: dict[str, Any] = {"date": date, "commit": args.commit, "argv": sys.argv}
    report["gpu"] = gpu_description()
    import sglang

    recording: dict[str, Any] = {
        "sglang": sglang.__version__,
        "source": "recorded from live servers by scripts/gpu/gpu_pd_check.py (scripts/gpu/record_sglang_http.py)",
        "gpu": report.get("gpu"),
        "date": date,
        "commit": args.commit,
        "servers": {},
    }

    def out_of_time(*_: object) -> None:
        raise TimeoutError(f"the check's deadline of {args.deadline_s:g} s passed")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.deadline_s))
    stack = Stack(args.out)
    ref = None
    try:
        for stage in stages:
            t0 = time.monotonic()
            try:
                if stage == "single":
                    ref = stage_single(stack, report, recording)
                elif stage == "pd":
                    stage_pd(stack, report, ref, args.gsm8k_data, recording)
                elif stage == "doctor":
                    p = subprocess.run(
                        [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor"],
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                    report["doctor"] = {"exit_code": p.returncode, "output": p.stdout + p.stderr}
            except Exception:
                report.setdefault("errors", {})[stage] = traceback.format_exc()
            finally:
                report.setdefault("stage_seconds", {})[stage] = round(time.monotonic() - t0, 1)
                # What the stage measured is on disk before its processes stop: stopping a PD stack
                # can take its drain time, and a call's limit may end this run meanwhile.
                (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
                stack.stop_all()
            (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
            if recording["servers"]:
                name = f"sglang-{recording['sglang']}-http.json"
                (args.out / name).write_text(json.dumps(recording, indent=2, default=str))
    finally:
        signal.alarm(0)
        stack.stop_all()
    print(json.dumps(report, indent=2, default=str)[-6000:])
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
