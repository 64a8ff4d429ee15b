"""The gsm8k accuracy gate: `sglang-pd eval gsm8k` against any OpenAI-compatible endpoint."""

from .client import ClientConfig, Completion, EndpointClient, RequestFailed, RetryPolicy
from .data import GSM8K_SHA256, GSM8K_URL, Dataset, Problem, ensure_dataset, load_dataset
from .errors import DataUnavailable, EndpointError, EndpointUnreachable, EvalError, UsageError
from .gate import Baseline, GateResult, RuleResult, check_baseline, check_floor, load_baseline
from .gsm8k import Gsm8kOptions, evaluate
from .prompt import STOP, Item, build_items, few_shot_prefix
from .report import Metrics, Report, compute_metrics, format_table
from .runner import QuestionRecord, RunResult, run_items
from .scoring import INVALID, extract_answer, is_correct

__all__ = [
    "GSM8K_SHA256",
    "GSM8K_URL",
    "INVALID",
    "STOP",
    "Baseline",
    "ClientConfig",
    "Completion",
    "DataUnavailable",
    "Dataset",
    "EndpointClient",
    "EndpointError",
    "EndpointUnreachable",
    "EvalError",
    "GateResult",
    "Gsm8kOptions",
    "Item",
    "Metrics",
    "Problem",
    "QuestionRecord",
    "Report",
    "RequestFailed",
    "RetryPolicy",
    "RuleResult",
    "RunResult",
    "UsageError",
    "build_items",
    "check_baseline",
    "check_floor",
    "compute_metrics",
    "ensure_dataset",
    "evaluate",
    "extract_answer",
    "few_shot_prefix",
    "format_table",
    "is_correct",
    "load_baseline",
    "load_dataset",
    "run_items",
]
