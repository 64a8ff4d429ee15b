"""One gsm8k evaluation, from options to report: data → prompts → requests → scores → gate."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .client import ClientConfig, EndpointClient
from .data import ensure_dataset
from .gate import (
    DEFAULT_CONFIDENCE,
    DEFAULT_MAX_DROP,
    GateResult,
    RuleResult,
    check_baseline,
    check_floor,
    load_baseline,
)
from .prompt import DEFAULT_NUM_SHOTS, STOP, Item, build_items
from .report import Report, compute_metrics
from .runner import run_items

__all__ = ["DEFAULT_MAX_ERROR_RATE", "DEFAULT_NUM_QUESTIONS", "Gsm8kOptions", "evaluate", "questions_fingerprint"]

DEFAULT_NUM_QUESTIONS = 200
DEFAULT_MAX_ERROR_RATE = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class Gsm8kOptions:
    client: ClientConfig
    data: Path | None = None
    num_shots: int = DEFAULT_NUM_SHOTS
    num_questions: int | None = DEFAULT_NUM_QUESTIONS
    sample: bool = False
    seed: int = 0
    timeout_s: float | None = None
    wait_ready_s: float = 0.0
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE
    min_accuracy: float | None = None
    baseline: Path | None = None
    max_drop: float = DEFAULT_MAX_DROP
    confidence: float = DEFAULT_CONFIDENCE
    progress: bool = True


def questions_fingerprint(data_sha256: str, items: list[Item], num_shots: int, api: str) -> str:
    """Identifies the exact questions and prompts, so that two reports can tell they are comparable."""
    ids = ",".join(str(it.problem.index) for it in items)
    return hashlib.sha256(f"{data_sha256}|{num_shots}|{api}|{ids}".encode()).hexdigest()[:16]


@contextlib.contextmanager
def _sigterm_sets() -> Iterator[asyncio.Event]:
    """An event set on SIGTERM (a Job past its deadline, a pod being deleted), so that the run stops
    and the report is still written. Where no handler can be installed (not the main thread), none is."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGTERM, event.set)
    except (NotImplementedError, RuntimeError, ValueError):
        yield event
        return
    try:
        yield event
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


async def evaluate(options: Gsm8kOptions) -> Report:
    """Run the evaluation and the gate. Raises EvalError subclasses for usage, data and endpoint problems
    found before the run; problems during the run are in the report's status ("error")."""
    baseline = load_baseline(options.baseline) if options.baseline is not None else None
    dataset = ensure_dataset(options.data)
    items = build_items(
        dataset.problems,
        num_shots=options.num_shots,
        num_questions=options.num_questions,
        sample=options.sample,
        seed=options.seed,
    )
    fingerprint = questions_fingerprint(dataset.sha256, items, options.num_shots, options.client.api)
    max_errors = math.floor(options.max_error_rate * len(items))
    async with EndpointClient(options.client) as client:
        model = await client.resolve_model(wait_s=options.wait_ready_s)
        with _sigterm_sets() as interrupt:
            run = await run_items(
                client,
                items,
                parallel=options.client.parallel,
                max_errors=max_errors,
                timeout_s=options.timeout_s,
                interrupt=interrupt,
                progress=options.progress,
            )
    metrics = compute_metrics(run)

    rules: list[RuleResult] = []
    if options.min_accuracy is not None:
        rules.append(check_floor(metrics.correct, metrics.n, options.min_accuracy))
    if baseline is not None:
        rules.append(
            check_baseline(
                metrics.correct,
                metrics.n,
                baseline,
                max_drop=options.max_drop,
                confidence=options.confidence,
                questions_fingerprint=fingerprint,
            )
        )
    gate = GateResult(tuple(rules)) if rules else None

    error: str | None = None
    if run.stopped == "interrupted":
        error = f"the run was interrupted by SIGTERM ({metrics.errors} questions unanswered or failed)"
    elif run.stopped == "timeout":
        error = (
            f"the run did not finish within --timeout {options.timeout_s:g} s "
            f"({metrics.errors} questions unanswered or failed)"
        )
    elif metrics.errors > max_errors:
        error = (
            f"{metrics.errors} of {metrics.n} questions failed after retries, more than --max-error-rate "
            f"{options.max_error_rate:g} allows ({max_errors}); first error: "
            + next(r.error for r in run.records if r.error is not None)
        )
    status = "error" if error else ("gate_failed" if gate is not None and not gate.passed else "pass")
    if status == "gate_failed" and gate is not None:
        error = "; ".join(f"gate rule {r.rule} failed: {r.message}" for r in gate.failures)

    config = {
        "api": options.client.api,
        "num_shots": options.num_shots,
        "num_questions": len(items),
        "selection": f"sample(seed={options.seed})" if options.sample else "first",
        "max_tokens": options.client.max_tokens,
        "temperature": options.client.temperature,
        "stop": list(STOP) if options.client.api == "completions" else None,
        "parallel": options.client.parallel,
        "max_retries": options.client.retry.max_retries,
        "request_timeout_s": options.client.request_timeout_s,
        "timeout_s": options.timeout_s,
        "wait_ready_s": options.wait_ready_s,
        "max_error_rate": options.max_error_rate,
        "min_accuracy": options.min_accuracy,
        "baseline": str(options.baseline) if options.baseline else None,
        "max_drop": options.max_drop if options.baseline else None,
        "confidence": options.confidence if options.baseline else None,
        "data_path": str(dataset.path),
        "data_sha256": dataset.sha256,
        "data_canonical": dataset.canonical,
        "questions_fingerprint": fingerprint,
    }
    return Report(
        endpoint=client.base_url,
        api=options.client.api,
        model=model,
        config=config,
        run=run,
        metrics=metrics,
        gate=gate,
        status=status,
        error=error,
    )
