"""Real sglang on one GPU: PD through our router, checked token for token against one plain server.

Runs on a CUDA machine where sglang, its kernel package and Mooncake's CUDA build import (see
`scripts/gpu_bundle.py` for a machine without internet). In order:

1. `single`: one plain (non-PD) sglang server; greedy outputs of the prompts, plain and streamed,
   `/generate` and chat; TTFT/ITL at concurrency 1, 8 and 32.
2. `pd`: `sglang-pd up single-h200` (prefill + decode sglang on GPU 0, KV over Mooncake TCP, our
   router); the same prompts must give the same tokens; the official `openai` client; usage
   counts; client disconnects abort both servers; 200 aborted requests leave KV usage at idle;
   `sglang-pd eval gsm8k` end to end; TTFT/ITL; the decode server killed mid-stream.
3. `doctor`: `sglang-pd doctor` on this machine.

Writes `report.json` (every check with its numbers) and the servers' logs under --out.

    python scripts/gpu_pd_check.py --out $OUT --gsm8k-data .gpu_bundle/gsm8k-test.jsonl
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

from sglang_pd.deploy.procs import Child, spawn

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY = "single-h200"
SINGLE_PORT = 31000
ROUTER = "http://127.0.0.1:8000"
MAX_NEW_TOKENS = 32
CONCURRENCIES = (1, 8, 32)


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
    """The checked processes (`deploy/procs.py` children), each logging to `<out>/<name>.log`."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.children: dict[str, Child] = {}

    def start(self, name: str, argv: list[str]) -> Child:
        with open(self.out / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            child = spawn(name, argv, stdout=log, stderr=subprocess.STDOUT, text=False)
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
    return {
        "generate_ids": [g.get("output_ids") for g in gen],
        "generate_text": [g.get("text") for g in gen],
        "generate_stream_text": [g.get("text") for g in gen_s],
        "chat_text": [c["text"] for c in ch],
        "chat_stream_text": [c["text"] for c in ch_s],
        "statuses": sorted({g["status"] for g in [*gen, *gen_s, *ch, *ch_s]}),
    }


async def latency(base: str, concurrency: int, *, prompt_len: int = 512, max_tokens: int = 64) -> dict[str, float]:
    """Streamed completions in a closed loop: TTFT (includes the KV hand-off in PD) and ITL, in ms."""
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
            async with s.post(f"{base}/v1/completions", json=body) as r:
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
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
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
    await asyncio.wait_for(started.wait(), 60)
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


def stage_single(stack: Stack, report: dict[str, Any]) -> dict[str, list[Any]]:
    argv = single_server_argv(rendered_commands())
    report["single"] = {"argv": argv}
    t0 = time.monotonic()
    base = f"http://127.0.0.1:{SINGLE_PORT}"
    stack.start("single", argv).wait_http(f"{base}/health", 600, interval_s=1.0)
    report["single"]["ready_s"] = time.monotonic() - t0
    ref = asyncio.run(outputs(base))
    report["single"]["latency"] = [asyncio.run(latency(base, c)) for c in CONCURRENCIES]
    stack.stop("single")
    return ref


def stage_pd(stack: Stack, report: dict[str, Any], ref: dict[str, list[Any]] | None, gsm8k: Path | None) -> None:
    pd: dict[str, Any] = {}
    report["pd"] = pd
    t0 = time.monotonic()
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
    stack.start("up", up).wait_http(f"{ROUTER}/readiness", 900, interval_s=1.0)
    pd["ready_s"] = time.monotonic() - t0

    got = asyncio.run(outputs(ROUTER))
    pd["statuses"] = got["statuses"]
    if ref is not None:
        for key in ("generate_ids", "generate_text", "generate_stream_text", "chat_text", "chat_stream_text"):
            same = [a == b for a, b in zip(ref[key], got[key], strict=True)]
            pd[f"identical_{key}"] = f"{sum(same)}/{len(same)}"
        pd["first_mismatch"] = next(
            (
                {"prompt": i, "single": ref["generate_ids"][i], "pd": got["generate_ids"][i]}
                for i in range(len(got["generate_ids"]))
                if ref["generate_ids"][i] != got["generate_ids"][i]
            ),
            None,
        )
    pd["openai"] = check_openai_client()
    pd["latency"] = [asyncio.run(latency(ROUTER, c)) for c in CONCURRENCIES]

    servers = {"prefill": "http://127.0.0.1:30000", "decode": "http://127.0.0.1:30001"}
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gsm8k-data", type=Path, default=None)
    parser.add_argument("--stages", default="single,pd,doctor")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv}
    with contextlib.suppress(Exception):
        report["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    stack = Stack(args.out)
    ref = None
    try:
        for stage in stages:
            try:
                if stage == "single":
                    ref = stage_single(stack, report)
                elif stage == "pd":
                    stage_pd(stack, report, ref, args.gsm8k_data)
                elif stage == "doctor":
                    p = subprocess.run(
                        [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor"], capture_output=True, text=True
                    )
                    report["doctor"] = {"exit_code": p.returncode, "output": p.stdout + p.stderr}
            except Exception:
                report.setdefault("errors", {})[stage] = traceback.format_exc()
            finally:
                stack.stop_all()
            (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    finally:
        stack.stop_all()
    print(json.dumps(report, indent=2, default=str)[-6000:])
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
