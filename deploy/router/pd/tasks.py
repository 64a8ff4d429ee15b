"""asyncio helpers for the two legs of a PD request: cancel them without losing an outcome."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["cancel_legs", "finished_ok"]


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
