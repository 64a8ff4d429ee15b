"""`sglang-pd eval gsm8k`: the accuracy gate of every rollout, against any OpenAI-compatible base URL.

Exit codes (stable; the Helm test and the post-upgrade Job rely on them):
  0  the run finished and every gate rule passed (or no rule was given)
  1  a gate rule failed: the rule and its numbers are on stderr and in the report
  2  bad usage: a bad flag value, or a --baseline report that cannot be used (the reason is printed:
     it did not pass, has errors, another schema, data file, API, shot count, max_tokens, or
     does not hold this run's questions)
  3  no data: an unreadable or damaged file (the shipped copy included), a checksum mismatch, or a
     --data URL that cannot be downloaded
  4  the run cannot be judged on accuracy: a --wait-rollout LeaderWorkerSet did not finish rolling out
     within --rollout-timeout (no question is asked), the endpoint is unreachable, too many questions failed
     after retries (--max-error-rate), too many first attempts failed (--max-retry-rate), too many
     malformed responses (--max-invalid-rate) or truncated answers (--max-truncation-rate),
     --timeout passed, SIGTERM stopped the run, or this tool hit an unexpected error

With --baseline, the rule is paired non-inferiority: the questions of both runs are matched by id
and the run passes only when the one-sided --confidence upper bound of its accuracy drop (a Tango
score interval on the questions it lost and gained) is below --max-drop.

The report (`--output`) is written whenever the run started, whatever the exit code, and on an
unexpected error. For a Job with activeDeadlineSeconds, pass --timeout somewhat below it: the run
then ends with a report and exit 4 rather than being killed (SIGTERM also ends the run with a
report, within the grace period).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from ..common.argtypes import fraction, positive_float, positive_int
from ..common.contract import EXIT_FAILED as EXIT_ENDPOINT
from ..common.contract import EXIT_INVALID as EXIT_GATE_FAILED
from ..common.contract import EXIT_OK, EXIT_USAGE
from ..common.contract import EXIT_UNAVAILABLE as EXIT_DATA
from ..spec.revision import revision_problem
from .approval import approve, wait_paired
from .client import ClientConfig, RetryPolicy
from .data import GSM8K_URL, check_sha256, parse_source
from .errors import DataUnavailable, EndpointError, EvalError, UsageError
from .gate import DEFAULT_CONFIDENCE, DEFAULT_INTERVAL, DEFAULT_MAX_DROP
from .gsm8k import (
    DEFAULT_MAX_ERROR_RATE,
    DEFAULT_MAX_INVALID_RATE,
    DEFAULT_MAX_RETRY_RATE,
    DEFAULT_MAX_TRUNCATION_RATE,
    Gsm8kOptions,
    evaluate,
)
from .prompt import DEFAULT_NUM_SHOTS
from .publish import PublishError, in_cluster, publish_baseline
from .report import Report, format_table, minimal_report, write_json
from .rollout import RolloutNotReady, fetch_lws, wait_for_rollout
from .textfile import parse_labels, render_metrics, write_textfile

__all__ = ["EXIT_DATA", "EXIT_ENDPOINT", "EXIT_GATE_FAILED", "EXIT_OK", "EXIT_USAGE", "add_arguments", "run"]


def _num_questions(value: str) -> int | None:
    return None if value == "all" else positive_int(value)


def _sha256(value: str) -> str:
    try:
        return check_sha256(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_gsm8k(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("endpoint")
    target.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL"),
        help="OpenAI base URL ending in /v1, e.g. http://router:8000/v1 (default: $OPENAI_BASE_URL)",
    )
    target.add_argument("--api", choices=("completions", "chat"), default="completions", help="default: completions")
    target.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    target.add_argument("--api-key", default=None, help="bearer key (default: $OPENAI_API_KEY)")

    data = p.add_argument_group("questions")
    data.add_argument(
        "--data",
        type=parse_source,
        default=None,
        metavar="PATH|URL",
        help="a gsm8k jsonl file, or an http(s) URL to download one from, once, into the cache ($SGLANG_PD_CACHE_DIR, "
        f"else ~/.cache/sglang-pd), e.g. {GSM8K_URL} (default: the test.jsonl shipped in sglang-pd, sha256-checked, "
        "no network)",
    )
    data.add_argument(
        "--data-sha256",
        type=_sha256,
        default=None,
        metavar="HEX",
        help="the sha256 the --data file must have (default: for a URL the canonical test.jsonl's, for a PATH none)",
    )
    data.add_argument("--num-shots", type=int, default=DEFAULT_NUM_SHOTS, help=f"default: {DEFAULT_NUM_SHOTS}")
    data.add_argument(
        "--num-questions",
        type=_num_questions,
        default=None,
        metavar="N|all",
        help="the first N questions after the shots (default: all, 1314 of test.jsonl)",
    )
    data.add_argument("--sample", action="store_true", help="a seeded random sample of N instead of the first N")
    data.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    data.add_argument("--max-tokens", type=int, default=512, help="default: 512")

    runp = p.add_argument_group("run (exit 4 past any limit)")
    runp.add_argument("--parallel", type=int, default=128, help="concurrent requests (default: 128)")
    runp.add_argument("--retries", type=int, default=3, help="retries of a transient failure (default: 3)")
    runp.add_argument("--retry-backoff", type=float, default=1.0, metavar="SECONDS", help="first backoff (default 1)")
    runp.add_argument("--request-timeout", type=positive_float, default=300.0, metavar="SECONDS", help="default: 300")
    runp.add_argument("--connect-timeout", type=positive_float, default=10.0, metavar="SECONDS", help="default: 10")
    runp.add_argument(
        "--wait-ready",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep retrying an unreachable endpoint or one that lists no model yet this long (default: 0)",
    )
    runp.add_argument(
        "--timeout", type=positive_float, default=None, metavar="SECONDS", help="limit on the whole run (exit 4 after)"
    )
    runp.add_argument(
        "--wait-rollout",
        action="append",
        default=[],
        metavar="LWS",
        help="inside a pod: before any question, wait until this LeaderWorkerSet of the pod's namespace has rolled "
        "out (every group updated and ready); repeatable (evals/rollout.py)",
    )
    runp.add_argument(
        "--rollout-timeout",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="how long --wait-rollout waits; past it the run is not scored (exit 4)",
    )
    for flag, default, what in (
        ("--max-error-rate", DEFAULT_MAX_ERROR_RATE, "questions that failed after retries"),
        ("--max-retry-rate", DEFAULT_MAX_RETRY_RATE, "questions whose first attempt failed (then retried)"),
        ("--max-invalid-rate", DEFAULT_MAX_INVALID_RATE, "questions that got a malformed response"),
        ("--max-truncation-rate", DEFAULT_MAX_TRUNCATION_RATE, "answers cut at --max-tokens"),
    ):
        runp.add_argument(flag, type=fraction, default=default, help=f"most {what}, a fraction (default: {default})")
    runp.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    runp.add_argument("--quiet", action="store_true", help="no progress bar")

    gate = p.add_argument_group("gate (exit 1 when a rule fails)")
    gate.add_argument("--min-accuracy", type=fraction, default=None, help="fail below this accuracy")
    gate.add_argument("--baseline", type=Path, default=None, help="an earlier passing report to compare with, paired")
    gate.add_argument(
        "--baseline-optional",
        action="store_true",
        help="skip the paired rule, with a warning, when the --baseline file does not exist (a first release)",
    )
    gate.add_argument(
        "--max-drop",
        type=fraction,
        default=DEFAULT_MAX_DROP,
        help=f"fail unless the drop from --baseline is shown to be below this (default: {DEFAULT_MAX_DROP})",
    )
    gate.add_argument(
        "--confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        help=f"one-sided confidence of the bound on the drop (default: {DEFAULT_CONFIDENCE})",
    )
    gate.add_argument(
        "--interval",
        choices=("tango", "newcombe"),
        default=DEFAULT_INTERVAL,
        help=f"paired interval: Tango's score interval or Newcombe's method 10 (default: {DEFAULT_INTERVAL})",
    )

    rollout = p.add_argument_group("rollout through the sglang-pd router (evals/approval.py)")
    rollout.add_argument(
        "--revision",
        default=None,
        metavar="REV",
        help="score this revision only: every question carries x-sglpd-revision: REV, which the router honours "
        "with its admin key alone (give that key as --api-key); waits within --wait-ready for REV to be paired",
    )
    rollout.add_argument(
        "--approve",
        action="store_true",
        help="with --revision: after a clean pass, approve REV in the router (client requests go to it, the revision "
        "approved before drains); on any other outcome REV is held and client requests stay where they are",
    )

    out = p.add_argument_group("publishing")
    out.add_argument(
        "--publish-baseline",
        metavar="CONFIGMAP",
        default=None,
        help="inside a pod: on a clean pass, store the report (without outputs) in this ConfigMap, key report.json",
    )
    out.add_argument(
        "--metrics-textfile",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the verdict and numbers as Prometheus metrics for node-exporter's textfile collector (*.prom)",
    )
    out.add_argument(
        "--metrics-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on every metric of --metrics-textfile (repeatable)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[0] if __doc__ else None
    sub = parser.add_subparsers(dest="eval_name", required=True, metavar="EVAL")
    p = sub.add_parser(
        "gsm8k",
        help="few-shot gsm8k in SGLang's convention, with a floor and a paired baseline gate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_gsm8k(p)


def build_options(args: argparse.Namespace) -> Gsm8kOptions:
    if not args.base_url:
        raise UsageError("--base-url is required (or set OPENAI_BASE_URL), e.g. --base-url http://127.0.0.1:8000/v1.")
    for flag, value, low in (
        ("--parallel", args.parallel, 1),
        ("--retries", args.retries, 0),
        ("--max-tokens", args.max_tokens, 1),
    ):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, not {value}.")
    if args.wait_ready < 0:
        raise UsageError(f"--wait-ready must be 0 or more, not {args.wait_ready}.")
    if args.retry_backoff < 0:
        raise UsageError(f"--retry-backoff must be 0 or more, not {args.retry_backoff}.")
    if not 0.0 < args.confidence < 1.0:
        raise UsageError(f"--confidence must be in (0, 1), not {args.confidence}.")
    if args.data_sha256 is not None and args.data is None:
        raise UsageError("--data-sha256 needs --data PATH|URL (the shipped test.jsonl is always checked).")
    if args.baseline_optional and args.baseline is None:
        raise UsageError("--baseline-optional needs --baseline PATH.")
    if args.approve and args.revision is None:
        raise UsageError("--approve needs --revision REV: the revision this run scores is the one it approves.")
    if args.revision is not None and (problem := revision_problem(args.revision)) is not None:
        raise UsageError(f"--revision: {problem}")
    if bool(args.wait_rollout) != (args.rollout_timeout is not None):
        raise UsageError("--wait-rollout LWS and --rollout-timeout SECONDS go together (the chart derives the budget).")
    client = ClientConfig(
        base_url=args.base_url,
        api=args.api,
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        max_tokens=args.max_tokens,
        parallel=args.parallel,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        retry=RetryPolicy(max_retries=args.retries, backoff_s=args.retry_backoff),
        revision=args.revision,
    )
    return Gsm8kOptions(
        client=client,
        data=args.data,
        data_sha256=args.data_sha256,
        num_shots=args.num_shots,
        num_questions=args.num_questions,
        sample=args.sample,
        seed=args.seed,
        timeout_s=args.timeout,
        wait_ready_s=args.wait_ready,
        max_error_rate=args.max_error_rate,
        max_retry_rate=args.max_retry_rate,
        max_invalid_rate=args.max_invalid_rate,
        max_truncation_rate=args.max_truncation_rate,
        min_accuracy=args.min_accuracy,
        baseline=args.baseline,
        baseline_optional=args.baseline_optional,
        max_drop=args.max_drop,
        confidence=args.confidence,
        interval=args.interval,
        progress=not args.quiet,
    )


def _exit_code(report: Report) -> int:
    if report.status == "error":
        print(f"error: {report.error}", file=sys.stderr)
        return EXIT_ENDPOINT
    if report.gate is not None and not report.gate.passed:
        for rule in report.gate.failures:
            print(f"gate failed ({rule.rule}): {rule.message}", file=sys.stderr)
        return EXIT_GATE_FAILED
    return EXIT_OK


def _publish(configmap: str, report: Report) -> None:
    """Store a clean pass as the next baseline; a failure to store it is a warning, not a failed rollout."""
    if report.status != "pass" or report.metrics.errors:
        print(f"note: the report was not stored in ConfigMap {configmap} (only a clean pass is)", file=sys.stderr)
        return
    try:
        text = json.dumps(report.to_dict(outputs=False), allow_nan=False, separators=(",", ":"))
        publish_baseline(configmap, text, in_cluster())
    except PublishError as exc:
        print(f"warning: the passing report was not stored as the next baseline: {exc}", file=sys.stderr)
    else:
        print(f"stored this report in ConfigMap {configmap} (key report.json) as the next baseline", file=sys.stderr)


def _approve_or_hold(options: Gsm8kOptions, revision: str, report: Report, code: int) -> int:
    """Approve `revision` after a clean pass; hold it otherwise. The exit code: the run's, or 4 when the router
    refused the approval (the revision is then held too)."""
    if code == EXIT_OK and report.status == "pass" and not report.metrics.errors:
        try:
            listed = approve(options.client.base_url, options.client.api_key, revision)
        except EndpointError as exc:
            print(f"error: {exc}; revision {revision} is held", file=sys.stderr)
            return EXIT_ENDPOINT
        print(
            f"approved revision {revision}: client requests go to it (router: {listed.get('approved')})",
            file=sys.stderr,
        )
        return code
    print(
        f"held: revision {revision} is not approved (exit {code}); client requests stay on the revision approved "
        "before. Remove the candidate's workers, or roll back (docs/upgrades.md).",
        file=sys.stderr,
    )
    return code


# How often --wait-rollout reads the LeaderWorkerSets: groups take minutes to start, so seconds are plenty.
ROLLOUT_POLL_S = 5.0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _wait_rollout(names: list[str], budget_s: float) -> None:
    """Wait until the LeaderWorkerSets `names` have rolled out, reading them with the pod's credentials."""
    try:
        cluster = in_cluster()
    except PublishError as exc:
        raise RolloutNotReady(str(exc).replace("--publish-baseline", "--wait-rollout")) from exc
    wait_for_rollout(fetch_lws(cluster), names, budget_s, poll_s=ROLLOUT_POLL_S, log=_progress)
    print(f"rollout finished: {', '.join(names)}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    report: Report | None = None
    try:
        labels = parse_labels(args.metrics_label)
        options = build_options(args)
        if args.wait_rollout:
            _wait_rollout(args.wait_rollout, args.rollout_timeout)
        if args.revision is not None:
            wait_paired(options.client.base_url, options.client.api_key, args.revision, args.wait_ready)
        report = asyncio.run(evaluate(options))
        if args.output is not None:
            report.write(args.output)
        print(format_table(report))
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        code = _exit_code(report)
        if args.approve:
            code = _approve_or_hold(options, args.revision, report, code)
        if args.publish_baseline and report.status == "pass" and code != EXIT_OK:  # the approval was refused
            print(
                f"note: the report was not stored in ConfigMap {args.publish_baseline} (not approved)", file=sys.stderr
            )
        elif args.publish_baseline:
            _publish(args.publish_baseline, report)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except DataUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_DATA
    except EvalError as exc:  # EndpointError, and any new subclass without its own code
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_ENDPOINT
        if isinstance(exc, RolloutNotReady) and args.output is not None:
            try:
                write_json(args.output, json.dumps(minimal_report(str(exc)), indent=1))
            except OSError as write_exc:
                print(f"error: the report could not be written to {args.output}: {write_exc}", file=sys.stderr)
    except Exception as exc:  # a bug of this tool: still exit 4 with a report, never a bare traceback
        message = f"internal error: {type(exc).__name__}: {exc}"
        print(f"error: {message}", file=sys.stderr)
        code = EXIT_ENDPOINT
        if args.output is not None:
            try:
                if report is not None:
                    report.write(args.output)
                else:
                    write_json(args.output, json.dumps(minimal_report(message), indent=1))
            except OSError as write_exc:
                print(f"error: the report could not be written to {args.output}: {write_exc}", file=sys.stderr)
    if args.metrics_textfile is not None:
        try:
            labels = parse_labels(args.metrics_label)
            metrics = render_metrics(report.to_dict(outputs=False) if report else None, code, labels)
            write_textfile(args.metrics_textfile, metrics)
        except Exception as exc:  # the verdict stands whatever happens to its metrics
            print(f"warning: the metrics were not written to {args.metrics_textfile}: {exc}", file=sys.stderr)
    return code
