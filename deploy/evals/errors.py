"""The errors of the gsm8k gate, each mapped to one exit code of `sglang-pd eval`.

    EvalError
    ├── UsageError            bad flags or an unusable baseline           (exit 2)
    ├── DataUnavailable       no dataset: offline, bad file, bad checksum (exit 3)
    └── EndpointError         the endpoint cannot be evaluated            (exit 4)
        └── EndpointUnreachable

Failures during a run (too many failed questions, first attempts, malformed responses or truncated
answers, --timeout) are not raised: the report is written with status "error" (exit 4). A failed
gate is a result too (`GateResult`, exit 1).
"""

from __future__ import annotations

__all__ = [
    "DataUnavailable",
    "EndpointError",
    "EndpointUnreachable",
    "EvalError",
    "UsageError",
]


class EvalError(Exception):
    """Base class of the gate's errors."""


class UsageError(EvalError):
    """A flag or an input file given by the user is invalid."""


class DataUnavailable(EvalError):
    """The gsm8k data could not be found, downloaded or verified."""


class EndpointError(EvalError):
    """The endpoint could not be evaluated."""


class EndpointUnreachable(EndpointError):
    """The endpoint did not answer, or answered in a way that is not OpenAI-compatible."""
