"""The control channel of a router process group (`group.py`): one JSON object a line over a Unix
socket pair between the control process, which owns the workers' health, and each serving process
(the serving process inherits its end: no socket path, nothing another process could connect to).

    control → serving   {"type": "workers", "workers": [Worker.state(), ...], "rollout": Rollout.state()}
                            on attach, then whenever the workers, their health or the approved
                            revision change
                        {"type": "reply", "id": N, "status": S, "body": {...}}
                            the answer to a request; sent after the "workers" it caused
    serving → control   {"type": "alive", "index": I, "pid": P}
                            on attach, then every second from its event loop (a process whose
                            loop stops, frozen or stuck, stops sending it)
                        {"type": "request", "id": N, "op": "add" | "remove" | "approve", "args": {...}}
                            a /workers change or a revision's approval made through this process's
                            admin API
                        {"type": "report", "kind": "probe_passed" | "probe_failed" | "stalled",
                         "url": U, "role": R, "detail": TEXT}
                            what this process saw of a worker: the outcome of a 5xx-confirmation
                            probe, or its open streams stalled

A serving process that loses the channel drains and exits (the group restarts it): without the
authority its view of the workers would go stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ..exceptions import ControlLost
from ..log import logger
from ..workers.registry import Worker

__all__ = ["HEARTBEAT_S", "ControlLink", "ControlServer"]

# One line holds every worker's state; far above what thousands of workers need.
_LINE_LIMIT = 16 * 1024 * 1024
# How often a serving process says it is alive; the control process kills one silent for
# several of these (group.py).
HEARTBEAT_S = 1.0
# A /workers change waits for the new worker's first probe in the control process, at most the
# health timeout (5 s by default).
_REQUEST_TIMEOUT_S = 30.0

Handler = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
ReportHandler = Callable[[str, str, str, str], None]


def _line(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message) + b"\n"


class ControlServer:
    """The control process's end: serves the socket of each serving process it is given
    (`attach`), sends the workers' state to every one and runs their requests (`handle(op, args)`
    → status, body) and reports (`on_report(kind, url, role, detail)`)."""

    def __init__(
        self,
        *,
        state: Callable[[], list[dict[str, Any]]],
        handle: Handler,
        on_report: ReportHandler,
        on_alive: Callable[[int, int], None],
        rollout: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`rollout`: the approval the serving processes follow (`Rollout.state()`)."""
        self._state = state
        self._rollout = rollout
        self._handle = handle
        self._on_report = on_report
        self._on_alive = on_alive
        self._writers: set[asyncio.StreamWriter] = set()
        self._last = b""
        self._tasks: set[asyncio.Task[Any]] = set()

    async def attach(self, sock: socket.socket) -> None:
        """Serve a serving process's channel: our end of its socket pair."""
        reader, writer = await asyncio.open_connection(sock=sock, limit=_LINE_LIMIT)
        task = asyncio.create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for writer in list(self._writers):
            writer.close()
        for task in list(self._tasks):
            task.cancel()

    def publish(self) -> None:
        """Send the workers' state to every serving process, if it changed since the last send."""
        message: dict[str, Any] = {"type": "workers", "workers": self._state()}
        if self._rollout is not None:
            message["rollout"] = self._rollout()
        line = _line(message)
        if line == self._last:
            return
        self._last = line
        for writer in list(self._writers):
            writer.write(line)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Changes not yet published go to the others first: the newcomer's copy of the state must
        # not become the "last sent" that they never received.
        self.publish()
        writer.write(self._last)
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                message = orjson.loads(line)
                kind = message.get("type")
                if kind == "request":
                    task = asyncio.create_task(self._answer(writer, message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif kind == "report":
                    self._on_report(message["kind"], message["url"], message["role"], message.get("detail", ""))
                    self.publish()
                elif kind == "alive":
                    self._on_alive(int(message["index"]), int(message["pid"]))
        except (ConnectionError, ValueError, KeyError) as exc:
            logger.warning("control channel: dropped a serving process's connection", extra={"error": repr(exc)})
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        try:
            status, body = await self._handle(message["op"], message.get("args") or {})
        except Exception as exc:
            logger.exception("control channel: request failed", extra={"op": message.get("op")})
            status, body = 500, {"message": f"The control process failed the request: {type(exc).__name__}."}
        self.publish()  # the change reaches the caller before its reply does
        if not writer.is_closing():
            writer.write(_line({"type": "reply", "id": message["id"], "status": status, "body": body}))


class ControlLink:
    """A serving process's end: applies the workers' state it is sent (`on_workers`), sends
    requests and reports."""

    def __init__(
        self,
        sock: socket.socket,
        index: int,
        on_workers: Callable[[list[dict[str, Any]]], None],
        on_lost: Callable[[], None] | None = None,
        on_rollout: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """`sock`: this process's end of its socket pair. `on_lost`: what to do when the channel
        breaks (default: SIGTERM to this process, which drains it). `on_rollout`: takes the approval
        the control process holds."""
        self._on_rollout = on_rollout
        self.sock = sock
        self.index = index
        self._on_workers = on_workers
        self._on_lost = on_lost or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, dict[str, Any]]]] = {}
        self._ids = itertools.count(1)
        self._first: asyncio.Future[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._closing = False

    async def connect(self, timeout_s: float = 10.0) -> None:
        """Connect, introduce this process and wait for the first workers' state."""
        reader, writer = await asyncio.open_connection(sock=self.sock, limit=_LINE_LIMIT)
        self._writer = writer
        self._first = asyncio.get_running_loop().create_future()
        self._reader_task = asyncio.create_task(self._read(reader))
        self._heartbeat = asyncio.create_task(self._beat(writer))
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(self._first)

    async def aclose(self) -> None:
        self._closing = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task

    async def _beat(self, writer: asyncio.StreamWriter) -> None:
        alive = _line({"type": "alive", "index": self.index, "pid": os.getpid()})
        while not writer.is_closing():
            writer.write(alive)
            await asyncio.sleep(HEARTBEAT_S)

    async def request(self, op: str, timeout_s: float = _REQUEST_TIMEOUT_S, **args: Any) -> tuple[int, dict[str, Any]]:
        """Run `op` in the control process; its (status, body). ControlLost when the control
        process is gone or has not answered within `timeout_s`."""
        if self._writer is None or self._writer.is_closing():
            raise ControlLost("The router's control process is not reachable from this process.")
        request_id = next(self._ids)
        future = self._pending[request_id] = asyncio.get_running_loop().create_future()
        self._writer.write(_line({"type": "request", "id": request_id, "op": op, "args": args}))
        try:
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            raise ControlLost(f"The router's control process did not answer within {timeout_s:g} s.") from None
        finally:
            self._pending.pop(request_id, None)

    def report(self, kind: str, worker: Worker, detail: str) -> None:
        if self._writer is not None and not self._writer.is_closing():
            message = {"type": "report", "kind": kind, "url": worker.url, "role": worker.role, "detail": detail}
            self._writer.write(_line(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                message = orjson.loads(line)
                if message["type"] == "workers":
                    self._on_workers(message["workers"])
                    if self._on_rollout is not None and "rollout" in message:
                        self._on_rollout(message["rollout"])
                    if self._first is not None and not self._first.done():
                        self._first.set_result(None)
                elif message["type"] == "reply":
                    future = self._pending.get(message["id"])
                    if future is not None and not future.done():
                        future.set_result((message["status"], message["body"]))
        except (ConnectionError, ValueError, KeyError) as exc:
            logger.error("control channel broke", extra={"error": repr(exc)})
        if self._writer is not None:
            self._writer.close()  # later requests fail at once instead of waiting for a reply
        lost = ControlLost("The router's control process went away.")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(lost)
        if self._first is not None and not self._first.done():
            self._first.set_exception(lost)
        if not self._closing:
            logger.error("lost the router's control process; draining and exiting", extra={"index": self.index})
            self._on_lost()
