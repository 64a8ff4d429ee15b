"""Ask every question with bounded concurrency, score the answers, and keep one record per question."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tqdm import tqdm

from .client import EndpointClient, RequestFailed
from .prompt import Item
from .scoring import INVALID, extract_answer, is_correct

__all__ = ["QuestionRecord", "RunResult", "run_items"]


@dataclass(frozen=True, slots=True)
class QuestionRecord:
    """One question's outcome. `extracted` is None when the output holds no number or the request failed."""

    id: int
    label: int | float
    output: str | None
    extracted: int | float | None
    correct: bool
    invalid: bool
    error: str | None
    retries: int
    latency_s: float | None
    completion_tokens: int | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class RunResult:
    records: tuple[QuestionRecord, ...]
    started_at: datetime
    wall_s: float
    # Why the run stopped before every question was answered ("timeout", "interrupted", "errors"), else None.
    stopped: str | None
    # All retries, counting those of requests cancelled when the run stopped early.
    retries: int


class _Progress(tqdm):
    # No monitor thread: it would outlive the run (tqdm keeps it for the process's life).
    monitor_interval = 0


class _TooManyErrors(Exception):
    """Raised by a worker to stop the run: the gate can no longer pass."""


def _failed(item: Item, error: str, retries: int = 0) -> QuestionRecord:
    return QuestionRecord(
        item.problem.index, item.problem.label, None, None, False, False, error, retries, None, None, None
    )


async def _ask(client: EndpointClient, item: Item) -> QuestionRecord:
    try:
        c = await client.complete(item.prompt)
    except RequestFailed as exc:
        return _failed(item, str(exc), exc.retries)
    value = extract_answer(c.text)
    invalid = value == INVALID
    return QuestionRecord(
        id=item.problem.index,
        label=item.problem.label,
        output=c.text,
        extracted=None if invalid else value,
        correct=is_correct(value, item.problem.label),
        invalid=invalid,
        error=None,
        retries=c.retries,
        latency_s=c.latency_s,
        completion_tokens=c.completion_tokens,
        finish_reason=c.finish_reason,
    )


async def run_items(
    client: EndpointClient,
    items: Sequence[Item],
    *,
    parallel: int,
    max_errors: int | None = None,
    timeout_s: float | None = None,
    interrupt: asyncio.Event | None = None,
    progress: bool = True,
) -> RunResult:
    """Ask `items` through `parallel` workers. Stops early once more than `max_errors` questions failed
    (the gate can no longer pass), after `timeout_s`, or when `interrupt` is set (SIGTERM); the questions
    not answered then are recorded as errors."""
    started_at = datetime.now(UTC)
    start = time.perf_counter()
    done: dict[int, QuestionRecord] = {}
    queue = iter(range(len(items)))
    errors = 0
    stopped: str | None = None
    # On a terminal, redraw often; in a Job's log, print a line every 30 s at most.
    bar = _Progress(
        total=len(items),
        desc="gsm8k",
        unit="q",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.2 if sys.stderr.isatty() else 30.0,
        dynamic_ncols=True,
    )

    async def worker() -> None:
        nonlocal errors
        for i in queue:
            record = await _ask(client, items[i])
            done[i] = record
            bar.update(1)
            if record.error is not None:
                errors += 1
                if max_errors is not None and errors > max_errors:
                    raise _TooManyErrors

    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(parallel, len(items))))]
    everything = asyncio.gather(*tasks)
    interrupted = asyncio.create_task((interrupt or asyncio.Event()).wait())
    waitables: set[asyncio.Future[Any]] = {everything, interrupted}
    try:
        finished, _ = await asyncio.wait(waitables, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if everything in finished:
            everything.result()  # re-raises a worker's unexpected error
        else:
            stopped = "interrupted" if interrupted in finished else "timeout"
    except _TooManyErrors:
        stopped = "errors"
    finally:
        for t in [*tasks, interrupted]:
            t.cancel()
        await asyncio.gather(*tasks, interrupted, return_exceptions=True)
        everything.cancel()
        with contextlib.suppress(asyncio.CancelledError, _TooManyErrors):
            await everything
        bar.close()
    reason = {
        "timeout": f"not answered within --timeout {timeout_s} s",
        "interrupted": "not answered: the run was interrupted (SIGTERM)",
        "errors": f"not finished: the run stopped after more than {max_errors} failed questions",
    }.get(stopped or "", "not finished")
    records = tuple(done.get(i) or _failed(item, reason) for i, item in enumerate(items))
    return RunResult(
        records=records,
        started_at=started_at,
        wall_s=time.perf_counter() - start,
        stopped=stopped,
        retries=client.retries,
    )
