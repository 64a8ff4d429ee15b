"""What full SBO actually ran inside a serving sglang process, as counts a running server logs.

Two counts per scheduler process: calls of our signal down-GEMM (the `down-gemm` hook routed a
call with overlap arguments to it) and DeepEP combines that carried a signal (the `combine-call`
hook saw `comp_signal` or `src_signals`). They are Python-level calls: an eager decode step makes
one of each per MoE layer; a CUDA graph makes them while it is captured (counted apart as
`captured`) and its replays launch the captured kernels without calling again. Nonzero counts of
both therefore mean that the overlapped kernels ran or sit inside the graphs that run.

Each process writes its counts to stderr (which sglang's launcher keeps in the server log) as one
tagged JSON line, at the 1st, 2nd, 4th, ... call and every 4096th after that:

    sglang-pd sbo-engagement: {"pid": 123, "signal_gemm": 8, "signal_combine": 8, "captured": 0}

`sglang-pd doctor --server-log FILE` reads the last line of each process (`read_log`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass

__all__ = ["LINE_TAG", "Engagement", "count_signal_combine", "count_signal_gemm", "read_log", "snapshot"]

LINE_TAG = "sglang-pd sbo-engagement: "
#: After the powers of two, a line every this many calls: a long-running server logs rarely.
_LOG_EVERY = 4096


@dataclass
class Engagement:
    """Counts of one process (or, from `read_log`, summed over the processes of a log)."""

    signal_gemm: int = 0
    signal_combine: int = 0
    captured: int = 0
    processes: int = 1

    @property
    def engaged(self) -> bool:
        return self.signal_gemm > 0 and self.signal_combine > 0


_counts = Engagement()


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tick(field: str) -> None:
    setattr(_counts, field, getattr(_counts, field) + 1)
    if _capturing():
        _counts.captured += 1
    n = getattr(_counts, field)
    if n & (n - 1) == 0 or n % _LOG_EVERY == 0:
        line = {"pid": os.getpid(), **{k: v for k, v in asdict(_counts).items() if k != "processes"}}
        sys.stderr.write(LINE_TAG + json.dumps(line) + "\n")
        sys.stderr.flush()


def count_signal_gemm() -> None:
    _tick("signal_gemm")


def count_signal_combine() -> None:
    _tick("signal_combine")


def snapshot() -> Engagement:
    """This process's counts so far (a copy)."""
    return Engagement(**asdict(_counts))


def read_log(lines: Iterable[str]) -> Engagement | None:
    """The counts a server log holds: each process's last line, summed; None when it has none."""
    last: dict[int, dict[str, int]] = {}
    for line in lines:
        _, tag, payload = line.partition(LINE_TAG)
        if not tag:
            continue
        try:
            doc = json.loads(payload)
            last[int(doc["pid"])] = {k: int(doc[k]) for k in ("signal_gemm", "signal_combine", "captured")}
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash: the earlier lines of that process still count
    if not last:
        return None
    total = Engagement(processes=len(last))
    for counts in last.values():
        for key, value in counts.items():
            setattr(total, key, getattr(total, key) + value)
    return total
