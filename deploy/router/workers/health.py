"""Health probes fitted to sglang's `/health`, the confirmation probe of a worker's 5xx, and the
stall watchdog.

sglang's `GET /health` and `GET /health_generate` are one handler, `health_generate` in
`srt/entrypoints/http_server.py`: 503 while the server starts or shuts down; otherwise it submits a
one-token generation and checks once a second whether the scheduler has sent the tokenizer manager
any output since (any request's output counts, so a busy server passes as well). 200 at the first
check that saw some, so never under 1 s; 503 after `SGLANG_HEALTH_CHECK_TIMEOUT` (20 s) with none.
Each such probe is a generation that takes 1 to 20 s, so the router runs two probes:

- The generation probe, `GET /health`, bounded by the transport's `health_generate` timeout
  (`--health-generate-timeout`, 25 s: sglang's 20 s plus margin), is sglang's own readiness
  signal. A worker is admitted (healthy) only once it passes: a new worker at its first pass, an
  ejected one after `success_threshold` passes in a row. A worker not admitted gets one every
  `interval_s`, an admitted one every `generate_interval_s`; at most one is in flight per worker.
  One failure ejects an admitted worker: sglang answers 503 only after 20 s without any output
  from its scheduler, or while it shuts down, which is its own verdict and not a blip to ride out.
- The liveness probe, `GET /v1/models`, is answered by sglang's HTTP process alone, in
  milliseconds however busy the engine is. Admitted workers get one every `interval_s`, bounded
  by the transport's `health` timeout, and it refreshes the worker's model list;
  `failure_threshold` failures in a row eject. These probes do not wait for each other (a frozen
  worker holds at most timeout / interval of them), so a frozen process is out within
  failure_threshold x interval + timeout.

A passing generation probe that admits a worker also refreshes what it reports about itself
(`/server_info`: its DP ranks; `/v1/models`), and closes its circuit breaker: the probe has just
shown it answers, and keeping it out for the rest of a breaker cooldown would turn away traffic it
can take. `start()` runs the first generation probes and waits for them at most START_WAIT_S (or
the liveness timeout, if longer): an idle sglang passes in about a second, and a router that served
before then would answer its first requests 503; a probe still running then goes on in the
background.

`confirm(worker)` is the check `legs.Legs` asks for when a worker answers a request with a 5xx:
one liveness probe right away, in the background, at most one in flight per worker (a 5xx that
arrives meanwhile shares it), booked like any liveness probe, so health and breaker agree. Not a
generation probe: a 5xx is an answer, so the question is whether the worker still answers at all,
and the verdict must not wait 1 to 20 s (nor add a generation to a worker that fails requests);
the scheduler's health is the periodic generation probe's to judge.

The watchdog ejects a worker with relayed streams open that has sent no bytes on any of them for
`stall_s`, while at least one of them has waited that long for its next bytes: a frozen engine
(SIGSTOP, a hung GPU) keeps its connections open, so nothing else notices it soon. A stream counts
from its first byte (a request queued behind a long prefill, waiting for its first token, never
does) and only while the relay waits on the worker (`legs.PairStreamOutcome`). The next passing
generation probe readmits the worker.

In a serving process of a router process group (`group.py`) the group's control process owns
health: such a checker is given `report` and runs no periodic probes; a confirmation probe's outcome
and a stall are reported to the control process (which books and publishes them), and the stall
also takes the worker out of this process at once.

A probe answered 503 with `x-sglpd-refused` (the reference engine's or a router's HTTP server at its
connection cap, common/http_limits.py) is no verdict: the worker's HTTP server is up and full, which
says nothing about its scheduler, and counting it as a failed generation probe would eject a busy
worker at once (whoever holds its connections would take it out of routing). Such a probe is not
booked; the worker keeps its state until a probe gets through. A confirmation probe so answered
counts as answering (the 5xx is not held against the worker). A plain 503 from `/health` is still
sglang's verdict and ejects.

Every change of a worker's health is logged: "worker became healthy", "worker became unhealthy"
(also when a new worker fails its first probe) and "worker ejected".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson

from ..exceptions import UpstreamError
from ..log import logger
from ..metrics import RouterMetrics
from ..transport.client import Purpose, WorkerClient
from .capacity import take_model_card, take_server_info
from .registry import Worker, WorkerRegistry

# `report(kind, worker, detail)`: a serving process's findings, for its group's control process.
HealthReport = Callable[[str, Worker, str], None]

__all__ = ["GENERATION_PROBE", "LIVENESS_PROBE", "HealthChecker", "HealthReport", "dp_ranks"]

GENERATION_PROBE = "/health"
LIVENESS_PROBE = "/v1/models"


def dp_ranks(server_info: dict[str, Any]) -> int:
    """How many DP ranks a worker's `/server_info` reports; the prefill picks one by
    `bootstrap_room % ranks`. sglang 0.5.23 counts `dp_size * attn_dp_size` ranks
    (`runtime_context.num_dp_ranks_of`; one of the two is 1) and reports DP attention as
    `dp_size=1, attn_dp_size=N`; sglang 0.5.17 has no `attn_dp_size` and reports `dp_size=N`."""

    def size(key: str) -> int:
        value = server_info.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    return size("dp_size") * size("attn_dp_size")


# How long `start()` waits for the first generation probes: an idle sglang passes in about a second.
START_WAIT_S = 5.0


class HealthChecker:
    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        client: WorkerClient,
        *,
        interval_s: float,
        failure_threshold: int,
        success_threshold: int,
        generate_interval_s: float = 30.0,
        stall_s: float = 0.0,
        report: HealthReport | None = None,
    ) -> None:
        """`stall_s`: eject a worker whose open streams got no bytes for this long (0: off).
        `report(kind, worker, detail)`: hand findings to the group's control process instead of
        probing periodically (see the module docstring). The probes' timeouts are the client's."""
        self.registry = registry
        self.metrics = metrics
        self.client = client  # shared with the proxy: closed by its owner, not here
        self.interval_s = interval_s
        self.generate_interval_s = generate_interval_s
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.stall_s = stall_s
        self.report = report
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Future[Any]] = set()
        self._generating: dict[Worker, asyncio.Task[bool]] = {}
        self._generate_due: dict[Worker, float] = {}
        self._confirming: dict[Worker, asyncio.Future[bool]] = {}
        self._closed = False
        registry.subscribe(self._on_change)

    async def start(self) -> None:
        if self.report is None:
            first = [self.generation_probe(w) for w in self.registry.all()]
            if first:
                await asyncio.wait(first, timeout=max(self.client.timeouts.health, START_WAIT_S))
            self._task = asyncio.create_task(self._loop())
        if self.stall_s > 0:
            self._watchdog = asyncio.create_task(self._watch_streams())

    async def aclose(self) -> None:
        self._closed = True
        for task in [self._task, self._watchdog, *self._pending]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _on_change(self, event: str, worker: Worker) -> None:
        if event == "added" and self.report is None and not self._closed:
            with contextlib.suppress(RuntimeError):  # no running loop: start() probes it
                asyncio.get_running_loop()
                self.generation_probe(worker)
        elif event == "removed":
            self.metrics.forget_worker(worker.role, worker.url)
            self._generate_due.pop(worker, None)
            probe = self._generating.pop(worker, None)
            if probe is not None:
                probe.cancel()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self._round(time.monotonic())
            except Exception:
                logger.exception("health check round failed")

    def _round(self, now: float) -> None:
        """Start the probes due now (see the module docstring)."""
        for worker in self.registry.all():
            if not worker.healthy or now >= self._generate_due.get(worker, 0.0):
                self.generation_probe(worker)
            if worker.healthy:
                self._spawn(self._liveness(worker))

    async def _watch_streams(self) -> None:
        period = min(0.25, self.stall_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for worker in self.registry.all():
                if not worker.healthy or not worker.streams or now - worker.last_stream_bytes <= self.stall_s:
                    continue
                waited = sum(1 for s in worker.streams if now - s.waiting_since > self.stall_s)
                if not waited:  # every quiet stream is busy sending to its client
                    continue
                reason = (
                    f"no bytes for {self.stall_s:g} s on any of its {len(worker.streams)} open stream(s), "
                    f"{waited} of them waiting on it"
                )
                self.eject(worker, reason)
                if self.report is not None:
                    self.report("stalled", worker, reason)
                worker.stream_progressed(now)  # a new stall window once it is readmitted

    def eject(self, worker: Worker, reason: str) -> None:
        """Take `worker` out of routing until a generation probe passes again."""
        worker.eject(reason)
        self.metrics.worker_healthy.labels(worker.role, worker.url).set(0)
        logger.warning("worker ejected", extra={"worker": worker.url, "role": worker.role, "error": reason})

    # -- the probes -----------------------------------------------------------------------------

    def generation_probe(self, worker: Worker) -> asyncio.Task[bool]:
        """The generation probe of `worker`, booked when it ends: the one in flight, or a new one.
        Its result is True when the worker passed."""
        task = self._generating.get(worker)
        if task is None:
            self._generate_due[worker] = time.monotonic() + self.generate_interval_s
            task = self._spawn(self._generation(worker))
            self._generating[worker] = task
            task.add_done_callback(lambda done: self._generation_ended(worker, done))
        return task

    def _generation_ended(self, worker: Worker, task: asyncio.Task[bool]) -> None:
        if self._generating.get(worker) is task:
            del self._generating[worker]

    async def check(self, worker: Worker, wait_s: float | None = None) -> bool:
        """Run (or join) `worker`'s generation probe and wait at most `wait_s` for it; True when it
        passed in that time. A probe still running goes on in the background."""
        task = self.generation_probe(worker)
        await asyncio.wait({task}, timeout=wait_s)
        return task.done() and not task.cancelled() and task.exception() is None and task.result()

    async def _generation(self, worker: Worker) -> bool:
        ok, error, _ = await self._probe(worker, GENERATION_PROBE, "health_generate")
        if ok is None:
            return False  # no verdict: not booked (see the module docstring)
        if ok and (not worker.healthy or not worker.models):
            await self._refresh_info(worker)  # before it is admitted: requests see its DP ranks
        self._book(worker, ok, error, "generation")
        return ok

    async def _liveness(self, worker: Worker) -> bool:
        ok, error, body = await self._probe(worker, LIVENESS_PROBE, "health")
        if ok is None:
            return False
        if ok:
            self._take_models(worker, body)
        self._book(worker, ok, error, "liveness")
        return ok

    def confirm(self, worker: Worker) -> asyncio.Future[bool]:
        """A liveness probe of `worker` right away, in the background (see the module docstring);
        the result is True when the worker passed. A caller while one is in flight gets that one;
        once the checker is closed (the router is stopping), the result is a cancelled future."""
        task = self._confirming.get(worker)
        if task is None and self._closed:
            task = asyncio.get_running_loop().create_future()
            task.cancel()
        elif task is None:
            task = self._spawn(self._confirm(worker))
            self._confirming[worker] = task
            task.add_done_callback(lambda _: self._confirming.pop(worker, None))
        return task

    async def _confirm(self, worker: Worker) -> bool:
        ok, error, _ = await self._probe(worker, LIVENESS_PROBE, "health")
        if ok is None:
            return True  # it answered, full: the 5xx is not the worker failing
        if self.report is None:
            self._book(worker, ok, error, "confirmation")
        else:
            self.report("probe_passed" if ok else "probe_failed", worker, error)
        return ok

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        # A fresh context: a probe's log lines must not carry the request id of the request that
        # happened to start it.
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _probe(self, worker: Worker, path: str, purpose: Purpose) -> tuple[bool | None, str, bytes]:
        """GET `path`: (passed, why not, the body); passed is None for no verdict, a 503 from the
        worker's HTTP server at its connection cap."""
        try:
            status, body, refused = await self.client.probe(worker, path, purpose)
        except UpstreamError as exc:
            return False, str(exc), b""
        if status == 503 and refused:
            logger.info(
                "health probe refused at the worker's connection cap, not counted",
                extra={"worker": worker.url, "role": worker.role, "path": path, "error": refused},
            )
            return None, f"GET {path} answered 503 ({refused})", body
        if status != 200:
            return False, f"GET {path} answered {status}", body
        return True, "", body

    # -- booking --------------------------------------------------------------------------------

    def book(self, worker: Worker, ok: bool, error: str, check: str) -> None:
        """Count a probe run elsewhere (by a serving process of the group) like one of ours."""
        self._book(worker, ok, error, check)

    def _book(self, worker: Worker, ok: bool, error: str, check: str) -> None:
        """Count a probe's outcome towards `worker`'s health, and log when that changes it.
        `check`: "generation", or "liveness" / "confirmation" (both liveness probes)."""
        was_healthy, first = worker.healthy, not worker.checked
        worker.record_probe(
            ok,
            error,
            generation=check == "generation",
            admit_after=self.success_threshold,
            eject_after=self.failure_threshold,
        )
        if self.registry.get(worker.url, worker.role) is worker:
            self.metrics.worker_healthy.labels(worker.role, worker.url).set(int(worker.healthy))
            self.metrics.breaker_state.labels(worker.role, worker.url).set(int(worker.breaker.state))
        if worker.healthy != was_healthy or (first and not ok):
            logger.log(
                logging.INFO if worker.healthy else logging.WARNING,
                "worker became " + ("healthy" if worker.healthy else "unhealthy"),
                extra={
                    "worker": worker.url,
                    "role": worker.role,
                    "error": error,
                    "check": check,
                    "consecutive_failures": worker.consecutive_health_failures,
                },
            )

    # -- what a worker reports about itself -----------------------------------------------------

    async def _refresh_info(self, worker: Worker) -> None:
        info = await self._get_json(worker, "/server_info")
        if isinstance(info, dict):
            worker.set_dp_size(dp_ranks(info))
            take_server_info(worker, info)  # how many requests and tokens it takes (capacity.py)
        ok, _, body = await self._probe(worker, LIVENESS_PROBE, "health")
        if ok:
            self._take_models(worker, body)

    def _take_models(self, worker: Worker, body: bytes) -> None:
        """The model ids of an OpenAI model list (`GET /v1/models`); a body that is none is ignored."""
        try:
            models = orjson.loads(body)
        except ValueError:
            return
        if isinstance(models, dict) and isinstance(models.get("data"), list):
            cards = [m for m in models["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
            worker.take_models([m["id"] for m in cards])
            for card in cards:
                take_model_card(worker, card)

    async def _get_json(self, worker: Worker, path: str) -> Any:
        ok, error, body = await self._probe(worker, path, "health")
        if ok:
            with contextlib.suppress(ValueError):
                return orjson.loads(body)
        logger.debug("worker info request failed", extra={"worker": worker.url, "path": path, "error": error})
        return None
