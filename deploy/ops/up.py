"""`sglang-pd up [TOPOLOGY]`: run a whole PD topology on this machine.

Starts the prefill and decode engines (the reference engine on a CPU topology; sglang itself where
CUDA and sglang are installed: without them `--engine sglang` refuses at once) and the router, as
child processes, after checking that none of their ports is taken (the holder is named); prints a
line as each component starts and becomes healthy; writes each engine's log to a file in a run
folder (printed; the router logs to the console), with a note after Mooncake's expected
error-looking lines (kv/mooncake_logs.py); prints the time to ready, the OpenAI base URL, one chat
exchange through the router (the smoke request, sent with the first key of
SGLANG_PD_ROUTER_API_KEYS when that is set; `--no-smoke` skips it) and a curl example. On Ctrl-C
or SIGTERM the router is stopped first with its drain time, then the engines (their whole process
groups; children also die with this process: `procs.py`). A child that dies once the stack is up
is restarted with a back-off while the others keep running: it doubles per restart, and starts
again once a child has run for a healthy minute.

The worker key (SGLANG_PD_WORKER_API_KEY) reaches the children as it does in the cluster: sglang
engines read it from a config file only this user can read (`keyfile.py`, as `launch` gives it in a
pod; removed when `up` stops), the reference engines and the router from the environment they
inherit. Without one `up` generates a random key for its children, so that its engines answer only
the router and its own probes. What `up` prints or logs from a child shows the key masked.

Mooncake's KV ports (TCP MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) authenticate no one, so `up` fences
them (kv/firewall.py): the engines run with the group KV_ENGINE_GID, and netfilter rules named
after this process reset loopback connections to the range from every other group and drop those
from other hosts; they are removed at stop, and those of a run that was killed at the next start.
Where the rules cannot be installed (not root, no iptables), `up` refuses to start when a worker
key is set (unless --allow-open-kv-ports) and otherwise warns that the ports are open.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

import httpx

from sglang_pd.deploy.common.contract import (
    ENV_ROUTER_API_KEYS,
    ENV_WORKER_API_KEY,
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_OK,
    WORKER_AUTH_HEADER,
    Role,
)
from sglang_pd.deploy.common.logs import JsonFormatter
from sglang_pd.deploy.common.procs import Child, http_ok, mask_secrets, port_in_use, spawn
from sglang_pd.deploy.kv.firewall import FirewallError, LocalFirewall, remove_stale_local_chains
from sglang_pd.deploy.kv.listeners import EXPOSURE_MARK, mooncake_port_range, range_held_note
from sglang_pd.deploy.kv.mooncake_logs import LogAnnotator
from sglang_pd.deploy.ops.keyfile import KeyFile
from sglang_pd.deploy.ops.launch import API_KEY_SHOWN, LaunchError, checked_worker_key, sglang_worker_key
from sglang_pd.deploy.router.cli import router_flags
from sglang_pd.deploy.sglang.compat import SglangVersionError, adapt_argv, installed_options
from sglang_pd.deploy.spec.presets import has_random_weights
from sglang_pd.deploy.spec.topology import InstanceEndpoint, Topology, TopologyError, load_checked_topology

__all__ = ["ChildSpec", "Stack", "add_arguments", "local_children", "run"]

DEFAULT_TOPOLOGY = "local-cpu"
TINY_MODEL = "tiny-deepseek-v3"
# Models the reference engine builds, or finds in an installed package, by name (refengine/sources.py).
REFERENCE_MODELS = ("smollm2-135m-instruct", TINY_MODEL)


@dataclass
class ChildSpec:
    """One child process of the stack and the URL that says it is ready."""

    name: str
    argv: list[str]
    health_url: str
    env: dict[str, str] = field(default_factory=dict)
    # Start the next child only once this one is healthy. sglang sizes its KV pool from the GPU
    # memory free when it starts, so engines sharing a GPU must not measure it at the same time.
    sequential: bool = False
    ready_timeout_s: float = 900.0
    ports: tuple[int, ...] = ()  # what it binds, checked free before anything starts
    host: str = "127.0.0.1"
    log_to_file: bool = True  # engines log to the run folder; the router to the console
    stop_grace_s: float = 10.0  # SIGTERM, then this long before SIGKILL
    drains: bool = False  # stopped first, and the others only once it has exited (the router)
    # Values shown masked wherever `up` echoes or logs this child's output: sglang logs its whole
    # ServerArgs at start (`server_args=...`, api_key included; sglang/srt/entrypoints/engine.py).
    secrets: tuple[str, ...] = ()
    # Sent with each health probe: the worker key, which the reference engine requires on /health too.
    health_headers: dict[str, str] = field(default_factory=dict)
    # Whether `health_url` says ready: (url, headers=...) -> bool; a 200 unless a child needs more.
    health_probe: Callable[..., bool] = http_ok
    # Opens a Mooncake transfer engine: runs in the KV group (`group`) when `up` fences the KV ports.
    kv: bool = False
    group: int | None = None  # the child's primary group id; None: this process's


# The router's drain time on SIGTERM (RouterConfig.drain_timeout_s), and the extra it gets to exit.
ROUTER_DRAIN_S = 30.0
MAX_RESTART_BACKOFF_S = 30.0  # a child that keeps dying is retried at most this far apart
# A child that ran this long before it exited was healthy: its next restart waits the first
# back-off again, not the doubled one of crashes that may be hours old.
HEALTHY_RESET_S = 60.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_pd.deploy.cli", *args]


def _model_arg(t: Topology) -> list[str]:
    path = t.model.path
    if path in REFERENCE_MODELS:
        return ["--model", path]
    local = Path(path) if Path(path).is_absolute() else (t.source_dir or Path.cwd()) / path
    if not (local / "config.json").exists():
        raise TopologyError(
            f"model.path: {path} is not a local model directory (no config.json); the reference engine runs "
            f"{' or '.join(REFERENCE_MODELS)}, or a local Hugging Face model directory."
        )
    return ["--model", str(local)]


def parse_ports(text: str) -> dict[str, int]:
    """`--ports prefill-0=31000,prefill-0.bootstrap=31998,decode-0=31001` → {name: port}."""
    out: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not value.isdigit() or not 0 < int(value) < 65536:
            raise TopologyError(
                f"--ports: {item!r} is not NAME=PORT (e.g. prefill-0=31000, prefill-0.bootstrap=31998, decode-0=31001)."
            )
        out[name.strip()] = int(value)
    return out


def endpoints(t: Topology, overrides: dict[str, int] | None = None) -> dict[str, list[InstanceEndpoint]]:
    """The topology's instance endpoints by role, with `--ports` overrides applied; an override
    naming no component is an error that lists the names."""
    overrides = dict(overrides or {})
    out: dict[str, list[InstanceEndpoint]] = {}
    roles: tuple[Role, Role] = ("prefill", "decode")
    for role in roles:
        eps = []
        for ep in t.instance_endpoints(role):
            changes: dict[str, Any] = {}
            if ep.name in overrides:
                changes["port"] = overrides.pop(ep.name)
            if f"{ep.name}.bootstrap" in overrides:
                changes["bootstrap_port"] = overrides.pop(f"{ep.name}.bootstrap")
            eps.append(dataclasses.replace(ep, **changes))
        out[role] = eps
    if overrides:
        names = [ep.name for eps in out.values() for ep in eps]
        names += [f"{ep.name}.bootstrap" for ep in out["prefill"]]
        raise TopologyError(f"--ports names {', '.join(overrides)}; this topology's components are {', '.join(names)}.")
    return out


def shared_ports(eps: dict[str, list[InstanceEndpoint]], router_port: int) -> list[str]:
    """One line per port that two components of the local stack would both bind (`--port`/`--ports`
    can move them onto each other, which the topology's own rules cannot see), naming both."""
    users: list[tuple[str, int]] = [("router (--port)", router_port)]
    for role_eps in eps.values():
        for ep in role_eps:
            users.append((ep.name, ep.port))
            if ep.bootstrap_port is not None:
                users.append((f"{ep.name}.bootstrap", ep.bootstrap_port))
    first: dict[int, str] = {}
    problems = []
    for name, port in users:
        if port in first:
            problems.append(f"port {port} is given to both {first[port]} and {name}")
        first.setdefault(port, name)
    return problems


def local_children(
    t: Topology,
    *,
    host: str,
    port: int,
    ports: dict[str, int] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[ChildSpec]:
    """The reference-engine stack of a CPU topology: engines, then the router.

    The engines read the worker key from `env` (default: this process's environment, which they
    inherit) themselves; here it is only checked, and sent with their health probes.
    """
    key = worker_key(os.environ if env is None else env)
    probe, secrets = _key_probe(key), _secrets(key)
    common = [*_model_arg(t), "--served-model-name", t.model.name, "--page-size", str(t.model.page_size)]
    if t.model.context_length is not None:  # as `launch` renders it for sglang
        common += ["--context-length", str(t.model.context_length)]
    eps = endpoints(t, ports)
    clashes = shared_ports(eps, port)
    if clashes:
        raise TopologyError("; ".join(clashes) + ". Give each its own port with --port / --ports.")
    children = []
    for ep in eps["prefill"]:
        mrr = str(t.prefill.max_running_requests or 64)
        argv = _cli("engine", "--role", "prefill", "--port", str(ep.port), "--bootstrap-port", str(ep.bootstrap_port))
        bound = (ep.port, ep.bootstrap_port or 0)
        children.append(
            ChildSpec(
                ep.name,
                [*argv, *common, "--max-running-requests", mrr],
                f"{ep.url}/health",
                ports=bound,
                secrets=secrets,
                health_headers=probe,
            )
        )
    for ep in eps["decode"]:
        mrr = str(t.decode.max_running_requests or 64)
        argv = _cli("engine", "--role", "decode", "--port", str(ep.port), *common, "--max-running-requests", mrr)
        spec = ChildSpec(ep.name, argv, f"{ep.url}/health", ports=(ep.port,), secrets=secrets, health_headers=probe)
        children.append(spec)
    engines = [dataclasses.replace(c, kv=True) for c in children]
    return [*engines, dataclasses.replace(_router_child(t, host, port, eps), secrets=secrets)]


def _router_child(t: Topology, host: str, port: int, eps: dict[str, list[InstanceEndpoint]] | None = None) -> ChildSpec:
    """The router in front of the topology's instances on this host, with the topology's router
    settings (policies, admission, timeouts)."""
    eps = eps or endpoints(t)
    router = _cli("router", "--host", host, "--port", str(port))
    router += router_flags(t.router)
    router += ["--drain-timeout", f"{ROUTER_DRAIN_S:g}"]
    for ep in eps["prefill"]:
        router += ["--prefill", ep.url, str(ep.bootstrap_port)]
    for ep in eps["decode"]:
        router += ["--decode", ep.url]
    return ChildSpec(
        "router",
        router,
        f"http://{_client_host(host)}:{port}/readiness",
        ports=(port,),
        host=host,
        log_to_file=False,
        stop_grace_s=ROUTER_DRAIN_S + 5,
        drains=True,
        health_probe=router_has_a_pair,
    )


def router_has_a_pair(url: str, headers: Mapping[str, str] | None = None) -> bool:
    """Whether the router's /readiness at `url` counts a healthy prefill and a healthy decode worker.

    The count, not the status alone: a router may answer ready before its own probes have found the
    engines healthy, and the smoke request would then get a 503.
    """
    try:
        resp = httpx.get(url, timeout=2.0, headers=headers)
        doc = resp.json()
        return resp.status_code == 200 and int(doc["prefill"]) >= 1 and int(doc["decode"]) >= 1
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


def busy_ports(specs: list[ChildSpec]) -> list[str]:
    """One line per port a child would bind that is taken now, naming the holder."""
    problems = []
    for spec in specs:
        for port in spec.ports:
            holder = port_in_use(spec.host, port) if port else None
            if holder is not None:
                problems.append(f"port {port} ({spec.name}) is in use by {holder}")
    return problems


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def worker_key(env: Mapping[str, str]) -> str | None:
    """SGLANG_PD_WORKER_API_KEY from `env`, checked as `sglang-pd launch` checks a pod's (LaunchError
    when empty or unsendable in a header); None when unset."""
    return checked_worker_key(env, ENV_WORKER_API_KEY)


def ensure_worker_key(env: dict[str, str] | os._Environ[str]) -> str:
    """Give this run's children a worker key: a random one in `env` when none is set there (the
    children inherit it: engines then answer only the router and `up`'s probes). Returns the line
    that says the engines are keyed."""
    if ENV_WORKER_API_KEY in env:
        return f"engines are keyed: they answer only requests with the worker key ({ENV_WORKER_API_KEY})"
    env[ENV_WORKER_API_KEY] = "wk-" + secrets.token_urlsafe(24)
    return (
        "engines are keyed: a worker key was generated for this run (set "
        f"{ENV_WORKER_API_KEY} to choose it); only the router and `up` send it"
    )


def _key_probe(key: str | None) -> dict[str, str]:
    return {WORKER_AUTH_HEADER: f"Bearer {key}"} if key else {}


def _secrets(key: str | None) -> tuple[str, ...]:
    return (key,) if key else ()


def sglang_children(
    t: Topology, *, host: str, port: int, env: Mapping[str, str] | None = None, key_file: KeyFile | None = None
) -> list[ChildSpec]:
    """sglang itself from the same topology, where every instance fits this one node.

    With SGLANG_PD_WORKER_API_KEY set in `env` (default: this process's environment), each engine
    reads it from `key_file`, as `sglang-pd launch` gives it in a pod (LaunchError when the key is
    malformed or no `key_file` holds it).
    """
    from sglang_pd.deploy.sglang.render import render_plan

    check_fits_this_machine(t)
    installed = installed_options()
    if installed is None:
        raise TopologyError(
            "sglang does not import here; install it (or run a CPU topology with the reference engine)."
        )
    version, options = installed
    env = os.environ if env is None else env
    key = worker_key(env)
    probe, secrets = _key_probe(key), _secrets(key)
    children = []
    for role, cmds in render_plan(t, "127.0.0.1").items():
        for c, ep in zip(cmds, t.instance_endpoints(role), strict=True):
            # The renderer names the module and writes the deployed release's flags; this
            # process's interpreter runs it, with the flags the installed sglang accepts.
            key_args: list[str] = []
            if sglang_worker_key(c.argv, env, role) is not None:
                if key_file is None:
                    raise LaunchError(f"{ENV_WORKER_API_KEY} is set: give sglang_children the KeyFile holding it")
                key_args = key_file.args()
            argv = [sys.executable, *adapt_argv(c.argv, options, version), *key_args]
            bound = (ep.port, ep.bootstrap_port or 0)
            children.append(
                ChildSpec(
                    ep.name,
                    argv,
                    f"{ep.url}/health",
                    c.env,
                    sequential=t.colocated,
                    ports=bound,
                    secrets=secrets,
                    health_headers=probe,
                )
            )
    engines = [dataclasses.replace(c, kv=True) for c in children]
    return [*engines, dataclasses.replace(_router_child(t, host, port), secrets=secrets)]


# What Mooncake logs when it finds no free port in its range (transfer_engine_impl.cpp); sglang's own
# error after it blames the transfer engine, not the range.
MOONCAKE_NO_PORT = "No valid port found for local TCP service"


def _port_range_note(spec: ChildSpec, log_tail: str) -> str:
    """For an engine whose transfer engine found no free port: what holds Mooncake's range."""
    if not spec.kv or MOONCAKE_NO_PORT not in log_tail:
        return ""
    note = range_held_note({**os.environ, **spec.env})
    return f"\n{spec.name}: {note}" if note else ""


def check_fits_this_machine(t: Topology) -> None:
    """TopologyError unless every instance of `t` runs on this one node: `up` starts each sglang
    engine on this machine's first GPUs, which is right only where the topology shares them."""
    if not t.colocated:
        raise TopologyError(
            f"{t.name}: prefill and decode have nodes of their own (hardware.colocated is false), but up runs "
            "every engine on this machine's GPUs; run `sglang-pd launch` on each node (or use Helm), or set "
            "hardware.colocated: true for a topology whose instances share one node."
        )


def sglang_unavailable() -> str | None:
    """Why sglang cannot serve on this machine, or None: not installed, torch does not import, no CUDA device.

    Cheap: sglang is only looked up, and torch is imported only when sglang is installed.
    """
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    try:
        import torch
    except (ImportError, OSError) as exc:
        return f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is false)"
    return None


class Stack:
    """The running children: start, prefix their logs, wait for health, stop them all."""

    def __init__(
        self,
        specs: list[ChildSpec],
        *,
        out: TextIO | None = None,
        log_dir: Path | None = None,
        restart_backoff_s: float = 1.0,
        healthy_reset_s: float = HEALTHY_RESET_S,
    ) -> None:
        """`log_dir`: where children with `log_to_file` write `<name>.log` (None: all to `out`);
        `restart_backoff_s`: the first wait before `supervise` restarts a child that exited;
        `healthy_reset_s`: a child that ran this long before exiting starts its back-off again."""
        self.specs = specs
        self.procs: dict[str, Child] = {}
        self._out = out or sys.stdout
        self._print_lock = threading.Lock()
        self.stopping = threading.Event()
        self.log_dir = log_dir
        self.logs: dict[str, Path] = {}
        self._files: list[IO[bytes]] = []
        self._file_pumps: dict[str, threading.Thread] = {}
        self._started: dict[str, float] = {}
        self.restart_backoff_s = restart_backoff_s
        self.healthy_reset_s = healthy_reset_s
        self._backoff: dict[str, float] = {}
        self._restart_at: dict[str, float] = {}
        self.restarts: collections.Counter[str] = collections.Counter()
        # `up`'s own lines also go to `up.log` beside the engines' logs, in their format (JSON, ISO-8601 `ts`).
        self.events: logging.Logger | None = None
        if log_dir is not None:
            handler = logging.FileHandler(log_dir / "up.log", encoding="utf-8")
            handler.setFormatter(JsonFormatter())
            self.events = logging.Logger("sglang_pd.up")  # this stack's own: no global logger state
            self.events.addHandler(handler)

    def echo(self, line: str, file: TextIO | None = None, *, own: bool = True) -> None:
        """Print a whole line to the console (`file`: stderr, say), never interleaved with a child's
        line; `up`'s `own` lines (not a child's) are also logged to `up.log`."""
        with self._print_lock:
            print(line, file=file or self._out, flush=True)
        if own and self.events is not None:
            self.events.log(logging.WARNING if file is sys.stderr else logging.INFO, line)

    def _pump(self, child: Child, secrets: tuple[str, ...]) -> None:
        assert child.proc.stdout is not None
        width = max(len(s.name) for s in self.specs)
        for raw in iter(child.proc.stdout.readline, b""):
            line = mask_secrets(raw, secrets, API_KEY_SHOWN).decode(errors="replace").rstrip()
            self.echo(f"{child.name:<{width}} | {line}", own=False)

    def _pump_to_file(self, child: Child, sink: IO[bytes], secrets: tuple[str, ...] = (), fenced: bool = False) -> None:
        """Copy a child's output into its log file, line by line (`secrets` masked), with a note
        after the first of each of Mooncake's expected error-looking lines; echo the KV layer's
        open-ports warning unless `fenced` (this run's rules already close those ports)."""
        assert child.proc.stdout is not None
        annotator = LogAnnotator()
        with contextlib.suppress(ValueError):  # stop() closed the file while a straggler wrote
            for raw in iter(child.proc.stdout.readline, b""):
                raw = mask_secrets(raw, secrets, API_KEY_SHOWN)
                sink.write(raw)
                line = raw.decode(errors="replace").rstrip()
                note = annotator.note_for(line)
                if note:
                    sink.write(note.encode() + b"\n")
                sink.flush()  # `up` and `tail -f` read the file while the child runs
                if line.startswith('{"ts"'):  # a JSON log line (deploy/common/logs.py): its message
                    with contextlib.suppress(ValueError, AttributeError):
                        line = str(json.loads(line).get("msg", ""))
                if line.startswith(EXPOSURE_MARK) and not fenced:
                    self.echo(f"{child.name}: warning: {line.removeprefix('sglang-pd: ')}")

    def start(self) -> None:
        for i, spec in enumerate(self.specs, 1):
            self._launch(spec, f"[{i}/{len(self.specs)}] {spec.name}: starting")
            if spec.sequential:
                self._wait_healthy(spec)

    def _launch(self, spec: ChildSpec, note: str, *, append: bool = False) -> None:
        env = {**spec.env, "PYTHONUNBUFFERED": "1"}
        ports = "/".join(str(p) for p in spec.ports if p)
        note += f" on port {ports}" if ports else ""
        child = spawn(
            spec.name,
            spec.argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=False,
            group=spec.group,
        )
        if self.log_dir is not None and spec.log_to_file:
            log = self.logs[spec.name] = self.log_dir / f"{spec.name}.log"
            sink = log.open("ab" if append else "wb")
            self._files.append(sink)
            fenced = spec.group is not None
            pump = threading.Thread(target=self._pump_to_file, args=(child, sink, spec.secrets, fenced), daemon=True)
            self._file_pumps[spec.name] = pump
            pump.start()
            note += f" (log: {log})"
        else:
            threading.Thread(target=self._pump, args=(child, spec.secrets), daemon=True).start()
        self.echo(note)
        self.procs[spec.name] = child
        self._started[spec.name] = time.monotonic()

    def supervise(self) -> None:
        """Restart children that exited, each after a back-off that doubles per restart (up to
        `MAX_RESTART_BACKOFF_S`) and starts again after a run of `healthy_reset_s`. Meanwhile the
        rest keeps running: the router answers 503 while no pair is healthy and routes again once
        the restarted engine is."""
        now = time.monotonic()
        for spec in self.specs:
            child = self.procs.get(spec.name)
            if child is None or child.alive() or self.stopping.is_set():
                continue
            due = self._restart_at.get(spec.name)
            if due is None:
                if now - self._started.get(spec.name, now) >= self.healthy_reset_s:
                    self._backoff.pop(spec.name, None)  # it ran healthy for a while: no crash loop
                delay = self._backoff.get(spec.name, self.restart_backoff_s)
                self._backoff[spec.name] = min(delay * 2, MAX_RESTART_BACKOFF_S)
                self._restart_at[spec.name] = now + delay
                tail = self.log_tail(spec.name)
                where = f"; the end of {self.logs[spec.name]}:\n{tail}" if spec.name in self.logs else ""
                self.echo(
                    f"{spec.name}: exited with code {child.proc.returncode}; restarting in {delay:g} s{where}"
                    + _port_range_note(spec, tail)
                )
            elif now >= due:
                del self._restart_at[spec.name]
                child.reap()
                self.restarts[spec.name] += 1
                self._launch(spec, f"{spec.name}: restarting (restart {self.restarts[spec.name]})", append=True)

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The last lines of a child's log file ('' when it logs to the console)."""
        path = self.logs.get(name)
        if path is None or not path.exists():
            return ""
        pump = self._file_pumps.get(name)
        if pump is not None and not self.procs[name].alive():
            pump.join(timeout=2.0)  # its last lines are still on their way into the file
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _wait_healthy(self, spec: ChildSpec) -> None:
        """Block until `spec`'s child answers its health URL; a child that exits is left to wait_ready."""
        deadline = time.monotonic() + spec.ready_timeout_s
        child = self.procs[spec.name]
        while child.alive() and not self.stopping.is_set() and time.monotonic() < deadline:
            if spec.health_probe(spec.health_url, headers=spec.health_headers):
                return
            time.sleep(0.5)

    def exited(self) -> list[tuple[str, int]]:
        return [(n, c.proc.returncode) for n, c in self.procs.items() if not c.alive()]

    def wait_ready(self, timeout_s: float) -> None:
        """Poll every child's health URL until all answer 200; raise RuntimeError naming the laggard."""
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s.health_url for s in self.specs}
        by_name = {s.name: s for s in self.specs}
        last_note = time.monotonic()
        while pending:
            if self.stopping.is_set():
                raise RuntimeError("Stopped before the stack was ready.")
            dead = self.exited()
            if dead:
                name, rc = dead[0]
                tail = self.log_tail(name)
                where = f"the end of {self.logs[name]}:\n{tail}" if tail else "its log lines above"
                held = _port_range_note(by_name[name], tail)
                raise RuntimeError(f"{name} exited with code {rc} before it was ready; see {where}{held}")
            for name, url in list(pending.items()):
                if by_name[name].health_probe(url, headers=by_name[name].health_headers):
                    del pending[name]
                    took = time.monotonic() - self._started.get(name, time.monotonic())
                    self.echo(f"{name}: healthy after {took:.1f} s")
            if pending and time.monotonic() - last_note >= 5:
                last_note = time.monotonic()
                self.echo(f"waiting for {', '.join(pending)} ...")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{', '.join(pending)} not healthy after {timeout_s:.0f} s ({', '.join(pending.values())})."
                )
            time.sleep(0.25)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the children in two waves: first those that `drain` (the router, which finishes its
        in-flight requests while the engines still serve them), then the rest. A wave gets SIGTERM,
        then SIGKILL after its children's `stop_grace_s` (or `grace_s`)."""
        self.stopping.set()
        by_name = {s.name: s for s in self.specs}
        started = list(reversed(list(self.procs.items())))
        waves = [
            [(n, c) for n, c in started if n in by_name and by_name[n].drains],
            [(n, c) for n, c in started if n not in by_name or not by_name[n].drains],
        ]
        for wave in waves:
            graces = [
                grace_s if grace_s is not None else by_name[n].stop_grace_s if n in by_name else 10.0 for n, _ in wave
            ]
            live = [c for _, c in wave if c.alive()]
            if not live:
                continue
            if any(by_name[n].drains for n, _ in wave if n in by_name):
                self.echo(f"stopping {', '.join(c.name for c in live)} (up to {max(graces):g} s to drain) ...")
            for child in live:
                child.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + max(graces)
            for child in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for child in self.procs.values():
            child.reap()  # the group may hold grandchildren even once the leader is gone
        for pump in self._file_pumps.values():
            pump.join(timeout=2.0)
        for sink in self._files:
            sink.close()
        if self.events is not None:
            for handler in self.events.handlers:
                handler.close()


def _grace(spec: ChildSpec | None) -> float:
    return 10.0 if spec is None else spec.stop_grace_s


SMOKE_QUESTION = "What is the capital of France?"


class SmokeCheckFailed(RuntimeError):
    """The stack is healthy, but the chat completion `up` sends through its router failed."""


def client_api_key(env: Mapping[str, str]) -> str | None:
    """The first client key of SGLANG_PD_ROUTER_API_KEYS, split as the router splits it; None when unset."""
    keys = [k.strip() for k in env.get(ENV_ROUTER_API_KEYS, "").split(",") if k.strip()]
    return keys[0] if keys else None


def _answer_problem(resp: httpx.Response) -> str:
    """What an error answer says: its status and the OpenAI error message in its body."""
    try:
        detail = str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        detail = resp.text.strip()[:200]
    return f"the router answered {resp.status_code} {resp.reason_phrase}" + (f": {detail}" if detail else "")


def smoke_check(base: str, model: str, api_key: str | None = None, timeout_s: float = 60.0) -> str:
    """One greedy chat completion, then the same streamed, through the router: what `up` promises works.

    Returns the timing line and the exchange itself (question and answer), so a reader sees the model talk.
    `api_key`: a client key of the router. Raises SmokeCheckFailed naming what went wrong.
    """
    body = {
        "model": model,
        "messages": [{"role": "user", "content": SMOKE_QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base}/v1/chat/completions"
    try:
        t = time.monotonic()
        resp = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
        if resp.is_error:
            raise SmokeCheckFailed(_answer_problem(resp))
        plain_ms = (time.monotonic() - t) * 1e3
        try:
            answer = resp.json()
            tokens = answer["usage"]["completion_tokens"]
            reply = str(answer["choices"][0]["message"]["content"]).strip()
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SmokeCheckFailed(f"the answer is not a chat completion ({type(exc).__name__}: {exc})") from exc
        t = time.monotonic()
        chunks, done = 0, False
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=timeout_s) as streamed:
            if streamed.is_error:
                streamed.read()
                raise SmokeCheckFailed(f"streamed: {_answer_problem(streamed)}")
            for line in streamed.iter_lines():
                if line.strip() == "data: [DONE]":
                    done = True
                    break
                chunks += line.startswith("data: ")
    except httpx.TimeoutException as exc:
        raise SmokeCheckFailed(f"no answer from {url} within {timeout_s:g} s") from exc
    except httpx.HTTPError as exc:
        raise SmokeCheckFailed(f"the exchange with {url} broke off ({type(exc).__name__}: {exc})") from exc
    if not done:
        raise SmokeCheckFailed("the streamed answer ended without `data: [DONE]`")
    stream_ms = (time.monotonic() - t) * 1e3
    return (
        f"smoke: chat completion ok in {plain_ms:.0f} ms ({tokens} tokens); "
        f"streamed ok in {stream_ms:.0f} ms ({chunks} chunks)\n"
        f"Q: {SMOKE_QUESTION}\nA: {reply}"
    )


ALLOW_OPEN_FLAG = "--allow-open-kv-ports"


def fence_kv_ports(
    specs: list[ChildSpec],
    env: Mapping[str, str],
    *,
    allow_open: bool = False,
    off: bool = False,
    echo: Callable[[str], None] = print,
    path: str | None = None,
) -> tuple[list[ChildSpec], LocalFirewall | None]:
    """Install the KV ports' rules for this run, and put the engines among `specs` in the KV group.

    Returns the specs to start and the installed rules (None when the ports stay open: `off`, or
    the rules could not be installed and no worker key is set, or `allow_open`; `echo` then gets one
    warning line). Raises LaunchError when a worker key is set and the rules cannot be installed,
    and TopologyError when the rules are on and a port of the stack lies in the range (the router
    could not reach it).
    `path`: where to look for iptables (default PATH).
    """
    low, high = mooncake_port_range(dict(env))
    open_line = f"warning: the KV ports (TCP {low}-{high}, Mooncake) are open to every local process"
    if off:
        echo(f"{open_line} (--no-kv-firewall): any of them can read and overwrite the engines' KV memory.")
        return specs, None
    # The rules would reset the router's and the smoke check's connections to such a port.
    inside = [f"{p} ({s.name})" for s in specs for p in s.ports if p and low <= p <= high]
    if inside:
        raise TopologyError(
            f"port {', '.join(inside)} lies in Mooncake's port range {low}-{high}, which only the engines may "
            "reach; move it (the topology's ports, or --ports), or move the range with MC_MIN_RPC_PORT and "
            "MC_MAX_RPC_PORT."
        )
    fw = LocalFirewall((low, high), path=path)
    try:
        fw.install()  # first: as a non-root user this says so, instead of what iptables-save says
    except FirewallError as exc:
        if worker_key(env) is not None and not allow_open:
            raise LaunchError(
                f"cannot fence the KV ports (TCP {low}-{high}): {exc} A worker key is set ({ENV_WORKER_API_KEY}), "
                "but without these rules any local process can read the engines' KV memory, and so the "
                f"requests' prompts, over Mooncake; fix that, or pass {ALLOW_OPEN_FLAG} to start with them open."
            ) from exc
        echo(f"{open_line}: {exc}")
        return specs, None
    try:
        stale = remove_stale_local_chains(path)
    except FirewallError as exc:  # this run's rules are in force; only a killed run's linger
        echo(f"warning: the KV rules of earlier runs could not be removed: {exc}")
        stale = []
    if stale:
        echo(f"removed the KV rules of an earlier run that was killed: {', '.join(stale)}")
    echo(
        f"KV ports fenced: TCP {low}-{high} accepts loopback connections from the engines' group "
        f"(gid {fw.gid}) only ({fw.out_chain}, {fw.in_chain})"
    )
    return [dataclasses.replace(s, group=fw.gid) if s.kv else s for s in specs], fw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "topology",
        nargs="?",
        default=DEFAULT_TOPOLOGY,
        metavar="TOPOLOGY",
        help=f"topology YAML or preset name (default {DEFAULT_TOPOLOGY})",
    )
    parser.add_argument("--port", type=int, default=None, help="the router's port (default: the topology's)")
    parser.add_argument(
        "--ports",
        default="",
        metavar="NAME=PORT,...",
        help="engine ports instead of the topology's: prefill-0=31000,prefill-0.bootstrap=31998,decode-0=31001",
    )
    parser.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="where the engines' logs go (default: <tmp>/sglang-pd-runs/<topology>-<UTC time>)",
    )
    parser.add_argument("--host", default=None, help="the router's address (default: the topology's)")
    parser.add_argument("--ready-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--no-smoke", action="store_true", help="skip the chat requests sent once ready")
    parser.add_argument(
        "--engine",
        choices=("auto", "reference", "sglang"),
        default="auto",
        help="auto: sglang where CUDA and sglang are present, else the reference engine",
    )
    parser.add_argument(
        ALLOW_OPEN_FLAG,
        action="store_true",
        help="start even when the KV ports' rules cannot be installed while a worker key is set (unsafe: "
        "any local process can then read the engines' KV memory)",
    )
    parser.add_argument(
        "--no-kv-firewall",
        action="store_true",
        help="install no rules for the KV ports (unsafe: any local process can read and overwrite the "
        "engines' KV memory)",
    )


def run(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as cleanup:  # files this run writes for its children (the key file)
        return _run(args, cleanup)


def _run(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> int:
    t0 = time.monotonic()
    t, _ = load_checked_topology(args.topology)
    host = args.host or t.router.host
    port = args.port or t.router.port
    engine = args.engine
    # Asked only where it decides something: it imports torch, a second or more.
    missing = None if engine == "reference" or (engine == "auto" and t.is_local) else sglang_unavailable()
    if engine == "auto":
        engine = "reference" if t.is_local or missing else "sglang"
    try:
        overrides = parse_ports(args.ports)
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    asked_env = dict(os.environ)  # what the user set: a key generated below does not demand the fence
    keyed_note = ensure_worker_key(os.environ)
    if engine == "sglang":
        if overrides:
            print(
                "error: --ports applies to the reference engine; set sglang's ports in the topology.", file=sys.stderr
            )
            return EXIT_INVALID
        try:
            # What is wrong with the topology or the key is said first: it holds on any machine.
            check_fits_this_machine(t)
            worker_key(os.environ)
        except (TopologyError, LaunchError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INVALID
        if missing:
            # Started anyway, sglang fails only after a long start-up, or hangs retrying hub downloads.
            print(
                f"error: --engine sglang needs sglang and a CUDA GPU, but on this machine {missing}. Run it on a "
                "GPU machine with sglang installed, or use the reference engine on a CPU topology here: "
                "sglang-pd up local-cpu (or local-cpu-mla) --engine reference.",
                file=sys.stderr,
            )
            return EXIT_INVALID
        key = worker_key(os.environ)
        key_file = KeyFile(key) if key is not None else None
        if key_file is not None:
            cleanup.callback(key_file.remove)
        try:
            specs = sglang_children(t, host=host, port=port, key_file=key_file)
        except (TopologyError, LaunchError, SglangVersionError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INVALID
    elif not t.is_local:
        why = f"on this machine {missing}" if missing else "the reference engine runs only CPU topologies"
        print(
            f"error: {t.name} is a GPU topology ({t.hardware.gpu}) and {why}; "
            "run a CPU topology here (sglang-pd up local-cpu) or install sglang on a GPU machine.",
            file=sys.stderr,
        )
        return EXIT_INVALID
    else:
        try:
            specs = local_children(t, host=host, port=port, ports=overrides)
        except (TopologyError, LaunchError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_INVALID
    busy = busy_ports(specs)
    if busy:
        print("error: " + "; ".join(busy) + ". Stop it, or move this stack with --port / --ports.", file=sys.stderr)
        return EXIT_INVALID

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    runs = Path(tempfile.gettempdir()) / "sglang-pd-runs"
    log_dir = Path(args.log_dir) if args.log_dir else runs / f"{t.name}-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"engine logs: {log_dir}", flush=True)
    print(keyed_note, flush=True)
    # Before any engine starts, so that no moment exists in which their KV ports are open.
    try:
        specs, firewall = fence_kv_ports(
            specs,
            asked_env,
            allow_open=args.allow_open_kv_ports,
            off=args.no_kv_firewall,
            echo=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except (TopologyError, LaunchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    stack = Stack(specs, log_dir=log_dir)
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stack.stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        stack.start()
        try:
            stack.wait_ready(args.ready_timeout)
        except RuntimeError as exc:
            if received:
                return EXIT_OK
            stack.echo(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        base = f"http://{_client_host(host)}:{port}"
        body = json.dumps(
            {"model": t.model.name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
        )
        # The router (which inherits this environment) requires a client key once any is set.
        api_key = client_api_key(os.environ)
        # Through the stack's lock: the router's log lines go to the same console from another thread.
        stack.echo(f"ready in {time.monotonic() - t0:.1f} s ({engine} engine, topology {t.name})")
        stack.echo(f"OpenAI API: {base}/v1")
        if engine == "reference" and has_random_weights(t.model.path):
            stack.echo(
                f"note: {t.name}'s model, {t.model.path}, has random weights (it shows the MLA KV path): its "
                "answers are noise, not text. For a model that answers in words: make run (topology local-cpu)."
            )
        if not args.no_smoke:
            try:
                stack.echo(smoke_check(base, t.model.name, api_key))
            except SmokeCheckFailed as exc:
                stack.echo(
                    f"error: the stack is healthy, but its smoke request (a chat completion through the router) "
                    f"failed: {str(exc).rstrip('.')}. Stopping it; start with --no-smoke to skip the smoke request.",
                    file=sys.stderr,
                )
                return EXIT_FAILED
        auth = f" -H 'Authorization: Bearer <a key of {ENV_ROUTER_API_KEYS}>'" if api_key else ""
        stack.echo(f"try: curl -s {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'")
        while not stack.stopping.wait(0.5):
            stack.supervise()
        return EXIT_OK
    finally:
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        print("stopped: every child process has exited.", file=sys.stderr, flush=True)
        if firewall is not None:
            try:
                firewall.remove()
            except FirewallError as exc:  # the next `up` removes them: their pid is gone by then
                print(f"warning: the KV rules stay until the next start: {exc}", file=sys.stderr, flush=True)
