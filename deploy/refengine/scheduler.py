"""Which requests run: sglang's running batch and waiting queue, as far as a client can tell.

At most `--max-running-requests` requests run; the others wait in arrival order (sglang's waiting
queue) instead of being refused. sglang refuses a request only when `--max-queued-requests` is set
and its waiting queue is full, and only when it serves alone: the option "is ignored when using
disaggregation-mode" (`server_args.py`; `Scheduler._add_request_to_queue` checks it for
`DisaggregationMode.NULL` only). The refusal is an abort with status 503 and the message
"The request queue is full." (`Scheduler._abort_on_queued_limit`), which sglang's HTTP layer
answers with a 503 to a unary request and as the first event of a stream (`server.py`).

The reference engine's CLI has no `--max-queued-requests` flag; `SGLANG_PD_REFENGINE_MAX_QUEUED_REQUESTS`
sets it instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from typing import Protocol

from .exceptions import RequestFailed

__all__ = ["ENV_MAX_QUEUED_REQUESTS", "QUEUE_FULL", "QueueFull", "Scheduler", "SlotHolder", "max_queued_from_env"]

ENV_MAX_QUEUED_REQUESTS = "SGLANG_PD_REFENGINE_MAX_QUEUED_REQUESTS"
QUEUE_FULL = "The request queue is full."  # sglang's words (`_abort_on_queued_limit`)


class QueueFull(RequestFailed):
    """The waiting queue is full (sglang's 503 abort); answered in sglang's shapes by `server.py`."""

    def __init__(self) -> None:
        super().__init__(QUEUE_FULL, 503)


def max_queued_from_env() -> int | None:
    """`--max-queued-requests` as the environment sets it; None (unbounded, sglang's default) when unset."""
    raw = os.environ.get(ENV_MAX_QUEUED_REQUESTS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_MAX_QUEUED_REQUESTS} has value {raw!r}; set it to a whole number >= 0, or unset it.")
    return value


class SlotHolder(Protocol):
    """A request as the scheduler sees it: whether it holds a running slot."""

    running: bool


class Scheduler:
    """Running slots handed out in arrival order; `max_queued` (None: unbounded) bounds the wait."""

    def __init__(self, max_running: int, max_queued: int | None) -> None:
        self.max_running = max(1, max_running)
        self.max_queued = max_queued
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, holder: SlotHolder) -> None:
        """Wait for a running slot and mark `holder` as holding it (at once, so that a request
        cancelled right after still gives it back); raises QueueFull when the request would wait
        beyond `max_queued`."""
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            holder.running = True
            return
        # sglang: `len(waiting_queue) + 1 <= max_queued_requests`, else this request is aborted.
        if self.max_queued is not None and len(self._waiting) + 1 > self.max_queued:
            raise QueueFull()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over as the wait was given up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):  # `release` may have dropped it already
                    self._waiting.remove(waiter)
            raise
        holder.running = True

    def release(self) -> None:
        """A running request ended: its slot goes to the longest waiting request, if any."""
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
