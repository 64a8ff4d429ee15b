"""`tasks.first_done` answers as `asyncio.wait(..., return_when=FIRST_COMPLETED)` does, on the loop
the caller passes, and leaves no callback on the futures it watched."""

from __future__ import annotations

import asyncio
from typing import Any

from sglang_pd.deploy.router.pd.tasks import first_done


async def _both(futures: list[asyncio.Future[Any]], timeout: float) -> tuple[set[Any], set[Any]]:
    loop = asyncio.get_running_loop()
    ours = await first_done(loop, futures, timeout)
    theirs, _ = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    return ours, theirs


def test_the_first_future_to_finish_ends_the_wait() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        slow, fast = loop.create_future(), loop.create_future()
        loop.call_later(0.01, fast.set_result, 1)
        ours, theirs = await _both([slow, fast], 5.0)
        assert ours == theirs == {fast}
        slow.cancel()

    asyncio.run(main())


def test_nothing_done_within_the_timeout_is_an_empty_set() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        never = loop.create_future()
        ours, theirs = await _both([never], 0.02)
        assert ours == theirs == set()
        never.cancel()

    asyncio.run(main())


def test_futures_done_already_are_returned_without_waiting() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        done, pending = loop.create_future(), loop.create_future()
        done.set_result(None)
        started = loop.time()
        ours, theirs = await _both([done, pending], 5.0)
        assert ours == theirs == {done} and loop.time() - started < 1.0
        pending.cancel()

    asyncio.run(main())


def test_a_wait_leaves_no_callback_behind_when_it_ends_or_is_cancelled() -> None:
    # asyncio's Future lists its callbacks in `_callbacks` (read by asyncio's own repr).
    async def main() -> None:
        loop = asyncio.get_running_loop()
        watched, other = loop.create_future(), loop.create_future()
        waiting = loop.create_task(first_done(loop, [watched, other], 5.0))
        await asyncio.sleep(0)
        assert len(watched._callbacks) == 1  # the control: one while the wait runs
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled() and not watched._callbacks and not other._callbacks
        ended = loop.create_task(first_done(loop, [watched, other], 5.0))
        await asyncio.sleep(0)
        other.set_result(None)
        assert await ended == {other} and not watched._callbacks
        watched.cancel()

    asyncio.run(main())
