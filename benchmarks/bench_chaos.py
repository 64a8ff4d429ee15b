#!/usr/bin/env python
"""Chaos suite: PD faults under closed-loop load on reference engines, with the figures each one gives.

Each fault runs on a fresh stack of real processes on loopback: 2 prefill and 2 decode reference
engines (tiny-deepseek-v3, fp32, Mooncake over TCP) behind the router at its defaults (migration
limit 1, 2 retries, 5 s stall watchdog). First every prompt is answered once with no load and no
fault: the uninterrupted run every later answer of that prompt is compared with, token by token.
Then C clients (default 16) send greedy streamed `/generate` requests back to back (16 prompts,
16 to 48 tokens); the fault comes after the warm-up;
the load goes on for a while, then ends, and the engines' and the router's state is read once
it settles.

Faults (`--faults`, default all):

    none               the control: the same load and measurement, no fault
    decode_kill        SIGKILL a decode; started again 3 s later on its port
    decode_stop        SIGSTOP a decode past the stall watchdog; SIGCONT 12 s later
    prefill_kill       SIGKILL a prefill while it has a KV transfer in flight; started again 3 s later
    kv_cut             drop every packet to the Mooncake port range for 8 s (iptables in a private
                       network namespace, `unshare -rn`); where that cannot run, the prefill's
                       Mooncake peer is killed instead (the result says which)
    router_restart     SIGKILL the router; started again 1 s later on its port
    engine_restart     SIGTERM a decode (its graceful stop) and start it again at once
    prefill_stale      SIGKILL a prefill and start it again at once on the same ports, while the
                       decodes keep the old prefill's peer state (Mooncake session, connections)

Per fault: completion rate (of the streams the router took; and of all requests, where those it
refused while it was away count as failures), answers identical to the uninterrupted run,
streams migrated and the latency they added (p50/p99 of their end-to-end time less the median of
the warm-up's), streams cut (began, could not go on) and their time to terminal error, hung
requests (not ended 60 s after the load stopped; must be 0), what the engines and the
router still hold afterwards (KV pages, bootstrap rooms, running requests, KV transfers; the
router's active requests and per-worker in-flight and admitted requests; must be 0), and the time
from the fault until the goodput (tokens/s of completed answers over 5 s windows) is back to 80 %
of the warm-up's second half and stays there until the load ends.

    .venv/bin/python -m benchmarks.bench_chaos --out benchmarks/results/chaos_cpu2_<date>.json

Prints a table and writes JSON with the command, machine, load and date. Exit status 1 when a
fault left a hung request or state behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.polling import free_port

__all__ = [
    "FAULTS",
    "Request",
    "goodput_recovery_s",
    "leftovers",
    "percentile",
    "summarize",
]

MODEL = "tiny-deepseek-v3"


def max_new(prompt: int) -> int:
    """Each prompt's answer length, 16 to 48 tokens: answers of one length end together, and a closed
    loop of them stays in lockstep (goodput in bursts)."""
    return 16 + (prompt * 13) % 33


PROMPTS = 16
HANG_S = 60.0
# Mooncake's ports: outside its default 15000-17000, which a KV fence of another stack on this
# host may hold; the kv_cut fault drops this range.
MC_PORTS = (23000, 25000)
ENGINE_ENV = {"MC_MIN_RPC_PORT": str(MC_PORTS[0]), "MC_MAX_RPC_PORT": str(MC_PORTS[1])}
# Engine and router gauges that must be 0 once nothing is in flight.
ENGINE_GAUGES = (
    "sglang_pd_refengine_kv_pages_used",
    "sglang_pd_refengine_bootstrap_rooms",
    "sglang_pd_refengine_running_requests",
    "sglang_pd_refengine_waiting_requests",
    "sglang_pd_refengine_kv_transfers_in_flight",
)
ROUTER_GAUGES = ("sglang_pd_router_active_requests",)
WORKER_FIELDS = ("in_flight", "admitted", "admitted_tokens")
# 5 s windows at 80 %: on the shared 2-core host the goodput of one second swings by a factor of 4
# with no fault at all (the `none` control), and shorter windows or a higher share call that a dip.
RECOVERY_WINDOW_S = 5.0
RECOVERY_SHARE = 0.8


# ---------------------------------------------------------------------------------------------
# Figures (pure functions; tests/benchmarks/test_bench_chaos.py checks them)


@dataclass
class Request:
    client: int
    prompt: int
    rid: str
    start: float
    end: float | None = None
    ids: list[int] = field(default_factory=list)
    error: str = ""  # an error event, a status, a broken connection
    began: bool = False  # the router answered 200: the stream began
    done: bool = False  # `[DONE]` after a finish reason
    hung: bool = False


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) of `values`; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def goodput_recovery_s(
    ends: list[tuple[float, int]],
    warm: tuple[float, float],
    fault_at: float,
    until: float,
    *,
    window: float = RECOVERY_WINDOW_S,
    share: float = RECOVERY_SHARE,
) -> float | None:
    """Seconds from `fault_at` until the goodput is back to full and stays there: the start of the
    first window of `window` s (windows start at or after the fault, in 0.25 s steps) from which
    every window up to `until` holds at least `share` of the goodput in `warm` (tokens
    of answers completed per second); 0 when it never dropped, None when it was not back by
    `until`. `ends`: (completion time, tokens) of the completed answers."""
    span = warm[1] - warm[0]
    if span <= 0:
        return None
    base = sum(n for t, n in ends if warm[0] <= t < warm[1]) / span
    if base <= 0:
        return None
    starts = []
    start = fault_at
    while start + window <= until:
        starts.append(start)
        start += 0.25
    full = [sum(n for t, n in ends if s <= t < s + window) / window >= share * base for s in starts]
    for i, s in enumerate(starts):
        if all(full[i:]):
            return round(s - fault_at, 2)
    return None


def leftovers(
    engine_metrics: list[dict[str, float]], router_metrics: dict[str, float], workers: dict[str, Any]
) -> dict[str, float]:
    """What the engines and the router still hold: each gauge summed over the live engines, the
    router's active requests, and per-worker in-flight and admitted requests summed."""
    out: dict[str, float] = {}
    for name in ENGINE_GAUGES:
        out[name.removeprefix("sglang_pd_refengine_")] = sum(_metric(m, name) for m in engine_metrics)
    for name in ROUTER_GAUGES:
        out["router_" + name.removeprefix("sglang_pd_router_")] = _metric(router_metrics, name)
    for key in WORKER_FIELDS:
        total = 0.0
        for role in ("prefill", "decode"):
            for w in workers.get(role, ()):
                total += float(w.get(key) or (w.get("capacity") or {}).get(key) or 0)
        out["router_worker_" + key] = total
    return out


def summarize(
    requests: list[Request],
    reference: dict[int, list[int]],
    moved: set[str],
    fault_at: float,
    base_e2e: float | None,
) -> dict[str, object]:
    """One fault's figures from its requests. A request the router did not take (refused: no
    connection, a 503 before the stream began) is counted apart: a closed-loop client sends the next
    one 0.2 s later, so their number says how long the router was away, not how many streams broke.
    `completion_rate` is of the streams the router took; `attempt_completion_rate` of all requests."""
    ended = [r for r in requests if not r.hung]
    completed = [r for r in ended if r.done and not r.error]
    failed = [r for r in ended if not (r.done and not r.error)]
    refused = [r for r in failed if not r.began]
    cut = [r for r in failed if r.began]  # streams that began and could not go on
    taken = len(requests) - len(refused)
    identical = [r for r in completed if reference.get(r.prompt) == r.ids]
    migrated = [r for r in completed if r.rid in moved]
    added = [(r.end or 0) - r.start - base_e2e for r in migrated] if base_e2e is not None else []
    tte = [(r.end or 0) - max(r.start, fault_at) for r in cut]
    return {
        "requests": len(requests),
        "completed": len(completed),
        "completion_rate": round(len(completed) / taken, 4) if taken else None,
        "attempt_completion_rate": round(len(completed) / len(requests), 4) if requests else None,
        "identical": len(identical),
        "compared": len([r for r in completed if r.prompt in reference]),
        "refused": len(refused),
        "cut": len(cut),
        "failures": sorted({r.error[:120] for r in failed})[:5],
        "hung": len(requests) - len(ended),
        "migrated": len(migrated),
        "added_latency_s": {"p50": _round(percentile(added, 0.5)), "p99": _round(percentile(added, 0.99))},
        "time_to_error_s": {"p50": _round(percentile(tte, 0.5)), "max": _round(max(tte) if tte else None)},
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _metric(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


# ---------------------------------------------------------------------------------------------
# Processes


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )

    def send(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        self.send(sig)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.send(signal.SIGKILL)
                self.proc.wait(timeout=15)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Stack:
    """2 prefill + 2 decode reference engines and the router, as processes in `tmp`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        py = [sys.executable, "-m", "sglang_pd.deploy.cli"]
        self.prefills: list[Proc] = []
        self.decodes: list[Proc] = []
        for role, group in (("prefill", self.prefills), ("decode", self.decodes)):
            for i in range(2):
                port = free_port()
                argv = [*py, "engine", "--role", role, "--port", str(port), "--model", MODEL, "--threads", "1"]
                argv += ["--log-level", "warning"]
                if role == "prefill":
                    argv += ["--bootstrap-port", str(free_port()), "--bootstrap-timeout", "10"]
                group.append(Proc(f"{role}{i}", argv, tmp / f"{role}{i}.log", port, ENGINE_ENV))
        port = free_port()
        argv = [*py, "router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        for p in self.prefills:
            argv += ["--prefill", p.url, p.argv[p.argv.index("--bootstrap-port") + 1]]
        for d in self.decodes:
            argv += ["--decode", d.url]
        self.router = Proc("router", argv, tmp / "router.log", port, {})

    @property
    def engines(self) -> list[Proc]:
        return [*self.prefills, *self.decodes]

    def start(self) -> None:
        for p in [*self.engines, self.router]:
            p.start()
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 120) -> None:
        """Every engine serves and the router routes to all of them."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = httpx.get(f"{self.router.url}/workers", timeout=2).json()
                if all(w["healthy"] for role in ("prefill", "decode") for w in workers[role]):
                    return
            for p in [*self.engines, self.router]:
                if p.proc is not None and p.proc.poll() is not None and p.proc.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"{p.name} exited with {p.proc.returncode}: {p.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack was not ready within {timeout_s:g} s (logs in {self.tmp})")
            time.sleep(0.25)

    def close(self) -> None:
        for p in [self.router, *self.engines]:
            p.send(signal.SIGCONT)
            p.stop(signal.SIGTERM)

    def leftovers(self) -> dict[str, float]:
        engine_metrics = []
        for p in self.engines:
            if p.alive:
                with contextlib.suppress(httpx.HTTPError):
                    engine_metrics.append(parse_metrics(httpx.get(f"{p.url}/metrics", timeout=5).text))
        router = parse_metrics(httpx.get(f"{self.router.url}/metrics", timeout=5).text)
        workers = httpx.get(f"{self.router.url}/workers", timeout=5).json()
        return leftovers(engine_metrics, router, workers)

    def moved(self) -> set[str]:
        out = set()
        for line in self.router.log.read_text(errors="replace").splitlines():
            if "stream moved to another pair" in line:
                with contextlib.suppress(json.JSONDecodeError):
                    out.add(json.loads(line).get("client_request_id", ""))
        return out


# ---------------------------------------------------------------------------------------------
# Load


def _body(prompt: int) -> dict[str, object]:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new(prompt), "ignore_eos": True}
    if prompt % 2:
        ids = [(7 * prompt + k) % 200 + 10 for k in range(5 + prompt % 7)]
        return {"input_ids": ids, "sampling_params": sampling, "stream": True}
    return {"text": f"Prompt number {prompt}: tell a story about", "sampling_params": sampling, "stream": True}


async def _one(client: httpx.AsyncClient, url: str, r: Request) -> None:
    try:
        async with client.stream(
            "POST", f"{url}/generate", json=_body(r.prompt), headers={"x-request-id": r.rid}
        ) as resp:
            if resp.status_code != 200:
                r.error = f"status {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            r.began = True
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r.done = True
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    r.error = "error event: " + json.dumps(obj["error"])[:200]
                    continue
                r.ids = obj.get("output_ids") or r.ids
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    finally:
        r.end = time.monotonic()
        if r.done and len(r.ids) != max_new(r.prompt) and not r.error:
            r.error = f"answer of {len(r.ids)} tokens, not {max_new(r.prompt)}"


async def references(url: str) -> dict[int, list[int]]:
    """The uninterrupted run: every prompt's answer, all at once, before any load or fault."""
    answers = [Request(-1, p, f"chaos-ref-{p}", time.monotonic()) for p in range(PROMPTS)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S)) as client:
        await asyncio.gather(*(_one(client, url, r) for r in answers))
    bad = [r for r in answers if r.error or not r.done]
    if bad:
        raise RuntimeError(f"the uninterrupted run failed before any fault: {bad[0].error or 'no [DONE]'}")
    return {r.prompt: r.ids for r in answers}


async def closed_loop(url: str, clients: int, stop_at: float, requests: list[Request]) -> None:
    """`clients` loops, each sending its next request when the last one ended, until `stop_at`
    (monotonic); requests still open HANG_S after `stop_at` are hung."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx.Timeout(HANG_S, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def loop(c: int) -> None:
            await asyncio.sleep(c * 0.05)  # clients start apart, as real ones do
            n = 0
            while time.monotonic() < stop_at:
                r = Request(c, (c + 7 * n) % PROMPTS, f"chaos-{c}-{n}", time.monotonic())
                requests.append(r)
                n += 1
                await _one(client, url, r)
                if r.error:
                    await asyncio.sleep(0.2)  # a client backs off a little before it tries again

        tasks = [asyncio.ensure_future(loop(c)) for c in range(clients)]
        await asyncio.wait(tasks, timeout=max(0.0, stop_at - time.monotonic()) + HANG_S)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for r in requests:
        if r.end is None:
            r.hung, r.end = True, time.monotonic()


# ---------------------------------------------------------------------------------------------
# Faults: each takes the stack, returns notes, and may block (it runs in a thread)


def _decode_kill(stack: Stack) -> dict[str, object]:
    d = stack.decodes[0]
    d.stop(signal.SIGKILL)
    time.sleep(3)
    d.start()
    return {"killed": d.name, "restarted_after_s": 3}


def _decode_stop(stack: Stack) -> dict[str, object]:
    d = stack.decodes[0]
    d.send(signal.SIGSTOP)
    time.sleep(12)
    d.send(signal.SIGCONT)
    return {"stopped": d.name, "stopped_s": 12}


def _prefill_kill(stack: Stack) -> dict[str, object]:
    p = stack.prefills[0]
    deadline = time.monotonic() + 10
    in_flight = 0.0
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            m = parse_metrics(httpx.get(f"{p.url}/metrics", timeout=2).text)
            in_flight = _metric(m, "sglang_pd_refengine_kv_transfers_in_flight")
            if in_flight > 0:
                break
        time.sleep(0.002)
    p.stop(signal.SIGKILL)
    time.sleep(3)
    p.start()
    return {"killed": p.name, "transfer_in_flight_at_kill": in_flight > 0, "restarted_after_s": 3}


def _iptables(action: str) -> bool:
    """Drop (or stop dropping) every TCP packet to or from the Mooncake port range, IPv4 and IPv6
    (Mooncake's data port listens on `::`)."""
    ok = True
    for tool in ("iptables", "ip6tables"):
        for match in ("--dport", "--sport"):
            rule = ["INPUT", "-p", "tcp", match, f"{MC_PORTS[0]}:{MC_PORTS[1]}", "-j", "DROP"]
            ok &= subprocess.run([tool, action, *rule], capture_output=True).returncode == 0
    return ok


def _kv_writes(stack: Stack) -> float:
    """KV writes the live prefills have completed (sglang_pd_kv_transfers_total)."""
    total = 0.0
    for p in stack.prefills:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{p.url}/metrics", timeout=5).text
            total += _metric(parse_metrics(text), "sglang_pd_kv_transfers_total")
    return total


def _kv_cut(stack: Stack) -> dict[str, object]:
    if os.environ.get("SGLANG_PD_CHAOS_NETNS") == "1" and _iptables("-I"):
        before = _kv_writes(stack)
        time.sleep(8)
        during = _kv_writes(stack) - before  # 0 when the cut held
        _iptables("-D")
        how = f"iptables DROP on tcp ports {MC_PORTS[0]}-{MC_PORTS[1]} in a private network namespace"
        return {"how": how, "cut_s": 8, "kv_writes_completed_during_cut": during}
    # No private namespace here: the prefill's Mooncake peer (its transfer engine lives in the
    # engine process) goes away instead.
    notes = _prefill_kill(stack)
    return {"how": "the prefill (its Mooncake peer) killed: no private network namespace here", **notes}


def _router_restart(stack: Stack) -> dict[str, object]:
    stack.router.stop(signal.SIGKILL)
    time.sleep(1)
    stack.router.start()
    return {"restarted_after_s": 1}


def _engine_restart(stack: Stack) -> dict[str, object]:
    d = stack.decodes[1]
    began = time.monotonic()
    d.stop(signal.SIGTERM)
    stopped = time.monotonic() - began
    d.start()
    return {"restarted": d.name, "graceful_stop_s": round(stopped, 2)}


def _prefill_stale(stack: Stack) -> dict[str, object]:
    p = stack.prefills[1]
    p.stop(signal.SIGKILL)
    p.start()
    return {"restarted": p.name, "same_ports": True}


def _none(stack: Stack) -> dict[str, object]:
    """The control: the same load and measurement with no fault."""
    return {}


FAULTS: dict[str, Callable[[Stack], dict[str, object]]] = {
    "none": _none,
    "decode_kill": _decode_kill,
    "decode_stop": _decode_stop,
    "prefill_kill": _prefill_kill,
    "kv_cut": _kv_cut,
    "router_restart": _router_restart,
    "engine_restart": _engine_restart,
    "prefill_stale": _prefill_stale,
}


# ---------------------------------------------------------------------------------------------
# One fault


@dataclass
class Plan:
    clients: int = 16
    warm_s: float = 10.0
    after_s: float = 24.0
    settle_s: float = 30.0


def run_fault(name: str, plan: Plan, tmp: Path) -> dict[str, object]:
    tmp.mkdir(parents=True, exist_ok=True)
    stack = Stack(tmp)
    try:
        stack.start()
        return _measure(name, stack, plan)
    finally:
        stack.close()


def _measure(name: str, stack: Stack, plan: Plan) -> dict[str, object]:
    reference = asyncio.run(references(stack.router.url))
    requests: list[Request] = []
    t0 = time.monotonic()
    fault_at = t0 + plan.warm_s
    stop_at = fault_at + plan.after_s
    notes: dict[str, object] = {}

    async def drive() -> None:
        load = asyncio.ensure_future(closed_loop(stack.router.url, plan.clients, stop_at, requests))
        await asyncio.sleep(max(0.0, fault_at - time.monotonic()))
        notes.update(await asyncio.to_thread(FAULTS[name], stack))
        await load

    asyncio.run(drive())
    # The router was restarted, an engine came back: wait until the router routes to all again.
    waited = time.monotonic()
    try:
        stack.wait_ready(timeout_s=60)
        readmitted_s: float | None = round(time.monotonic() - waited, 2)
    except RuntimeError:
        readmitted_s = None  # a worker the router still does not route to, 60 s after the load
    settle_began = time.monotonic()
    left = stack.leftovers()
    while any(left.values()) and time.monotonic() - settle_began < plan.settle_s:
        time.sleep(0.5)
        left = stack.leftovers()
    settled_s = time.monotonic() - settle_began

    clean = [(r.end or 0) - r.start for r in requests if r.done and not r.error and (r.end or 0) < fault_at]
    base_e2e = statistics.median(clean) if clean else None
    figures = summarize(requests, reference, stack.moved(), fault_at, base_e2e)
    ends = [(r.end or 0, len(r.ids)) for r in requests if r.done and not r.error]
    warm = (t0 + plan.warm_s / 2, fault_at)  # the load's second half before the fault: past its ramp
    return {
        "fault": name,
        **figures,
        "uninterrupted_e2e_p50_s": _round(base_e2e),
        "recovery_s": goodput_recovery_s(ends, warm, fault_at, stop_at),
        # tokens of answers completed in each second from the load's start (the fault at warm_s)
        "goodput_timeline": [sum(n for t, n in ends if i <= t - t0 < i + 1) for i in range(int(stop_at - t0))],
        "leftovers": left,
        "leftovers_settled_s": round(settled_s, 2),
        # after the load: the wait until the router routed to every worker again (None: not in 60 s)
        "all_workers_routed_after_load_s": readmitted_s,
        "notes": notes,
    }


# ---------------------------------------------------------------------------------------------
# Report


def _uptime() -> str:
    with contextlib.suppress(OSError):
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    return ""


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip()
    return ""


def table(results: list[dict[str, Any]]) -> str:
    cols = "fault            taken  all    ident.     migr  added p50/p99 s  cut  tte p50/max s  refused"
    rows = [cols + " hung left recov. s"]
    for r in results:
        a, e = r["added_latency_s"], r["time_to_error_s"]
        rows.append(
            f"{r['fault']:<16} {_pct(r['completion_rate'])} {_pct(r['attempt_completion_rate'])} "
            f"{r['identical']:>4}/{r['compared']:<5} {r['migrated']:>4}  {_fmt(a['p50'])}/{_fmt(a['p99']):<9}"
            f"{r['cut']:>4}  {_fmt(e['p50'])}/{_fmt(e['max']):<9}{r['refused']:>6} {r['hung']:>4} "
            f"{sum(r['leftovers'].values()):>4g} {_fmt(r['recovery_s']):>7}"
        )
    return "\n".join(rows)


def _pct(v: float | None) -> str:
    return "    -" if v is None else f"{v * 100:5.1f}%"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _in_netns(argv: list[str]) -> bool:
    """Run the kv_cut fault in a private network namespace (`unshare -rn`, loopback up) where the
    host allows it; True when it ran there (its JSON is read back by the caller)."""
    if os.environ.get("SGLANG_PD_CHAOS_NETNS") == "1":
        return False
    probe = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up && iptables -L -n"], capture_output=True)
    if probe.returncode != 0:
        return False
    inner = f"ip link set lo up && exec {' '.join(argv)}"
    env = {**os.environ, "SGLANG_PD_CHAOS_NETNS": "1"}
    return subprocess.run(["unshare", "-rn", "sh", "-c", inner], env=env).returncode in (0, 1)


@contextlib.contextmanager
def _tmpdir(base: Path | None) -> Iterator[Path]:
    import tempfile

    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
        yield base
        return
    with tempfile.TemporaryDirectory(prefix="chaos-") as d:
        yield Path(d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS), help="comma-separated, of: " + ", ".join(FAULTS))
    ap.add_argument("--clients", type=int, default=16, help="closed-loop streams (16-64)")
    ap.add_argument("--warm", type=float, default=10.0, help="seconds of load before the fault")
    ap.add_argument("--after", type=float, default=24.0, help="seconds of load after the fault")
    ap.add_argument("--out", type=Path, help="JSON result file")
    ap.add_argument("--logs", type=Path, help="keep the processes' logs here")
    args = ap.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    if not 1 <= args.clients <= 256:
        ap.error(f"--clients has value {args.clients}; give 1 to 256 (the suite's figures use 16-64)")
    plan = Plan(clients=args.clients, warm_s=args.warm, after_s=args.after)
    command = " ".join([".venv/bin/python -m benchmarks.bench_chaos", *(argv if argv is not None else sys.argv[1:])])
    load_before = _uptime()
    results: list[dict[str, Any]] = []
    with _tmpdir(args.logs) as tmp:
        for name in faults:
            if name == "kv_cut" and os.environ.get("SGLANG_PD_CHAOS_NETNS") != "1":
                part = tmp / "kv_cut.json"
                inner = [sys.executable, "-m", "benchmarks.bench_chaos", "--faults", "kv_cut"]
                inner += ["--clients", str(plan.clients), "--warm", str(plan.warm_s), "--after", str(plan.after_s)]
                inner += ["--out", str(part), "--logs", str(tmp / "netns")]
                if _in_netns(inner) and part.exists():
                    results += json.loads(part.read_text())["results"]
                    print(f"kv_cut done (private network namespace): {results[-1]['completion_rate']}", flush=True)
                    continue
            print(f"{name} ...", flush=True)
            started = time.monotonic()
            result = run_fault(name, plan, tmp / name)
            result["wall_s"] = round(time.monotonic() - started, 1)
            results.append(result)
            print(f"{name} done in {result['wall_s']} s: completion {result['completion_rate']}", flush=True)
    report = {
        "benchmark": "chaos",
        "command": command,
        "machine": f"{os.cpu_count()}-core CPU host, {platform.platform()}, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _commit(),
        "load_before": load_before,
        "load_after": _uptime(),
        "setup": {
            "engines": "2 prefill + 2 decode reference engines, tiny-deepseek-v3, fp32, 1 thread each, Mooncake TCP",
            "router": "defaults: --migration-limit 1, --max-retries 2, --stream-stall 5",
            "clients": plan.clients,
            "max_new_tokens": f"16-48 by prompt ({PROMPTS} prompts)",
            "warm_s": plan.warm_s,
            "after_s": plan.after_s,
            "recovery": f"from the fault until every {RECOVERY_WINDOW_S:g} s window holds {RECOVERY_SHARE:.0%} "
            "of the goodput of the warm-up's second half, to the end of the load",
        },
        "results": results,
    }
    print(table(results))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    bad = [r["fault"] for r in results if r["hung"] or any(r["leftovers"].values())]
    if bad:
        print(f"hung requests or state left behind after: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
