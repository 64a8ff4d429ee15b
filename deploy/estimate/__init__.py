"""`sglang-pd plan --estimate`: a documented roofline of a topology's prefill and decode (docs/estimate.md)."""

from sglang_pd.deploy.estimate.estimate import (
    DEFAULT_INPUT_LEN,
    DEFAULT_OUTPUT_LEN,
    Estimate,
    EstimateError,
    estimate_topology,
)
from sglang_pd.deploy.estimate.report import format_estimate

__all__ = [
    "DEFAULT_INPUT_LEN",
    "DEFAULT_OUTPUT_LEN",
    "Estimate",
    "EstimateError",
    "estimate_topology",
    "format_estimate",
]
