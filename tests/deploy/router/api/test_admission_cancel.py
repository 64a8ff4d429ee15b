"""Admission under cancellation: a queued request whose client leaves in the same loop step as a
slot frees for it never runs, and the slot goes on to the next request in the queue."""

from __future__ import annotations

import asyncio
from typing import Any

from sglang_pd.deploy.router.api.middleware.admission import AdmissionMiddleware
from sglang_pd.deploy.router.metrics import RouterMetrics

PATH = "/v1/chat/completions"


async def _nothing() -> dict[str, Any]:
    return {"type": "http.disconnect"}


async def _ignore(_message: Any) -> None:
    return None


def _scope(name: str) -> dict[str, Any]:
    return {"type": "http", "path": PATH, "name": name}


async def _slot_frees_as_the_queued_client_leaves() -> dict[str, Any]:
    ran: list[str] = []
    release_first = asyncio.Event()
    tasks: dict[str, asyncio.Task[None]] = {}

    async def app(scope: Any, _receive: Any, _send: Any) -> None:
        ran.append(scope["name"])
        if scope["name"] == "first":
            await release_first.wait()
            # The queued client's disconnect lands in the very step in which this request hands its
            # slot over (the middleware releases it as `app` returns): the race CPython gh-86296
            # lets asyncio.wait_for lose on Python 3.11.
            asyncio.get_running_loop().call_soon(tasks["queued"].cancel)

    admission = AdmissionMiddleware(
        app, paths=frozenset({PATH}), max_concurrent=1, max_queued=4, queue_timeout_s=30, metrics=RouterMetrics()
    )
    for name in ("first", "queued", "next"):
        tasks[name] = asyncio.create_task(admission(_scope(name), _nothing, _ignore))
        await asyncio.sleep(0)
    assert ran == ["first"] and len(admission._waiters) == 2
    release_first.set()
    outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
    return {
        "ran": ran,
        "outcomes": dict(zip(tasks, (type(o).__name__ if o else "ok" for o in outcomes), strict=True)),
        "active": admission.active,
        "waiters": len(admission._waiters),
    }


def test_a_queued_request_cancelled_as_its_slot_arrives_never_runs_and_passes_the_slot_on() -> None:
    got = asyncio.run(_slot_frees_as_the_queued_client_leaves())
    assert got["outcomes"] == {"first": "ok", "queued": "CancelledError", "next": "ok"}, got
    assert got["ran"] == ["first", "next"], got  # the departed client's request never reached the app
    assert got["active"] == 0 and got["waiters"] == 0, got
