"""asyncio helpers for the two legs of a PD request: cancel them without losing an outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

__all__ = ["cancel_legs", "finished_ok", "first_done"]


def cancel_legs(*tasks: asyncio.Future[Any]) -> None:
    """Cancel unfinished legs and retrieve every outcome: a leg that turns its cancellation into
    an error (a client timeout racing the cancel) must not log "exception was never retrieved"."""
    for task in tasks:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)
        else:
            _retrieve(task)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def finished_ok(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def first_done(
    loop: asyncio.AbstractEventLoop, futures: Collection[asyncio.Future[Any]], timeout: float
) -> set[asyncio.Future[Any]]:
    """The done set of `asyncio.wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)`, on a
    loop the caller holds: asyncio.wait asks for the running loop, a getpid() system call each time
    on Python 3.11 (transport/http1.py says what that cost). Cancelling the caller cancels only the
    wait, as with asyncio.wait."""
    done = {f for f in futures if f.done()}
    if done or timeout <= 0:
        return done
    waiter: asyncio.Future[None] = loop.create_future()

    def wake(_: object) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, wake, None)
    for f in futures:
        f.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        for f in futures:
            f.remove_done_callback(wake)
    return {f for f in futures if f.done()}
