"""A decode killed mid-stream on a 1P2D stack: its streams move to the other decode and finish.

`sglang-pd up` starts a preset with a second decode group beside the first on the same host (and,
for sglang, the same GPU): `one_prefill_two_decodes`. Then, through `up`'s router, which migrates
a stream whose decode fails (`--migration-limit` 1, its default; docs/migration.md):

1. `uninterrupted`: STREAMS greedy streamed `/generate` requests of MAX_NEW tokens, each prompt
   distinct, the radix caches flushed first;
2. `again`: the same run once more. Batch composition changes logits on GPU kernels, so how many
   streams two uninterrupted runs share token for token is the floor the kill is measured against;
3. `kill`: the same streams, with decode-0's process group SIGKILLed once every stream has had its
   first token, a quarter of them are still in the first half of their answer, and decode-0 itself
   is decoding. Until its first token a stream's decode leg is one attempt the router may retry on
   the other decode (proxy.py): a kill then moves nothing and breaks nothing. Every stream must
   end with all its tokens, without an error event and within HANG_S; each is compared with run 1
   (the share identical, and the first divergence of each that is not); the moved streams' added
   latency; and what the live engines and the router still hold once the streams are over (must
   be what they held idle);
4. `control`: once `up` has restarted decode-0, a second router over the same engines with
   `--migration-limit 0`, and the same kill: streams must end with the error event. Without that
   the kill touched no stream in flight, and step 3 could not have failed.

The verdicts are pure functions (`migration_verdicts.py`, tested on a CPU); this module runs the
processes. `tests/scripts/test_migration_stage.py` runs it against reference engines on a CPU,
and `gpu_pd_check.py --stages migration` against sglang on one GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import migration_verdicts as verdicts
import yaml

from sglang_pd.deploy.common.procs import Child, spawn

STREAMS = 16
#: Tokens per stream: long enough that a kill lands in mid-answer at every stream's pace.
MAX_NEW = 256
#: A stream with no end after this long counts as hung.
HANG_S = 120.0
#: `sglang-pd up` prints this line once its stack serves (and its smoke request answered).
UP_STARTED = "try: curl "
#: The port of the control run's router (`--migration-limit 0`), beside `up`'s.
CONTROL_PORT = 8100
#: The router's gauge of requests it serves now.
ROUTER_ACTIVE = "sglang_pd_router_active_requests"


@dataclass(frozen=True)
class Engines:
    """How to find and read one kind of engine: the decode's command line, the gauges that count
    what an engine holds for requests (each reading names the gauges a server did not export), and
    the one among them that counts the requests in its running batch."""

    kind: str
    decode_needles: tuple[str, ...]
    gauges: tuple[str, ...]
    running: str


SGLANG = Engines(
    kind="sglang",
    decode_needles=("sglang.launch_server", "--disaggregation-mode decode"),
    # sglang's scheduler gauges (srt/observability/metrics_collector.py; /metrics with
    # --enable-metrics, which the renderer always gives): tokens in use exclude what the radix cache
    # could evict; the prefill's bootstrap and in-flight queues and the decode's prealloc and
    # transfer queues hold requests whose KV is on its way (the queues sglang's own idle check counts).
    gauges=(
        "sglang:num_used_tokens",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_prefill_bootstrap_queue_reqs",
        "sglang:num_prefill_inflight_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs",
    ),
    running="sglang:num_running_reqs",
)
REFERENCE = Engines(
    kind="reference",
    decode_needles=("sglang_pd.deploy.cli", "engine", "--role decode"),
    gauges=(
        "sglang_pd_refengine_kv_pages_used",
        "sglang_pd_refengine_bootstrap_rooms",
        "sglang_pd_refengine_running_requests",
        "sglang_pd_refengine_waiting_requests",
        "sglang_pd_refengine_kv_transfers_in_flight",
    ),
    running="sglang_pd_refengine_running_requests",
)


def one_prefill_two_decodes(preset: Path, out: Path, mem_fraction: float | None = None) -> Path:
    """`preset` with two decode groups (ports `decode.port` and the next), written under `out`.
    Model paths the preset gives relative to its folder become absolute. `mem_fraction`: each
    server's share of the one GPU, so that three fit where the preset placed two."""
    t = yaml.safe_load(preset.read_text())
    t["name"] = f"{t['name']}-1p2d"
    for key in ("path", "config_json"):
        value = t["model"].get(key)
        if value and (preset.parent / value).exists():
            t["model"][key] = str((preset.parent / value).resolve())
    t["decode"]["groups"] = 2
    if mem_fraction is not None:
        t["prefill"]["mem_fraction_static"] = t["decode"]["mem_fraction_static"] = mem_fraction
    path = out / f"{t['name']}.yaml"
    path.write_text(yaml.safe_dump(t, sort_keys=False))
    return path


@dataclass
class Ports:
    """The stack's URLs, read from the derived topology."""

    router: str
    prefill: str
    bootstrap_port: int
    decodes: list[str]

    @classmethod
    def of(cls, topology: Path) -> Ports:
        t = yaml.safe_load(topology.read_text())
        p, d, r = t["prefill"], t["decode"], t["router"]
        return cls(
            router=f"http://127.0.0.1:{r['port']}",
            prefill=f"http://127.0.0.1:{p['port']}",
            bootstrap_port=int(p["bootstrap_port"]),
            decodes=[f"http://127.0.0.1:{int(d['port']) + i}" for i in range(int(d["groups"]))],
        )


# --------------------------------------------------------------------------------------------
# Streams


@dataclass
class Stream:
    """What one streamed `/generate` gave its client."""

    ids: list[int] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    hung: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def body(i: int, max_new: int) -> dict[str, Any]:
    """Stream i's request: a prompt of its own, greedy, all `max_new` tokens."""
    return {
        "text": f"Stream {i} of the migration run, a story about the number {i * 37 % 101}:",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
        "stream": True,
    }


async def one_stream(client: httpx.AsyncClient, base: str, i: int, max_new: int, progress: list[int]) -> Stream:
    """Stream i through `base`; `progress[i]` follows its token count. sglang's streamed `/generate`
    sends every id so far in each event (`output_ids`), and `[DONE]` at its end."""
    out = Stream()
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", f"{base}/generate", json=body(i, max_new), headers={"x-request-id": f"mig-{i}"}
        ) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out.done = True
                    continue
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    out.error = f"not JSON: {data[:200]!r}"
                    continue
                if "error" in event:
                    out.error = json.dumps(event["error"])[:300]
                    continue
                if not isinstance(event.get("output_ids"), list):
                    out.error = f"an event without output_ids: {data[:200]!r}"
                    continue
                out.ids = list(event["output_ids"])
                progress[i] = len(out.ids)
    except httpx.TimeoutException:
        out.hung = True
    except httpx.HTTPError as exc:
        out.error = f"connection: {type(exc).__name__}: {exc}"
    finally:
        out.seconds = time.perf_counter() - t0
    return out


def kill_moment(progress: list[int], max_new: int) -> bool:
    """Whether streams with these token counts are ready for the kill: every one has a token (so
    each is past the attempt the router may still retry elsewhere, and bound to its decode), and a
    quarter of them are under half their tokens (so the kill lands in mid-answer)."""
    early = sum(p < max_new // 2 for p in progress)
    return all(p > 0 for p in progress) and early >= max(1, len(progress) // 4)


async def run_streams(
    base: str,
    streams: int,
    max_new: int,
    *,
    kill: Callable[[], None] | None = None,
    decoding: Callable[[], bool] | None = None,
) -> tuple[list[Stream], dict[str, Any]]:
    """`streams` concurrent streams through `base`. With `kill`: called at the `kill_moment` once
    `decoding()` says the victim decodes."""
    progress = [0] * streams
    about: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one_stream(client, base, i, max_new, progress)) for i in range(streams)]
        if kill is not None:
            while not all(t.done() for t in tasks):
                if kill_moment(progress, max_new) and (decoding is None or await asyncio.to_thread(decoding)):
                    about = {"at_s": round(time.perf_counter() - t0, 3), "progress": list(progress)}
                    kill()
                    break
                await asyncio.sleep(0.005)
            else:
                # A stream that failed before its first token holds the moment back for good: name it.
                silent = [i for i, p in enumerate(progress) if p == 0]
                why = f"streams {silent} ended without a token" if silent else "every stream ended before it"
                about = {"not_killed": f"the kill's moment never came: {why}"}
        done, pending = await asyncio.wait(tasks, timeout=HANG_S + 10)
        for t in pending:
            t.cancel()
        results = [t.result() if t in done else Stream(hung=True, seconds=HANG_S) for t in tasks]
    return results, about


# --------------------------------------------------------------------------------------------
# Engines and routers


def gauges(base: str, names: tuple[str, ...], headers: Mapping[str, str]) -> dict[str, float]:
    """The named gauges of one server's /metrics, summed over their labels (absent ones left out)."""
    r = httpx.get(f"{base}/metrics", headers=dict(headers), timeout=5)
    r.raise_for_status()
    text = r.text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def held(
    engines: Engines, servers: Mapping[str, str], routers: Mapping[str, str], auth: Mapping[str, str]
) -> dict[str, Any]:
    """What each live server and router holds for requests now (a server that does not answer: None)."""
    out: dict[str, Any] = {}
    for name, base in servers.items():
        try:
            read = gauges(base, engines.gauges, auth)
        except httpx.HTTPError as exc:
            out[name] = {"unreachable": type(exc).__name__}
            continue
        absent = [g for g in engines.gauges if g not in read]
        out[name] = {**read, **({verdicts.ABSENT: absent} if absent else {})}
    for name, base in routers.items():
        try:
            active = gauges(base, (ROUTER_ACTIVE,), {}).get(ROUTER_ACTIVE)
            workers = httpx.get(f"{base}/workers", timeout=5).json()
            busy = {
                key: sum(
                    (w.get(key) or (w.get("capacity") or {}).get(key) or 0)
                    for r in ("prefill", "decode")
                    for w in workers[r]
                )
                for key in ("in_flight", "admitted")
            }
            out[name] = {ROUTER_ACTIVE: active, **{f"workers_{k}": float(v) for k, v in busy.items()}}
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            out[name] = {"unreachable": type(exc).__name__}
    return out


def settled(read: Callable[[], dict[str, Any]], idle: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """`read()` once it shows no more than `idle` held, or the last reading after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = read()
        if not verdicts.left_behind(idle, now) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def flush(prefill: str, decodes: list[str], auth: Mapping[str, str], tries: int = 50) -> dict[str, int | None]:
    """POST /flush_cache to the prefill until it answers 200 (sglang refuses while it has requests);
    the decodes once each: by default sglang keeps no radix cache on a decode server
    (`--disaggregation-decode-enable-radix-cache`), so their answer is recorded, not required."""
    codes: dict[str, int | None] = {}
    for base, attempts in [(prefill, tries), *((d, 1) for d in decodes)]:
        codes[base] = None
        for _ in range(attempts):
            with contextlib.suppress(httpx.HTTPError):
                codes[base] = httpx.post(f"{base}/flush_cache", headers=dict(auth), timeout=10).status_code
                if codes[base] == 200:
                    break
            time.sleep(0.1)
    return codes


def find_process(*needles: str) -> int | None:
    """The lowest pid whose command line holds every needle."""
    for proc in sorted(Path("/proc").glob("[0-9]*"), key=lambda p: int(p.name)):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if all(n in cmd for n in needles):
                return int(proc.name)
    return None


def decode_pid(engines: Engines, port: int) -> int | None:
    """The pid of the decode server listening on `port` (its launcher: the group's leader)."""
    return find_process(*engines.decode_needles, f"--port {port}")


def killer(engines: Engines, port: int) -> tuple[int, Callable[[], None]]:
    """The decode on `port`, and a call that SIGKILLs its process group (scheduler and detokenizer too)."""
    pid = decode_pid(engines, port)
    if pid is None:
        raise RuntimeError(f"no {engines.kind} decode process with --port {port} found in /proc")
    pgid = os.getpgid(pid)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):  # it died on its own meanwhile
            os.killpg(pgid, signal.SIGKILL)

    return pid, kill


def wait_restarted(
    engines: Engines, port: int, killed: int, auth: Mapping[str, str], alive: Callable[[], bool], timeout_s: float
) -> float:
    """Seconds until a new decode process (not `killed`) listens on `port` and answers /health 200.
    Asked of the server itself: the router ejects a dead worker only after its failed probes, so its
    view may still show the old decode healthy for seconds after the kill."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not alive():
            raise RuntimeError("`sglang-pd up` exited while its killed decode was restarting")
        pid = decode_pid(engines, port)
        if pid is not None and pid != killed:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", headers=dict(auth), timeout=5).status_code == 200:
                    return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"the decode on port {port} was not restarted and healthy within {timeout_s:g} s")


def decoding(engines: Engines, base: str, auth: Mapping[str, str]) -> Callable[[], bool]:
    """Whether the server at `base` has a request in its running batch."""
    name = engines.running

    def probe() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return gauges(base, (name,), auth).get(name, 0.0) > 0
        return False

    return probe


def wait_ready(router: str, decodes: int, alive: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `router` has a healthy prefill and `decodes` healthy decodes."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout_s:
        if not alive():
            raise RuntimeError(f"the stack's process exited while waiting for {router}; last view: {last}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            last = httpx.get(f"{router}/workers", timeout=5).json()
            healthy = {role: sum(bool(w["healthy"]) for w in last[role]) for role in ("prefill", "decode")}
            if healthy["prefill"] >= 1 and healthy["decode"] >= decodes:
                return time.monotonic() - t0
        time.sleep(0.5)
    raise RuntimeError(f"{router} had no prefill and {decodes} healthy decodes within {timeout_s:g} s: {last}")


def start(name: str, argv: list[str], out: Path, env: Mapping[str, str]) -> Child:
    with open(out / f"{name}.log", "wb") as log:
        return spawn(name, argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=False)


def stop(child: Child, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    child.signal_group(sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(grace_s)
    child.reap()


def wait_up(child: Child, log: Path, timeout_s: float) -> None:
    t0 = time.monotonic()
    while UP_STARTED not in log.read_text(errors="replace"):
        if not child.alive():
            raise RuntimeError(f"`sglang-pd up` exited with {child.proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"`sglang-pd up` did not start within {timeout_s:g} s: {log.read_text()[-2000:]}")
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# The stage


def run(
    out: Path,
    topology: Path,
    engines: Engines,
    *,
    up_args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    auth: Mapping[str, str] | None = None,
    ready_s: float = 420.0,
    streams: int = STREAMS,
    max_new: int = MAX_NEW,
    control_port: int = CONTROL_PORT,
    report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The four runs on a 1P2D `topology` started by `sglang-pd up`. Fills `report` (a new dict when
    none is given) as it goes, so that a run cut short keeps what it measured, and returns it; the
    verdicts are under "verdicts" (None where a requirement holds)."""
    env, auth = dict(env or {}), dict(auth or {})
    ports = Ports.of(topology)
    servers = {"prefill": ports.prefill, **{f"decode-{i}": d for i, d in enumerate(ports.decodes)}}
    report = {} if report is None else report
    report.update(topology=str(topology), engines=engines.kind, streams=streams, max_new=max_new)
    runs: dict[str, list[dict[str, Any]]] = report.setdefault("runs", {})
    checks: dict[str, str | None] = report.setdefault("verdicts", {})
    cli = [sys.executable, "-m", "sglang_pd.deploy.cli"]
    up_argv = [*cli, "up", str(topology), "--engine", engines.kind, "--log-dir", str(out / "engines"), *up_args]
    report["up_argv"] = up_argv[1:]
    up_log = out / "up-1p2d.log"
    up = start("up-1p2d", up_argv, out, env)
    control: Child | None = None

    def measured(name: str, base: str, **kill: Any) -> dict[str, Any]:
        report.setdefault("flush", {})[name] = flush(ports.prefill, ports.decodes, auth)
        results, about = asyncio.run(run_streams(base, streams, max_new, **kill))
        runs[name] = [r.as_dict() for r in results]
        return about

    try:
        wait_up(up, up_log, ready_s)
        report["ready_s"] = round(wait_ready(ports.router, 2, up.alive, ready_s), 1)
        measured("uninterrupted", ports.router)
        measured("again", ports.router)
        idle = settled(lambda: held(engines, servers, {"router": ports.router}, auth), {})
        report["idle"] = idle

        victim_port = int(ports.decodes[0].rsplit(":", 1)[1])
        killed, kill = killer(engines, victim_port)
        moved_before = verdicts.migrations(httpx.get(f"{ports.router}/metrics", timeout=5).text)
        report["kill"] = measured("kill", ports.router, kill=kill, decoding=decoding(engines, ports.decodes[0], auth))
        moved_after = verdicts.migrations(httpx.get(f"{ports.router}/metrics", timeout=5).text)
        report["migrations"] = {k: moved_after.get(k, 0.0) - moved_before.get(k, 0.0) for k in moved_after}
        report["moved_streams"] = sorted(verdicts.moved_ids(up_log.read_text(errors="replace")))
        report["figures"] = verdicts.figures(
            runs["uninterrupted"], runs["again"], runs["kill"], max_new, moved=report["moved_streams"]
        )
        checks["migration"] = verdicts.kill_verdict(report["figures"], report["migrations"])
        live = {k: v for k, v in servers.items() if k != "decode-0"}
        report["after_kill"] = settled(lambda: held(engines, live, {"router": ports.router}, auth), idle)
        checks["leftovers"] = verdicts.leftover_verdict(idle, report["after_kill"])

        # The control: once `up` has restarted decode-0, a router that may not migrate sees the same kill.
        report["restart_s"] = round(wait_restarted(engines, victim_port, killed, auth, up.alive, ready_s), 1)
        wait_ready(ports.router, 2, up.alive, ready_s)
        control_url = f"http://127.0.0.1:{control_port}"
        control_argv = [*cli, "router", "--host", "127.0.0.1", "--port", str(control_port)]
        control_argv += ["--prefill", ports.prefill, str(ports.bootstrap_port)]
        control_argv += [a for d in ports.decodes for a in ("--decode", d)]
        control_argv += ["--decode-policy", "round_robin", "--migration-limit", "0", "--max-retries", "2"]
        control = start("router-limit0", control_argv, out, env)
        wait_ready(control_url, 2, control.alive, 60.0)
        _, kill = killer(engines, victim_port)
        report["control_kill"] = measured(
            "control", control_url, kill=kill, decoding=decoding(engines, ports.decodes[0], auth)
        )
        checks["control"] = verdicts.control_verdict(runs["control"], report["control_kill"])
    finally:
        if control is not None:
            stop(control)
        stop(up, signal.SIGINT, grace_s=60.0)
    return report
