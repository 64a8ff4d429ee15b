"""The gsm8k accuracy gate: `sglang-pd eval gsm8k` against any OpenAI-compatible endpoint."""

from .client import ClientConfig, Completion, EndpointClient, QuestionFailed, RetryPolicy
from .data import (
    GSM8K_SHA256,
    GSM8K_URL,
    PACKAGED_GSM8K,
    Dataset,
    Download,
    Problem,
    download_dataset,
    ensure_dataset,
    load_dataset,
    load_packaged,
)
from .errors import DataUnavailable, EndpointError, EndpointUnreachable, EvalError, UsageError
from .gate import (
    SCHEMA,
    Baseline,
    GateResult,
    RuleResult,
    check_compatible,
    check_floor,
    check_paired,
    load_baseline,
    questions_fingerprint,
)
from .gsm8k import Gsm8kOptions, evaluate
from .prompt import STOP, Item, build_items, few_shot_prefix
from .publish import InCluster, PublishError, publish_baseline
from .report import Metrics, Report, compute_metrics, format_table
from .runner import QuestionRecord, RunResult, run_items
from .scoring import last_explicit, last_number, same_number, strict_match
from .stats import newcombe_interval, paired_interval, paired_power, tango_interval
from .textfile import render_metrics, write_textfile

__all__ = [
    "GSM8K_SHA256",
    "GSM8K_URL",
    "PACKAGED_GSM8K",
    "SCHEMA",
    "STOP",
    "Baseline",
    "ClientConfig",
    "Completion",
    "DataUnavailable",
    "Dataset",
    "Download",
    "EndpointClient",
    "EndpointError",
    "EndpointUnreachable",
    "EvalError",
    "GateResult",
    "Gsm8kOptions",
    "InCluster",
    "Item",
    "Metrics",
    "Problem",
    "PublishError",
    "QuestionFailed",
    "QuestionRecord",
    "Report",
    "RetryPolicy",
    "RuleResult",
    "RunResult",
    "UsageError",
    "build_items",
    "check_compatible",
    "check_floor",
    "check_paired",
    "compute_metrics",
    "download_dataset",
    "ensure_dataset",
    "evaluate",
    "few_shot_prefix",
    "format_table",
    "last_explicit",
    "last_number",
    "load_baseline",
    "load_dataset",
    "load_packaged",
    "newcombe_interval",
    "paired_interval",
    "paired_power",
    "publish_baseline",
    "questions_fingerprint",
    "render_metrics",
    "run_items",
    "same_number",
    "strict_match",
    "tango_interval",
    "write_textfile",
]
