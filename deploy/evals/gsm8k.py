"""One gsm8k evaluation, from options to report: data → prompts → requests → scores → gate."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import ClientConfig, EndpointClient
from .data import DataSource, ensure_dataset
from .gate import (
    DEFAULT_CONFIDENCE,
    DEFAULT_INTERVAL,
    DEFAULT_MAX_DROP,
    Baseline,
    GateResult,
    RuleResult,
    check_compatible,
    check_floor,
    check_paired,
    load_baseline,
    questions_fingerprint,
)
from .prompt import DEFAULT_NUM_SHOTS, STOP, build_items
from .report import SCORES, Metrics, Report, compute_metrics
from .runner import RunResult, run_items
from .stats import Interval

__all__ = [
    "DEFAULT_MAX_ERROR_RATE",
    "DEFAULT_MAX_INVALID_RATE",
    "DEFAULT_MAX_RETRY_RATE",
    "DEFAULT_MAX_TRUNCATION_RATE",
    "MAX_SCORE_DISAGREEMENT",
    "Gsm8kOptions",
    "evaluate",
]

# Infrastructure limits (exit 4 past each); a healthy deployment sees none of these at all.
DEFAULT_MAX_ERROR_RATE = 0.05
DEFAULT_MAX_RETRY_RATE = 0.05
DEFAULT_MAX_INVALID_RATE = 0.01
DEFAULT_MAX_TRUNCATION_RATE = 0.05
# Above this, the three scores disagreeing is worth a person's look (a warning, not a failure).
MAX_SCORE_DISAGREEMENT = 0.01


@dataclass(frozen=True, slots=True, kw_only=True)
class Gsm8kOptions:
    client: ClientConfig
    # None: the test set shipped in the package (no network); a Download only when asked for.
    data: DataSource = None
    data_sha256: str | None = None
    num_shots: int = DEFAULT_NUM_SHOTS
    # None: every question after the shots (1314 of test.jsonl), what the paired rule needs.
    num_questions: int | None = None
    sample: bool = False
    seed: int = 0
    timeout_s: float | None = None
    wait_ready_s: float = 0.0
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE
    max_retry_rate: float = DEFAULT_MAX_RETRY_RATE
    max_invalid_rate: float = DEFAULT_MAX_INVALID_RATE
    max_truncation_rate: float = DEFAULT_MAX_TRUNCATION_RATE
    min_accuracy: float | None = None
    baseline: Path | None = None
    # A --baseline file that does not exist yet (the first release) is skipped instead of refused.
    baseline_optional: bool = False
    max_drop: float = DEFAULT_MAX_DROP
    confidence: float = DEFAULT_CONFIDENCE
    interval: Interval = DEFAULT_INTERVAL
    progress: bool = True


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


def _load_baseline(options: Gsm8kOptions, warnings: list[str]) -> Baseline | None:
    if options.baseline is None:
        return None
    if options.baseline_optional and not options.baseline.exists():
        warnings.append(f"no baseline at {options.baseline} yet: the paired rule was skipped (a first release)")
        return None
    return load_baseline(options.baseline)


def _run_problems(options: Gsm8kOptions, run: RunResult, m: Metrics, max_errors: int) -> list[str]:
    """Why the run cannot be judged on accuracy: each infrastructure limit passed, with its own message."""
    problems: list[str] = []
    if run.stopped == "interrupted":
        problems.append(f"the run was interrupted by SIGTERM ({m.errors} questions unanswered or failed)")
    elif run.stopped == "timeout":
        problems.append(
            f"the run did not finish within --timeout {options.timeout_s:g} s "
            f"({m.errors} questions unanswered or failed)"
        )
    elif m.errors > max_errors:
        # The first real failure: questions left unanswered when the run stopped only say so.
        failed = [r for r in run.records if r.error is not None]
        first = next((r.error for r in failed if r.error_kind != "unanswered"), failed[0].error)
        problems.append(
            f"{m.errors} of {m.n} questions failed after retries, more than --max-error-rate "
            f"{options.max_error_rate:g} allows ({max_errors}); first error: {first}"
        )
    limits = (
        (
            m.first_attempt_failures,
            m.retry_rate,
            "--max-retry-rate",
            options.max_retry_rate,
            "questions failed on their first attempt (connection errors, timeouts, HTTP 408/429/5xx) and were retried",
        ),
        (
            m.invalid_responses,
            m.invalid_response_rate,
            "--max-invalid-rate",
            options.max_invalid_rate,
            "questions got a malformed response (not an OpenAI response, a non-string text, a body that does not "
            "decode)",
        ),
        (
            m.truncated,
            m.truncation_rate,
            "--max-truncation-rate",
            options.max_truncation_rate,
            f"answers were cut at --max-tokens {options.client.max_tokens} (finish_reason 'length')",
        ),
    )
    for count, rate, flag, limit, what in limits:
        if rate > limit:
            problems.append(f"{count} of {m.n} {what}: {rate:.4f} is above {flag} {limit:g}")
    return problems


def _disagreement_warnings(m: Metrics) -> list[str]:
    out = []
    for pair, rate in m.disagreement.items():
        if rate > MAX_SCORE_DISAGREEMENT:
            a, b = pair.split("/")
            out.append(
                f"the scores {a} ({m.scores[a]:.4f}) and {b} ({m.scores[b]:.4f}) disagree on {rate:.1%} of questions, "
                f"more than {MAX_SCORE_DISAGREEMENT:.0%}: the answers' format may have changed (see the records' "
                f"output, {SCORES[a][0]} and {SCORES[b][0]})"
            )
    return out


async def evaluate(options: Gsm8kOptions) -> Report:
    """Run the evaluation and the gate. Raises EvalError subclasses for usage, data and endpoint problems
    found before the run; problems during the run are in the report's status ("error")."""
    warnings: list[str] = []
    baseline = _load_baseline(options, warnings)
    dataset = ensure_dataset(options.data, sha256=options.data_sha256)
    items = build_items(
        dataset.problems,
        num_shots=options.num_shots,
        num_questions=options.num_questions,
        sample=options.sample,
        seed=options.seed,
    )
    ids = [it.problem.index for it in items]
    fingerprint = questions_fingerprint(dataset.sha256, ids, options.num_shots, options.client.api)
    if baseline is not None:
        check_compatible(
            baseline,
            data_sha256=dataset.sha256,
            api=options.client.api,
            num_shots=options.num_shots,
            max_tokens=options.client.max_tokens,
            question_ids=ids,
        )
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

    config: dict[str, Any] = {
        "api": options.client.api,
        "num_shots": options.num_shots,
        "num_questions": len(items),
        # The shots are lines 0..num_shots-1 of the file; questions are drawn from the lines after them.
        "selection": f"sample(seed={options.seed})" if options.sample else f"first (ids {options.num_shots}..)",
        "max_tokens": options.client.max_tokens,
        "temperature": options.client.temperature,
        "stop": list(STOP) if options.client.api == "completions" else None,
        "parallel": options.client.parallel,
        "max_retries": options.client.retry.max_retries,
        "request_timeout_s": options.client.request_timeout_s,
        "timeout_s": options.timeout_s,
        "wait_ready_s": options.wait_ready_s,
        "max_error_rate": options.max_error_rate,
        "max_retry_rate": options.max_retry_rate,
        "max_invalid_rate": options.max_invalid_rate,
        "max_truncation_rate": options.max_truncation_rate,
        "min_accuracy": options.min_accuracy,
        "baseline": str(options.baseline) if baseline is not None else None,
        "max_drop": options.max_drop if baseline is not None else None,
        "confidence": options.confidence if baseline is not None else None,
        "interval": options.interval if baseline is not None else None,
        "data_path": str(dataset.path),
        "data_sha256": dataset.sha256,
        "data_canonical": dataset.canonical,
        "questions_fingerprint": fingerprint,
        # The router revision every question was pinned to (--revision), None when not pinned.
        "revision": options.client.revision,
    }
    try:
        return _judge(options, client.base_url, model, config, run, baseline, max_errors, warnings)
    except Exception as exc:  # a bug in judging must still leave the records in a report (exit 4)
        return Report(
            endpoint=client.base_url,
            api=options.client.api,
            model=model,
            config=config,
            run=run,
            metrics=compute_metrics(run),
            gate=None,
            status="error",
            error=f"internal error while judging the run: {type(exc).__name__}: {exc}",
            warnings=tuple(warnings),
        )


def _judge(
    options: Gsm8kOptions,
    endpoint: str,
    model: str,
    config: dict[str, Any],
    run: RunResult,
    baseline: Baseline | None,
    max_errors: int,
    warnings: list[str],
) -> Report:
    metrics = compute_metrics(run)
    rules: list[RuleResult] = []
    if options.min_accuracy is not None:
        rules.append(check_floor(metrics.correct, metrics.n, options.min_accuracy))
    if baseline is not None:
        outcomes = {r.id: r.correct for r in run.records}
        rules.append(
            check_paired(
                outcomes,
                baseline,
                max_drop=options.max_drop,
                confidence=options.confidence,
                interval=options.interval,
            )
        )
    gate = GateResult(tuple(rules)) if rules else None
    warnings = [*warnings, *_disagreement_warnings(metrics)]
    problems = _run_problems(options, run, metrics, max_errors)
    error: str | None = "; ".join(problems) if problems else None
    status = "error" if error else ("gate_failed" if gate is not None and not gate.passed else "pass")
    if status == "gate_failed" and gate is not None:
        error = "; ".join(f"gate rule {r.rule} failed: {r.message}" for r in gate.failures)
    return Report(
        endpoint=endpoint,
        api=options.client.api,
        model=model,
        config=dict(config),
        run=run,
        metrics=metrics,
        gate=gate,
        status=status,
        error=error,
        warnings=tuple(warnings),
    )
