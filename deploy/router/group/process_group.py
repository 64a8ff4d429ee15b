"""`sglang-pd router --processes N`: N serving processes on one port, led by one control process.

One router process serves on one core: most of its CPU per request is the event loop's own
socket work (py-spy on benchmarks/bench_router.py). A group spreads the connections over N
processes; each listens on its own socket bound to the same port with SO_REUSEPORT, and the
kernel spreads new connections over them (Linux socket(7)).

What the processes share, and how:

- The workers and their health: the control process is the one authority. It runs the health
  checks, Kubernetes discovery and every /workers change, and sends the workers' state to each
  serving process over the control channel (`control.py`); serving processes report back what
  they see (5xx-confirmation probes, streams that stalled). A /workers call reaches
  any serving process and is carried out by the control process.
- Metrics: every serving process writes to PROMETHEUS_MULTIPROC_DIR (`metrics.py`); a scrape of
  any of them shows the whole group.
- Admission limits: split between the processes, the shares adding up to the limits (a limit
  below N is refused at start). Connections are spread by hash, not by load: one process may
  answer 429 while another still has room.

Not shared: circuit breakers and in-flight counts are per serving process, over the traffic it
sees (a dead worker's transport errors reach every process within a request or two anyway).

The control process binds every socket before anything else, so a port in use is one clear error
before anything starts, and hands each, bound but not listening, to its serving process, which
listens once it is ready to serve; then it closes its own copy (a serving process that exits
takes its socket and its backlog with it, and the kernel sends new connections to the others).
Each serving process gets its configuration (keys included) through a pipe and its control
channel as an inherited socket: no key is in a file, only the metrics are. A serving process that
dies is restarted on a new socket with back-off; one that exits before it ever connected (it
cannot start at all), or fails five times in a row within 30 s of its start, stops the group with
its exit status. One that stops sending its heartbeat (its event loop froze) is killed and
restarted, so that the connections the kernel hashes to its socket do not hang. SIGTERM or SIGINT
drains: each serving process gets SIGTERM and the drain time; a second signal ends them without
waiting.

SO_REUSEPORT lets any process of the same user bind the same port while the group runs and take
a share of its connections: run the router under its own user (the chart runs it as nobody).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.multiprocess import mark_process_dead

from sglang_pd.deploy.common.contract import as_role
from sglang_pd.deploy.common.procs import Child, port_in_use, spawn

from ..config import KubernetesDiscoveryConfig, RouterConfig
from ..exceptions import WorkerRegistrationError
from ..log import configure_logging, logger
from ..metrics import RouterMetrics
from ..transport.client import HttpWorkerClient
from ..workers.discovery import KubernetesDiscovery
from ..workers.health import HealthChecker
from ..workers.hosts import WorkerHosts
from ..workers.registry import WorkerRegistry, add_configured
from ..workers.rollout import Rollout
from .control import HEARTBEAT_S, ControlServer

__all__ = ["ProcessGroup", "split_limits"]

_FIRST_RESTART_DELAY_S = 0.5
_MAX_RESTART_DELAY_S = 10.0
_STABLE_S = 30.0  # a process that ran this long is restarted after the first delay again
_MAX_QUICK_FAILURES = 5  # then the group stops: a process that cannot stay up will not start to
_SILENT_S = 5 * HEARTBEAT_S  # then a serving process counts as stuck and is killed
_START_S = 60.0  # a serving process must connect within this of its start
_PUBLISH_PERIOD_S = 0.05  # how often the control process looks for health changes to send
_SUPERVISE_PERIOD_S = 0.1


@dataclass
class _Slot:
    """One serving process's place in the group, across its restarts."""

    index: int
    child: Child | None = None
    sock: socket.socket | None = None  # bound for the next start, not yet handed over
    starts: int = 0
    started_at: float = 0.0
    connected: bool = False
    alive_at: float = 0.0  # its last heartbeat on the control channel
    quick_failures: int = 0  # exits in a row, each within _STABLE_S of its start
    delay_s: float = _FIRST_RESTART_DELAY_S
    restart_at: float | None = None


class ProcessGroup:
    """The control process. Constructing it checks the configuration (as a single router's
    RouterApp does); `serve()` runs the group until it is stopped."""

    def __init__(self, config: RouterConfig, *, worker_api_key: str, processes: int) -> None:
        limit = config.max_concurrent_requests
        if 0 < limit < processes:
            raise ValueError(
                f"--max-concurrent-requests {limit} is below --processes {processes}: each serving process "
                "needs at least one slot. Raise the limit or run fewer processes."
            )
        self.config = config
        self.processes = processes
        self.worker_api_key = worker_api_key
        self.registry = WorkerRegistry(
            breaker_failure_threshold=config.breaker_failure_threshold,
            breaker_cooldown_s=config.breaker_cooldown_s,
            allow_link_local=config.allow_link_local_workers,
        )
        add_configured(self.registry, config)
        self.worker_hosts = WorkerHosts.of(config)  # where POST /workers may register workers
        self.client = HttpWorkerClient(timeouts=config.timeouts, api_key=worker_api_key)
        self.health = HealthChecker(
            self.registry,
            RouterMetrics(),  # the serving processes export metrics; these stay unread
            self.client,
            interval_s=config.health_interval_s,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
            generate_interval_s=config.health_generate_interval_s,
        )
        self.discovery = (
            KubernetesDiscovery(self.registry, config.kubernetes) if config.kubernetes is not None else None
        )
        # The approved revision the serving processes follow (workers/rollout.py); approvals are made here.
        self.rollout = Rollout(self.registry)
        if config.approved_revision:
            self.rollout.approve(config.approved_revision, reason="--approved-revision")
        self.server = ControlServer(
            state=lambda: [w.state() for w in self.registry.all()],
            rollout=self._rollout_state,
            handle=self._handle,
            on_report=self._on_report,
            on_alive=self._on_alive,
        )
        self.slots = [_Slot(i) for i in range(processes)]
        self.stopping = False
        self.status = 0
        self._kill_at = math.inf

    def serve(self) -> int:
        """Start the serving processes and lead them until SIGTERM/SIGINT; the exit status."""
        import uvloop

        configure_logging(self.config.log_level, {"router_process": "control"})
        where = f"{self.config.host}:{self.config.port}"
        owner = port_in_use(self.config.host, self.config.port)
        if owner is not None:
            print(f"sglang-pd router: {where} is in use by {owner}. Stop that process or pass --port.", file=sys.stderr)
            return 2
        try:
            # Every socket is bound now, before anything slow (the first health check), so that
            # the port is ours from here on.
            for slot in self.slots:
                slot.sock = _bind(self.config.host, self.config.port)
        except OSError as exc:
            self._close_sockets()
            print(f"sglang-pd router: cannot bind {where}: {exc}. Pass another --port.", file=sys.stderr)
            return 2
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="sglang-pd-router-metrics-"))
        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(self._run())
        finally:
            self._close_sockets()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self.health.start()
        if self.stopping:  # stopped during the first health check: nothing was started
            return self.status
        if self.discovery is not None:
            self.discovery.start(loop)
        publisher = asyncio.create_task(self._publish_every(_PUBLISH_PERIOD_S))
        try:
            for slot in self.slots:
                await self._start(slot)
            logger.info(
                "router process group started",
                extra={"processes": self.processes, "host": self.config.host, "port": self.config.port},
            )
            return await self._supervise()
        finally:
            for slot in self.slots:
                if slot.child is not None:
                    slot.child.reap()
            publisher.cancel()
            await self.server.aclose()
            if self.discovery is not None:
                await asyncio.to_thread(self.discovery.stop)
            await self.health.aclose()
            await self.client.aclose()

    # -- serving processes ----------------------------------------------------------------------

    async def _start(self, slot: _Slot) -> None:
        slot.restart_at = None
        if slot.sock is None:
            try:
                slot.sock = _bind(self.config.host, self.config.port)
            except OSError as exc:
                self._schedule_restart(slot, f"cannot bind {self.config.host}:{self.config.port}: {exc}")
                return
        sock, slot.sock = slot.sock, None
        ours, theirs = socket.socketpair()
        config_read, config_write = os.pipe()
        try:
            argv = [
                sys.executable, "-m", __name__, "--index", str(slot.index), "--listen-fd", str(sock.fileno()),
                "--control-fd", str(theirs.fileno()), "--config-fd", str(config_read),
            ]  # fmt: skip
            slot.child = spawn(
                f"router-{slot.index}",
                argv,
                env={"PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)},
                pass_fds=[sock.fileno(), theirs.fileno(), config_read],
            )
        finally:
            # The serving process holds these now. Closing our copy of the listening socket
            # matters: a socket that outlives its process would keep taking connections.
            sock.close()
            theirs.close()
            os.close(config_read)
        # The configuration, keys included, goes through a pipe: in no file, in no process listing.
        member = {"config": dataclasses.asdict(self.config), "worker_api_key": self.worker_api_key,
                  "processes": self.processes}  # fmt: skip
        with open(config_write, "wb") as pipe:
            pipe.write(orjson.dumps(member))
        await self.server.attach(ours)
        slot.starts += 1
        slot.connected = False
        slot.started_at = asyncio.get_running_loop().time()

    def _schedule_restart(self, slot: _Slot, reason: str) -> None:
        now = asyncio.get_running_loop().time()
        if slot.started_at and now - slot.started_at >= _STABLE_S:
            slot.delay_s = _FIRST_RESTART_DELAY_S
        slot.restart_at = now + slot.delay_s
        extra = {"index": slot.index, "reason": reason, "in_s": slot.delay_s}
        logger.warning("serving process is down; restarting it", extra=extra)
        slot.delay_s = min(slot.delay_s * 2, _MAX_RESTART_DELAY_S)

    async def _supervise(self) -> int:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_SUPERVISE_PERIOD_S)
            for slot in self.slots:
                child = slot.child
                if child is not None and not child.alive():
                    self._exited(slot, child)
                elif child is not None and not self.stopping:
                    self._kill_if_stuck(slot, child, loop.time())
                restart_at = slot.restart_at
                if slot.child is None and restart_at is not None and loop.time() >= restart_at and not self.stopping:
                    await self._start(slot)
            if self.stopping and all(slot.child is None for slot in self.slots):
                return self.status
            if loop.time() >= self._kill_at:
                for slot in self.slots:
                    if slot.child is not None:
                        logger.error("serving process did not drain in time; killing it", extra={"index": slot.index})
                        slot.child.kill()
                self._kill_at = math.inf

    def _kill_if_stuck(self, slot: _Slot, child: Child, now: float) -> None:
        """A serving process whose event loop stopped (SIGSTOP, a blocking bug) still holds its
        socket: the connections the kernel gives it would hang. Kill it; it is restarted."""
        if slot.connected and now - slot.alive_at > _SILENT_S:
            reason = f"sent no heartbeat for {_SILENT_S:g} s"
        elif not slot.connected and now - slot.started_at > _START_S:
            reason = f"did not connect within {_START_S:g} s of its start"
        else:
            return
        logger.error("serving process is stuck; killing it", extra={"index": slot.index, "reason": reason})
        child.kill()

    def _exited(self, slot: _Slot, child: Child) -> None:
        code = child.proc.returncode
        slot.child = None
        with contextlib.suppress(OSError):
            mark_process_dead(child.pid, str(self.metrics_dir))  # its live gauges leave the sums
        if self.stopping:
            if code != 0:
                self.status = 1
            return
        ran_s = asyncio.get_running_loop().time() - slot.started_at
        slot.quick_failures = slot.quick_failures + 1 if ran_s < _STABLE_S else 0
        extra = {"index": slot.index, "status": code, "ran_s": round(ran_s, 1)}
        if slot.starts == 1 and not slot.connected:
            logger.error("serving process could not start; stopping the router (see its lines above)", extra=extra)
        elif slot.quick_failures >= _MAX_QUICK_FAILURES:
            logger.error(
                f"serving process failed {slot.quick_failures} times in a row, each within {_STABLE_S:g} s of its "
                "start; stopping the router (see its lines above)",
                extra=extra,
            )
        else:
            self._schedule_restart(slot, f"exited with status {code}")
            return
        self.status = code if code > 0 else 1
        self._stop()

    def _on_alive(self, index: int, pid: int) -> None:
        slot = self.slots[index]
        if slot.child is not None and slot.child.pid == pid:
            slot.connected = True
            slot.alive_at = asyncio.get_running_loop().time()

    def _on_signal(self, sig: int) -> None:
        if self.stopping:  # a second signal: stop without waiting for the drain
            for slot in self.slots:
                if slot.child is not None:
                    slot.child.proc.send_signal(signal.SIGTERM)
            return
        logger.info("draining", extra={"signal": sig, "deadline_s": self.config.drain_timeout_s})
        self._stop()

    def _stop(self) -> None:
        self.stopping = True
        self._kill_at = asyncio.get_running_loop().time() + self.config.drain_timeout_s + 10.0
        for slot in self.slots:
            slot.restart_at = None
            if slot.child is not None:
                slot.child.proc.send_signal(signal.SIGTERM)

    def _close_sockets(self) -> None:
        for slot in self.slots:
            if slot.sock is not None:
                slot.sock.close()
                slot.sock = None

    # -- the control channel --------------------------------------------------------------------

    async def _publish_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.server.publish()

    async def _handle(self, op: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """A /workers change sent by a serving process (which validated its fields)."""
        try:
            if op == "add":
                worker = self.registry.add(
                    args["url"], args["role"], bootstrap_port=args.get("bootstrap_port"), source="api",
                    revision=args.get("revision"), hosts=self.worker_hosts,
                )  # fmt: skip
                await self.health.check(worker, wait_s=self.config.health_timeout_s)
                return 201, worker.state()
            if op == "approve":
                revision = args["revision"]
                if (why := self.rollout.approvable(revision)) is not None:
                    return 409, {"message": why, "param": "revision", "code": "not_paired"}
                self.rollout.approve(revision)
                return 200, self.rollout.state()
            if op == "remove":
                removed = self.registry.remove(args["url"], args.get("role"))
                if not removed:
                    message = f"No worker {args['url']} is registered. See GET /workers."
                    return 404, {"message": message, "param": "url", "code": "not_found"}
                return 200, {"removed": [w.state() for w in removed]}
        except WorkerRegistrationError as exc:
            return 400, {"message": str(exc), "param": "url", "code": "invalid_value"}
        return 400, {"message": f"Unknown control operation {op!r}.", "code": "invalid_value"}

    def _rollout_state(self) -> dict[str, Any]:
        self.rollout.current()  # as a serving process does on a request: the first revision with a pair
        return self.rollout.state()

    def _on_report(self, kind: str, url: str, role: str, detail: str) -> None:
        pd_role = as_role(role)
        if pd_role is None:  # a serving process reports only workers it was sent
            return
        with contextlib.suppress(WorkerRegistrationError):
            worker = self.registry.get(url, pd_role)
            if worker is None:
                return
            if kind in ("probe_passed", "probe_failed"):
                self.health.book(worker, kind == "probe_passed", detail, "confirmation")
            elif kind == "stalled" and worker.healthy:
                self.health.eject(worker, detail)


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to the router's port beside the group's others (SO_REUSEPORT), not yet
    listening: the serving process listens once it is ready to serve, so the kernel sends it no
    connection before then (asyncio's create_server calls listen())."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _config_from_json(data: dict[str, Any]) -> RouterConfig:
    k8s = data.pop("kubernetes")
    return RouterConfig(
        **{
            **data,
            "kubernetes": KubernetesDiscoveryConfig(**k8s) if k8s is not None else None,
            "api_keys": tuple(data["api_keys"]),
            "prefill_workers": tuple((url, port) for url, port in data["prefill_workers"]),
            "decode_workers": tuple(data["decode_workers"]),
            "worker_hosts": tuple(data["worker_hosts"]),
        }
    )


def split_limits(config: RouterConfig, processes: int, index: int) -> RouterConfig:
    """Serving process `index`'s share of the router's admission limits: the shares add up to the
    limits exactly (0 stays "no limit" for the concurrency, "no queue" for the queue)."""

    def share(total: int) -> int:
        return total // processes + (1 if index < total % processes else 0)

    return dataclasses.replace(
        config,
        max_concurrent_requests=share(config.max_concurrent_requests),
        max_queued_requests=share(config.max_queued_requests),
    )


def _serve_member(argv: list[str] | None = None) -> int:
    """A serving process of a group, as the control process starts it."""
    from ..app import RouterApp
    from ..server import serve
    from .member import GroupMember

    parser = argparse.ArgumentParser(prog="sglang-pd router (serving process)")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True, help="the bound socket to serve on")
    parser.add_argument("--control-fd", type=int, required=True, help="this process's end of the control channel")
    parser.add_argument("--config-fd", type=int, required=True, help="a pipe with the configuration")
    args = parser.parse_args(argv)
    with open(args.config_fd, "rb") as pipe:
        member = orjson.loads(pipe.read())
    config = split_limits(_config_from_json(member["config"]), member["processes"], args.index)
    app = RouterApp(
        config,
        worker_api_key=member["worker_api_key"],
        owner=GroupMember(socket.socket(fileno=args.control_fd), args.index),
    )
    return serve(app, sockets=[socket.socket(fileno=args.listen_fd)])


if __name__ == "__main__":
    sys.exit(_serve_member())
