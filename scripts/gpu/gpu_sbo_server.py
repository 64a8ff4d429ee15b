"""SBO inside real sglang on one GPU: a decode server with and without full SBO, then the `single-h200-sbo` PD stack.

Runs on the GPU machine after `scripts/gpu/gpu_sbo_server.sh` has unpacked sglang 0.5.17, built
DeepEP antgroup-opt and written unit-scale FP8 weights into the preset's model folder
(`fp8_checkpoint.py`). Stages, in order (`--stages`):

1. `sbo`: one sglang server with the `single-h200-sbo` decode flags minus PD: `--tp 1
   --moe-a2a-backend deepep --deepep-mode low_latency --moe-runner-backend deep_gemm
   --enable-single-batch-overlap`, our plugin in mode full. Greedy outputs of the prompts with
   their logprobs, in each of REQUEST_FORMS; decode step times at batch 1-64 (CUDA graphs on): the
   GPU time of each decode forward (CUDA events around sglang's forward, `faults/step_timer.py`),
   beside the gaps between streamed tokens and the server's own decode lines; what SBO ran inside it
   (our kernel's calls and DeepEP's signalled combines, read from its log by `sglang-pd doctor
   --server-log ... --expect full`).
2. `nosbo`: the same server without `--enable-single-batch-overlap` (plugin mode off): the same
   outputs and step times. The report compares them: identical sequences, the first divergence,
   the largest logprob difference over the agreeing positions, the step-time ratio per batch.
3. `pd`: `sglang-pd up` of the preset (the prefill runs the decode's MoE kernels without SBO, the
   decode is as in `sbo`, KV over Mooncake TCP, our router): the same prompts through the router
   must give the SBO server's tokens, form by form; the decode server's log must show SBO engaged.
   All at once is no test of identity: which prompts share a batch depends on arrival, and at
   hidden 7168 these kernels are not batch-invariant (the server disagreed with itself across
   calls, benchmarks/results/sbo_server_h200_2026-12-03_13eeedc.json).

Stages are measured in the order given; `sbo` may run twice (`sbo,nosbo,sbo`, reported as `sbo`,
`nosbo`, `sbo_again`), so that one call's step-time A/B has the SBO server on both sides and shows
its own drift. The verdict `sbo_step_time` holds the mean of the two SBO servers' GPU step times to
within STEP_TIME_TOLERANCE of the server without SBO at every batch size. With `--together` the
stages' processes start at once, every one is waited for, and only then are they measured one after
another; each stops once measured, so with `--stages pd,sbo` the SBO server's step times are taken
with the GPU to itself. `sbo` and `nosbo` do not start together: each DeepEP low-latency server's
CUDA graphs took 42.5 GB on this preset, and sglang sizes a server's KV pool from the memory free
before it loads, so with three starting at once the last one's pool came out negative
(benchmarks/results/sbo_server_h200_2026-12-03_5fb0e4d.json).
A stage measured in a later call compares with the SBO server's outputs kept in `--ref`.

`--gemm-fault` adds the must-fail control (`faults/sbo_check_gemm_fault.py`): the `sbo` server
starts armed, and after its outputs it answers the prompts three more times, one at a time, each
from an empty radix cache: fault off, then with experts 0-3 dropped from SBO's down GEMM (which must
differ from the pass before on some prompt), then fault off again (which must equal the first).
Step times are not taken in such a run: the armed server runs one more multiply per MoE layer. The
verdicts (`verdicts` in the report; exit 1 when one fails): the SBO server equals the server without
SBO one request at a time, and the control is caught.

One GPU has no network for the overlap to hide, so the step-time ratio is SBO's overhead here,
not its gain. Writes `report.json` and each server's log under --out.

    python scripts/gpu/gpu_sbo_server.py --out $OUT --commit SHA [--stages pd,sbo --together]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
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
import gpu_pd_check
import pd_verdicts
import yaml
from gpu_pd_check import ROUTER, Stack, wait_server, wait_stack

REPO = Path(__file__).resolve().parents[2]
FAULTS_DIR = REPO / "scripts/gpu/faults"
# The step timer's switch and file format (it runs inside the servers, armed from that folder).
sys.path.insert(0, str(FAULTS_DIR))
step_timer = importlib.import_module("step_timer")
#: sbo_check_gemm_fault.py's switches (that module imports torch, so they are repeated here).
GEMM_FAULT_FLAG_ENV, GEMM_FAULT_LOG_ENV = "SBO_CHECK_GEMM_FAULT_FLAG", "SBO_CHECK_GEMM_FAULT_LOG"
#: Longer than the fault's watcher takes to see its flag file appear or go (POLL_S, 0.05 s).
GEMM_FAULT_SETTLE_S = 1.0
PRESET = REPO / "deploy/spec/presets/single-h200-sbo.yaml"
#: Each server's HTTP port. sglang 0.5.17 draws its NCCL port from [port + 100, port + 1000] and
#: takes it if nothing listens there yet, and a server binds its HTTP port only once loaded: servers
#: started together keep every HTTP port out of the others' ranges (the preset's are 30000-30001).
SERVER_PORTS = {"sbo": 31500, "nosbo": 33000}
AGAIN = "_again"  # the report's name for the second run of a stage: sbo, nosbo, sbo_again
#: The servers' share of GPU memory, the same for `sbo` and `nosbo` so that their step times compare,
#: and small enough to start beside the PD stack's two (0.3 each): 0.15 (12 GiB on an H100) holds
#: the 6.3 GB model (8 layers) and a 5 GB KV pool.
SERVER_MEM_FRACTION = 0.15
READY_S = 420.0
MAX_NEW_TOKENS = 32
#: Decode steps per request at each batch size: sglang logs a decode line every 40 steps
#: (--decode-log-interval), so 168 give about four lines a batch beside the 8-step ramp.
STEP_TOKENS = 168
DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*?gen throughput \(token/s\): ([\d.]+)")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: SBO's GPU step time may exceed the server's without it by this share at most (one GPU has no
#: network send for the overlap to hide, so what is left is its overhead).
STEP_TIME_TOLERANCE = 0.03
#: Longer than the step timer's reader takes to write a completed forward (step_timer.POLL_S, 0.05 s).
STEP_LOG_SETTLE_S = 0.5
TOP_LOGPROBS = 1


def prompts() -> list[str]:
    """The PD check's prompts that fit the decode's 128-token prefill chunk (a byte a token)."""
    return [p for p in gpu_pd_check.prompts() if len(p.encode()) < 128]


def derived_topology(out: Path) -> Path:
    """The preset with the written weights: `--load-format dummy` dropped, paths absolute."""
    t = yaml.safe_load(PRESET.read_text())
    model_dir = (PRESET.parent / t["model"]["path"]).resolve()
    t["model"]["path"] = str(model_dir)
    t["model"]["config_json"] = str(model_dir / "config.json")
    for role in ("prefill", "decode"):
        args = t[role]["extra_args"]
        i = args.index("--load-format")
        del args[i : i + 2]
    path = out / "single-h200-sbo.yaml"
    path.write_text(yaml.safe_dump(t, sort_keys=False))
    return path


def server_command(topology: Path, sbo: bool, port: int) -> tuple[list[str], dict[str, str]]:
    """The preset's decode command without its PD flags (and without SBO when `sbo` is false), and its env."""
    plan = json.loads(
        subprocess.run(
            [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", str(topology), "--format", "json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    decode = plan["roles"]["decode"][0]
    drop_with_value = {
        "--disaggregation-mode", "--disaggregation-transfer-backend", "--port", "--host", "--mem-fraction-static",
    }  # fmt: skip
    argv, skip = [], False
    for a in decode["argv"]:
        if skip:
            skip = False
        elif a in drop_with_value:
            skip = True
        elif not (a == "--enable-single-batch-overlap" and not sbo):
            argv.append(a)
    env = {k: str(v) for k, v in decode.get("env", {}).items()}
    env["SGLANG_PD_SBO_MODE"] = "full" if sbo else "off"
    argv += ["--host", "127.0.0.1", "--port", str(port), "--mem-fraction-static", str(SERVER_MEM_FRACTION)]
    return [sys.executable, *argv], env


#: sglang refuses `/flush_cache` (400) while a request still runs: how often, and how far apart, to ask.
FLUSH_TRIES, FLUSH_RETRY_S = 20, 0.25


async def flush_cache(s: aiohttp.ClientSession, base: str) -> None:
    """Empty the server's radix cache, so that the next request prefills its whole prompt itself."""
    status, body = 0, ""
    for _ in range(FLUSH_TRIES):
        async with s.post(f"{base}/flush_cache") as r:
            status, body = r.status, (await r.text())[:200]
        if status == 200:
            return
        await asyncio.sleep(FLUSH_RETRY_S)
    raise RuntimeError(f"POST {base}/flush_cache answered {status} {FLUSH_TRIES} times: {body}")


async def greedy(base: str, texts: list[str], together: bool = False, flush: bool = False) -> list[dict[str, Any]]:
    """Greedy outputs with logprobs, one request at a time (each its own batch), or all at once;
    with ``flush``, one at a time, each from an empty radix cache."""

    async def one(s: aiohttp.ClientSession, text: str) -> dict[str, Any]:
        body = {
            "text": text,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": TOP_LOGPROBS,
        }
        async with s.post(f"{base}/generate", json=body) as r:
            doc = await r.json()
            if r.status != 200:
                return {"status": r.status, "error": doc}
            meta = doc["meta_info"]
            return {
                "status": 200,
                "ids": doc.get("output_ids") or [t[1] for t in meta["output_token_logprobs"]],
                "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            }

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        if together:
            return list(await asyncio.gather(*(one(s, t) for t in texts)))
        got = []
        for t in texts:
            if flush:
                await flush_cache(s, base)
            got.append(await one(s, t))
        return got


#: How the prompts are sent, each form in turn: one request at a time (each its own batch), the same
#: again (the prompts longer than a KV page then start from sglang's radix cache), all at once.
REQUEST_FORMS = {"outputs": "one at a time", "outputs_again": "one at a time, again", "outputs_together": "all at once"}


def request_forms(base: str, texts: list[str]) -> tuple[dict[str, Any], dict[str, tuple[float, float]]]:
    """The prompts' greedy outputs in each of REQUEST_FORMS, and when each form ran (epoch seconds)."""
    outputs, windows = {}, {}
    for form in REQUEST_FORMS:
        t0 = time.time()
        outputs[form] = asyncio.run(greedy(base, texts, together=form == "outputs_together"))
        windows[form] = (t0, time.time())
    return outputs, windows


#: sglang's access-log line of a passed `GET /health`, stamped to the second in local time (a 503
#: while starting or stopping generates nothing).
HEALTH_ANSWER = re.compile(r'^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] INFO: .*"GET /health HTTP/1\.1" 200', re.MULTILINE)


def health_probes_during(log_text: str, windows: dict[str, tuple[float, float]]) -> dict[str, int]:
    """Per request form, the `GET /health` probes an engine passed while the form ran. Each is a
    one-token generation that may share a batch with the form's requests; sglang submits it at once
    and answers at its first check a second later (`health_generate` in
    srt/entrypoints/http_server.py), so answers up to two seconds past the form's end count (the
    log's stamps are whole seconds)."""
    answered = [time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) for stamp in HEALTH_ANSWER.findall(log_text)]
    return {form: sum(int(t0) <= t <= t1 + 2 for t in answered) for form, (t0, t1) in windows.items()}


def server_step_ms(log_text: str, batch: int) -> list[float]:
    """Step times (ms) from sglang's own decode lines with `batch` requests running: each line's
    throughput covers the steps since the line before, so one step took batch / throughput."""
    return [
        round(1e3 * batch / float(tput), 3)
        for running, tput in DECODE_LINE.findall(log_text)
        if int(running) == batch and float(tput) > 0
    ]


def gpu_step_ms(rows: list[tuple[int, bool, float]], batch: int) -> tuple[int | None, list[float]]:
    """The step timer's GPU times (ms) of the CUDA-graph decode forwards at the largest batch up to
    `batch` in a window where `batch` requests were sent, and that batch size. The server may hold
    fewer than asked: sglang 0.5.17 with --max-running-requests 64 decoded 63 at once, the 64th waiting."""
    sizes = [b for b, graph, _ in rows if graph and b <= batch]
    if not sizes:
        return None, []
    top = max(sizes)
    return top, [ms for b, graph, ms in rows if b == top and graph]


async def step_times(base: str, log: Path, steps: Path) -> list[dict[str, Any]]:
    """Per batch size while all requests decode together: the median GPU time of a decode forward
    (`steps`, the step timer's file), the median gap between streamed tokens (the client's view), and
    the median step time from the decode lines the server logged meanwhile (`log`, the server's)."""

    async def one(s: aiohttp.ClientSession, i: int) -> list[float]:
        body = {
            "text": f"request {i}: count on",
            "sampling_params": {"temperature": 0, "max_new_tokens": STEP_TOKENS, "ignore_eos": True},
            "stream": True,
        }
        arrivals = []
        async with s.post(f"{base}/generate", json=body) as r:
            async for raw in r.content:
                if raw.startswith(b"data:") and b"[DONE]" not in raw:
                    arrivals.append(time.perf_counter())
        return arrivals

    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await one(s, -1)  # the first request after start compiles what is left
        await asyncio.sleep(STEP_LOG_SETTLE_S)
        _, steps_seen = step_timer.read(str(steps))
        for batch in BATCHES:
            seen = log.stat().st_size
            runs = await asyncio.gather(*(one(s, i) for i in range(batch)))
            with log.open(errors="replace") as f:
                f.seek(seen)
                server = server_step_ms(f.read(), batch)
            await asyncio.sleep(STEP_LOG_SETTLE_S)
            timed, steps_seen = step_timer.read(str(steps), steps_seen)
            gpu_batch, gpu = gpu_step_ms(timed, batch)
            # Skip the first 8 gaps: requests are still being prefilled and joining the batch.
            gaps = [b - a for arr in runs for a, b in itertools.pairwise(arr[8:])]
            rows.append(
                {
                    "batch": batch,
                    "gpu_batch": gpu_batch,
                    "gpu_step_ms_p50": round(statistics.median(gpu), 4) if gpu else None,
                    "gpu_step_ms_p10_p90": [round(q, 4) for q in statistics.quantiles(gpu, n=10)[::8]]
                    if len(gpu) > 10
                    else None,
                    "gpu_steps": len(gpu),
                    "step_ms_p50": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
                    "step_ms_p90": round(statistics.quantiles(gaps, n=10)[-1] * 1e3, 3) if len(gaps) > 10 else None,
                    "gaps": len(gaps),
                    "server_step_ms_p50": round(statistics.median(server), 3) if server else None,
                    "server_lines": len(server),
                }
            )
    return rows


def doctor(log: Path, expect_full: bool, probe_hooks: bool = False) -> dict[str, Any]:
    """`sglang-pd doctor --server-log` on a server's log; `probe_hooks` also checks each hook's effect (slower)."""
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "doctor", "--server-log", str(log), "--format", "json"]
    argv += ["--expect", "full"] if expect_full else []
    argv += [] if probe_hooks else ["--skip-targets"]
    p = subprocess.run(argv, capture_output=True, text=True)
    doc: dict[str, Any] = {"exit_code": p.returncode, "stderr": p.stderr[-2000:]}
    with contextlib.suppress(ValueError):
        full = json.loads(p.stdout)
        doc.update({k: full.get(k) for k in ("server_engagement", "deepep_combine", "hook_targets", "sbo")})
    return doc


def server_kind(name: str) -> str:
    """`sbo` or `nosbo`: what a server stage runs (`sbo_again` is a second `sbo` in one run)."""
    return name.removesuffix(AGAIN)


def probe_env(out: Path, name: str, gemm_fault: bool) -> dict[str, str]:
    """What stage `name`'s server gets on top of its own env: the faults folder first on its
    PYTHONPATH and the step timer's file; armed (`gemm_fault`), also the flag file that switches the
    fault on (absent) and the fault's log."""
    inherited = os.environ.get("PYTHONPATH")
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULTS_DIR), *([inherited] if inherited else [])]),
        step_timer.LOG_ENV: str(out / f"{name}.steps"),
    }
    if gemm_fault:
        env.update({GEMM_FAULT_FLAG_ENV: str(out / "gemm-fault.on"), GEMM_FAULT_LOG_ENV: str(out / "gemm-fault.log")})
    return env


def start_server(stack: Stack, topology: Path, name: str, gemm_fault: bool = False) -> dict[str, Any]:
    """Start stage `name`'s server with the step timer; with `gemm_fault` an `sbo` server starts armed."""
    kind = server_kind(name)
    argv, env = server_command(topology, kind == "sbo", SERVER_PORTS[kind])
    armed = gemm_fault and kind == "sbo"
    env.update(probe_env(stack.out, name, armed))
    if armed:
        Path(env[GEMM_FAULT_FLAG_ENV]).unlink(missing_ok=True)
    stack.start(name, argv, env=env)
    return {"argv": argv[1:], "env": env, "started": time.monotonic()}


def await_server(stack: Stack, name: str, result: dict[str, Any]) -> None:
    """Wait until `name` (started by start_server) is ready, noting in `result` how long it took."""
    if "not_ready" in result:
        raise RuntimeError(result["not_ready"])
    if "started" in result:
        result.update(wait_server(stack, name, f"http://127.0.0.1:{SERVER_PORTS[server_kind(name)]}", READY_S))
        result["ready_since_start_s"] = round(time.monotonic() - result.pop("started"), 1)


def gemm_fault_outputs(base: str, texts: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The armed server's outputs one at a time with its fault off, on, then off again, every request
    from an empty radix cache, and the fault's log. The flushes matter: a plain server caches what it
    decoded, so a pass after the faulty one would read the faulty pass's KV pages for the prompt's last
    partial page and differ from the clean pass for that reason alone."""
    flag = Path(env[GEMM_FAULT_FLAG_ENV])
    before = asyncio.run(greedy(base, texts, flush=True))
    flag.touch()
    try:
        time.sleep(GEMM_FAULT_SETTLE_S)
        with_fault = asyncio.run(greedy(base, texts, flush=True))
    finally:
        flag.unlink()
    time.sleep(GEMM_FAULT_SETTLE_S)
    after = asyncio.run(greedy(base, texts, flush=True))
    events = pd_verdicts.read_fault_log(Path(env[GEMM_FAULT_LOG_ENV]))
    return {"before_fault": before, "with_fault": with_fault, "after_fault": after, "events": events}


def measure_server(stack: Stack, name: str, result: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """Once `name` is ready: its outputs, step times (not beside an armed fault) and engagement
    (main stops it, once the report is written)."""
    base = f"http://127.0.0.1:{SERVER_PORTS[server_kind(name)]}"
    await_server(stack, name, result)
    outputs, result["form_windows"] = request_forms(base, texts)
    result.update(outputs)
    armed = GEMM_FAULT_FLAG_ENV in result.get("env", {})
    if armed:
        result["gemm_fault"] = gemm_fault_outputs(base, texts, result["env"])
    if armed or result.get("skip_step_times"):
        result["step_times"] = "not measured in a --gemm-fault run (its SBO server runs a multiply more per MoE layer)"
    else:
        steps = Path(result["env"][step_timer.LOG_ENV])
        result["step_times"] = asyncio.run(step_times(base, stack.out / f"{name}.log", steps))
    sbo = server_kind(name) == "sbo"
    result["doctor"] = doctor(stack.out / f"{name}.log", expect_full=sbo, probe_hooks=sbo)
    return result


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy agreement of two runs of the same prompts, and the largest logprob gap where they agree.
    Outputs agree when their ids are equal; one that stops early diverges where it stops."""
    same, max_gap = 0, 0.0
    first_divergence: list[int | str | None] = []
    for x, y in zip(a, b, strict=True):
        if x.get("status") != 200 or y.get("status") != 200:
            first_divergence.append("error")
            continue
        n = next((i for i, (p, q) in enumerate(zip(x["ids"], y["ids"], strict=False)) if p != q), None)
        if n is None and len(x["ids"]) != len(y["ids"]):
            n = min(len(x["ids"]), len(y["ids"]))  # a shorter output ends where the other goes on: a mismatch
        same += n is None
        first_divergence.append(n)
        agree = len(x["ids"]) if n is None else n
        for p, q in zip(x["logprobs"][:agree], y["logprobs"][:agree], strict=True):
            max_gap = max(max_gap, abs(p - q))
    return {
        "identical": f"{same}/{len(a)}",
        "first_divergence_per_prompt": first_divergence,
        "max_abs_logprob_diff_where_tokens_agree": max_gap,
    }


def all_identical(got: dict[str, Any]) -> bool:
    n = len(got["first_divergence_per_prompt"])
    return bool(n) and got["identical"] == f"{n}/{n}"


def gemm_fault_verdict(sbo: dict[str, Any]) -> dict[str, Any]:
    """Whether the armed SBO server's control was caught: with the fault on, its outputs differ on some
    prompt from its own with the fault off just before; with the fault off again they equal those; and
    the fault's log shows the GEMM passing the gate and the switch going on and off. All three passes
    run on the same server from an empty cache, so only the fault differs between them."""
    fault = sbo["gemm_fault"]
    kinds = [e.get("event") for e in fault["events"]]
    out: dict[str, Any] = {
        "with_fault_vs_before": compare(fault["with_fault"], fault["before_fault"]),
        "after_fault_vs_before": compare(fault["after_fault"], fault["before_fault"]),
        "events": kinds,
    }
    if "gated" not in kinds:
        failure = "the SBO down GEMM never passed the fault's gate (no 'gated' event): our kernel did not run"
    elif "on" not in kinds or "off" not in kinds:
        failure = f"the fault did not switch on and then off (events: {', '.join(map(str, kinds))})"
    elif all_identical(out["with_fault_vs_before"]):
        failure = (
            "control not caught: with experts dropped from SBO's down GEMM the SBO server still gave its "
            "fault-free outputs on every prompt, so this comparison cannot see a wrong expert output"
        )
    elif not all_identical(out["after_fault_vs_before"]):
        failure = (
            "with the fault off again the SBO server did not return to its own outputs "
            f"({out['after_fault_vs_before']['identical']}): the switch is not clean"
        )
    else:
        failure = None
    out["verdict"] = failure or "passed"
    return out


def start_pd(stack: Stack, topology: Path) -> dict[str, Any]:
    logs = stack.out / "engines"
    up = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(topology), "--engine", "sglang"]
    up += ["--log-dir", str(logs)]
    stack.start("up", up)
    return {"argv": up[1:], "started": time.monotonic()}


def await_pd(stack: Stack, pd: dict[str, Any]) -> None:
    """Wait until the stack (started by start_pd) is ready, noting in `pd` how long it took."""
    if "not_ready" in pd:
        raise RuntimeError(pd["not_ready"])
    if "started" in pd:
        pd.update(wait_stack(stack, READY_S))
        pd["ready_since_start_s"] = round(time.monotonic() - pd.pop("started"), 1)


def measure_pd(stack: Stack, pd: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """Once the stack is ready: the prompts' outputs through the router, and the decode server's
    engagement (main stops it, once the report is written)."""
    await_pd(stack, pd)
    outputs, pd["form_windows"] = request_forms(ROUTER, texts)
    pd.update(outputs)
    pd["statuses"] = [g.get("status") for g in pd["outputs"]]
    # The router's generation probes of its workers (deploy/router/workers/health.py) share their
    # batches: a form that one reached does not show the stack's own tokens.
    engine_logs = sorted((stack.out / "engines").glob("*.log"))
    pd["health_probes_during_forms"] = {
        log.stem: health_probes_during(log.read_text(errors="replace"), pd["form_windows"]) for log in engine_logs
    }
    decode_logs = [log for log in engine_logs if log.name.startswith("decode")]
    pd["doctor"] = doctor(decode_logs[0], expect_full=True) if decode_logs else "no decode log"
    return pd


def _over(x: dict[str, Any], y: dict[str, Any], key: str) -> float | None:
    return round(x[key] / y[key], 4) if x.get(key) and y.get(key) else None


def step_time_ratio(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch, a's step time over b's: on the GPU, as the client saw it, and from the servers' decode lines."""
    return [
        {
            "batch": x["batch"],
            "gpu_ratio": _over(x, y, "gpu_step_ms_p50"),
            "ratio": _over(x, y, "step_ms_p50"),
            "server_ratio": _over(x, y, "server_step_ms_p50"),
        }
        for x, y in zip(a, b, strict=True)
    ]


def step_time_verdict(
    sbo: list[dict[str, Any]], nosbo: list[dict[str, Any]], again: list[dict[str, Any]]
) -> dict[str, Any]:
    """SBO on, off, on in one call: per batch, the mean of the two SBO servers' GPU step times over the
    server's without SBO, and the second SBO server's over the first (the drift the A/B sits in)."""
    rows = []
    for x, y, z in zip(sbo, nosbo, again, strict=True):
        on = [r["gpu_step_ms_p50"] for r in (x, z) if r.get("gpu_step_ms_p50")]
        off = y.get("gpu_step_ms_p50")
        rows.append(
            {
                "batch": x["batch"],
                "sbo_ms": round(statistics.mean(on), 4) if len(on) == 2 else None,
                "nosbo_ms": off,
                "sbo_over_nosbo": round(statistics.mean(on) / off, 4) if len(on) == 2 and off else None,
                "sbo_again_over_sbo": _over(z, x, "gpu_step_ms_p50"),
            }
        )
    missing = [r["batch"] for r in rows if r["sbo_over_nosbo"] is None]
    slow = [
        f"{r['sbo_over_nosbo']:.3f} at batch {r['batch']}"
        for r in rows
        if (r["sbo_over_nosbo"] or 0) > 1 + STEP_TIME_TOLERANCE
    ]
    if not rows or missing:
        verdict = f"no GPU step time at batch {', '.join(map(str, missing))} on every server: nothing to judge there"
    elif slow:
        over = f"more than {STEP_TIME_TOLERANCE:.0%}"
        verdict = f"SBO's GPU step time exceeds the server's without it by {over}: {'; '.join(slow)}"
    else:
        verdict = "passed"
    return {"per_batch": rows, "tolerance": STEP_TIME_TOLERANCE, "verdict": verdict}


def stop_stage(stack: Stack, stage: str) -> None:
    """Stop a stage's processes (a no-op once stopped): `up` drains on SIGINT, a server stops on SIGTERM."""
    if stage == "pd":
        stack.stop("up", signal.SIGINT, grace_s=60)
    else:
        stack.stop(stage, grace_s=30)


def sbo_result(report: dict[str, Any], ref: Path) -> dict[str, Any] | None:
    """The SBO server's stage result: from this run, else from the file an earlier call's `sbo` stage wrote."""
    if "outputs" in report.get("sbo", {}):
        return dict(report["sbo"])
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(ref.read_text()))
    return None


def add_comparisons(report: dict[str, Any], ref: Path) -> None:
    """Into `report`, every comparison that the stages measured so far allow."""
    sbo = sbo_result(report, ref)
    if sbo is None:
        return
    pd, nosbo = report.get("pd", {}), report.get("nosbo", {})
    if "outputs" in pd:
        report["pd_vs_sbo_server"] = {
            how: compare(sbo[form], pd[form]) for form, how in REQUEST_FORMS.items() if form in sbo and form in pd
        }
    if "outputs" in nosbo:
        report["sbo_vs_nosbo"] = compare(sbo["outputs"], nosbo["outputs"])
        verdicts = report.setdefault("verdicts", {})
        verdicts["sbo_vs_nosbo_one_at_a_time"] = (
            "passed"
            if all_identical(report["sbo_vs_nosbo"])
            else f"the SBO server differs from the server without SBO one request at a time "
            f"({report['sbo_vs_nosbo']['identical']} identical)"
        )
        if "gemm_fault" in sbo:
            report["gemm_fault_control"] = gemm_fault_verdict(sbo)
            verdicts["gemm_fault_control"] = report["gemm_fault_control"]["verdict"]
    if isinstance(nosbo.get("step_times"), list) and isinstance(sbo.get("step_times"), list):
        report["step_time_ratio_sbo_over_nosbo"] = step_time_ratio(sbo["step_times"], nosbo["step_times"])
    again = report.get("sbo" + AGAIN, {}).get("step_times")
    for other in ("nosbo", "sbo"):
        if isinstance(again, list) and isinstance(report.get(other, {}).get("step_times"), list):
            report[f"step_time_ratio_sbo{AGAIN}_over_{other}"] = step_time_ratio(again, report[other]["step_times"])
    if (
        isinstance(again, list)
        and isinstance(nosbo.get("step_times"), list)
        and isinstance(sbo.get("step_times"), list)
    ):
        report["sbo_step_time"] = step_time_verdict(sbo["step_times"], nosbo["step_times"], again)
        report.setdefault("verdicts", {})["sbo_step_time"] = report["sbo_step_time"]["verdict"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default="sbo,nosbo,pd")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--deadline-s", type=float, default=560.0)
    parser.add_argument(
        "--together", action="store_true", help="start every stage's processes at once, then measure them in turn"
    )
    parser.add_argument(
        "--gemm-fault",
        action="store_true",
        help="start the sbo server armed with the must-fail control (faults/sbo_check_gemm_fault.py); no step times",
    )
    parser.add_argument(
        "--ref",
        type=Path,
        default=Path("/tmp/sbo-server-outputs.json"),
        help="the SBO server's outputs: written by stage sbo, read by nosbo and pd when run in a later call",
    )
    args = parser.parse_args()
    kinds = args.stages.split(",")
    unknown = [s for s in kinds if s not in ("sbo", "nosbo", "pd")]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}: use sbo, nosbo, pd")
    if args.together and {"sbo", "nosbo"} <= set(kinds):
        parser.error("--together: sbo and nosbo do not fit one GPU at once (CUDA graphs); run nosbo in its own call")
    repeated = sorted({s for s in kinds if kinds.count(s) > 1})
    if repeated and (args.together or repeated != ["sbo"] or kinds.count("sbo") > 2):
        parser.error(
            f"--stages repeats {', '.join(repeated)}: only sbo may run twice (sbo,nosbo,sbo, for a step-time A/B "
            "with the SBO server on both sides of the other), and not with --together"
        )
    stages = [s + AGAIN if s == "sbo" and kinds[:i].count("sbo") else s for i, s in enumerate(kinds)]
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": args.commit,
        "argv": sys.argv,
    }
    report["gpu"] = gpu_pd_check.gpu_description()
    import sglang

    report["sglang"] = sglang.__version__

    deadline_passed = False

    def out_of_time(*_: object) -> None:
        nonlocal deadline_passed
        deadline_passed = True
        raise TimeoutError(f"the run's deadline of {args.deadline_s:g} s passed")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(int(args.deadline_s))
    topology = derived_topology(args.out)
    texts = prompts()

    def start(stage: str) -> dict[str, Any]:
        if stage == "pd":
            return start_pd(stack, topology)
        begun = start_server(stack, topology, stage, gemm_fault=args.gemm_fault)
        begun["skip_step_times"] = args.gemm_fault
        return begun

    stack = Stack(args.out)
    try:
        started = {stage: start(stage) for stage in stages} if args.together else {}
        # Nothing is measured while a started server is still compiling or capturing its graphs.
        for stage, begun in started.items():
            try:
                if stage == "pd":
                    await_pd(stack, begun)
                else:
                    await_server(stack, stage, begun)
            except Exception as exc:  # the stage fails with this when it is measured
                begun.pop("started", None)
                begun["not_ready"] = f"{type(exc).__name__}: {exc}"
                stop_stage(stack, stage)  # its memory goes back to the stages still to be measured
        for stage in stages:
            t0 = time.monotonic()
            try:
                if deadline_passed:
                    raise TimeoutError(f"not measured: the run's deadline of {args.deadline_s:g} s had passed")
                begun = started.pop(stage) if stage in started else start(stage)
                if stage == "pd":
                    report["pd"] = measure_pd(stack, begun, texts)
                else:
                    report[stage] = measure_server(stack, stage, begun, texts)
                    if stage == "sbo":
                        args.ref.write_text(json.dumps(report["sbo"], default=str))
            except Exception:
                report.setdefault("errors", {})[stage] = traceback.format_exc()[-6000:]
            finally:
                report.setdefault("stage_seconds", {})[stage] = round(time.monotonic() - t0, 1)
                add_comparisons(report, args.ref)
                # What the stage measured is on disk before its processes stop: stopping a PD stack
                # can take its drain time, and a call's limit may end this run meanwhile.
                (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
                stop_stage(stack, stage)
    finally:
        signal.alarm(0)
        stack.stop_all()
    summary = {k: v for k, v in report.items() if k not in stages}
    for stage in stages:
        if stage in report:
            summary[stage] = {k: v for k, v in report[stage].items() if k not in (*REQUEST_FORMS, "argv", "env")}
    print(json.dumps(summary, indent=2, default=str)[-8000:])
    os.sync()
    failed = [v for v in report.get("verdicts", {}).values() if v != "passed"]
    return 1 if report.get("errors") or failed else 0


if __name__ == "__main__":
    sys.exit(main())
