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

from .client import Completion, EndpointClient, QuestionFailed
from .prompt import Item
from .scoring import last_explicit, last_number, same_number, strict_match, strict_normalize

__all__ = ["QuestionRecord", "RunResult", "run_items", "score"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QuestionRecord:
    """One question's outcome under the three scores (see `scoring`). `extracted` is the gate's answer,
    None when the output holds no number or the request failed; `error_kind` is the client's failure kind
    ("transient", "http", "invalid_response") or "internal" for a bug of this tool."""

    id: int
    label: str
    output: str | None
    extracted: str | None
    correct: bool
    invalid: bool
    strict: str | None = None
    strict_correct: bool = False
    explicit: str | None = None
    explicit_correct: bool = False
    error: str | None = None
    error_kind: str | None = None
    retries: int = 0
    first_attempt_failed: bool = False
    invalid_responses: int = 0
    truncated: bool = False
    latency_s: float | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None


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


def _failed(item: Item, error: str, kind: str, **counts: Any) -> QuestionRecord:
    return QuestionRecord(
        id=item.problem.index,
        label=item.problem.label,
        output=None,
        extracted=None,
        correct=False,
        invalid=False,
        error=error,
        error_kind=kind,
        **counts,
    )


def score(item: Item, completion: Completion) -> QuestionRecord:
    """The record of one answered question, under the gate's score and the two others."""
    text, label = completion.text, item.problem.label
    extracted = last_number(text)
    strict, explicit = strict_match(text), last_explicit(text)
    return QuestionRecord(
        id=item.problem.index,
        label=label,
        output=text,
        extracted=extracted,
        correct=same_number(extracted, label),
        invalid=extracted is None,
        strict=strict,
        strict_correct=strict is not None and strict == strict_normalize(label),
        explicit=explicit,
        explicit_correct=same_number(explicit, label),
        retries=completion.retries,
        first_attempt_failed=completion.first_attempt_failed,
        invalid_responses=completion.invalid_responses,
        truncated=completion.finish_reason == "length",
        latency_s=completion.latency_s,
        completion_tokens=completion.completion_tokens,
        finish_reason=completion.finish_reason,
    )


async def _ask(client: EndpointClient, item: Item) -> QuestionRecord:
    try:
        completion = await client.complete(item.prompt)
        return score(item, completion)
    except QuestionFailed as exc:
        return _failed(
            item,
            str(exc),
            exc.kind,
            retries=exc.retries,
            first_attempt_failed=exc.first_attempt_failed,
            invalid_responses=exc.invalid_responses,
        )
    except Exception as exc:  # a bug here must cost one question, never the run and its report
        return _failed(item, f"internal error: {type(exc).__name__}: {exc}", "internal")


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
    records = tuple(done.get(i) or _failed(item, reason, "unanswered") for i, item in enumerate(items))
    return RunResult(
        records=records,
        started_at=started_at,
        wall_s=time.perf_counter() - start,
        stopped=stopped,
        retries=client.retries,
    )
