"""GPU time of every decode forward inside an sglang server: CUDA events around `ModelRunner._forward_raw`.

The SBO server check compares decode step times with SBO on and off. Gaps between streamed tokens
and sglang's decode lines include the scheduler, sampling and HTTP, which are the same on both
sides and hide a few percent; this measures what SBO changes, the forward on the GPU. The events
are recorded on the stream the forward runs on (sglang enters its forward stream before the call),
so with CUDA graphs the time is the replay's, from the moment the stream reaches it.

`install()` (called by `sitecustomize` beside this file when SBO_CHECK_STEP_LOG names a file)
wraps the method as soon as sglang's model runner is imported. The forward only records two events;
a thread reads them once they have completed and appends one line per decode forward to the file:
`<batch size> <graph 1|0> <milliseconds>`. Prefill and mixed forwards are left out.
"""

from __future__ import annotations

import collections
import functools
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import on_import  # beside this file

LOG_ENV = "SBO_CHECK_STEP_LOG"
MODULE = "sglang.srt.model_executor.model_runner"
#: How often the reader thread looks for completed events; the check waits longer before reading.
POLL_S = 0.05


class Event(Protocol):
    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: Any) -> float: ...


class StepLog:
    """Decode forwards whose end events the GPU has not reached yet, and the thread that writes the others."""

    def __init__(self, path: str, new_event: Callable[[], Event]) -> None:
        self.path, self.new_event = path, new_event
        self.pending: collections.deque[tuple[int, bool, Event, Event]] = collections.deque()
        self.thread: threading.Thread | None = None

    def begin(self) -> Event:
        event = self.new_event()
        event.record()
        return event

    def end(self, batch: int, graph: bool, start: Event) -> None:
        end = self.new_event()
        end.record()
        self.pending.append((batch, graph, start, end))  # deque.append is atomic: no lock on the forward's path
        if self.thread is None:
            self.thread = threading.Thread(target=self.watch, name="sbo-check-step-timer", daemon=True)
            self.thread.start()

    def drain(self) -> int:
        """Write every leading forward whose end event has completed; the number written."""
        lines = []
        while self.pending and self.pending[0][3].query():
            batch, graph, start, end = self.pending.popleft()
            lines.append(f"{batch} {int(graph)} {start.elapsed_time(end):.4f}\n")
        if lines:
            with open(self.path, "a") as f:
                f.writelines(lines)
        return len(lines)

    def watch(self) -> None:
        while True:
            self.drain()
            time.sleep(POLL_S)


def timed(forward_raw: Callable[..., Any], steps: StepLog) -> Callable[..., Any]:
    """`ModelRunner._forward_raw` that times its decode forwards into `steps`."""

    @functools.wraps(forward_raw)
    def wrapper(self: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not forward_batch.forward_mode.is_decode():
            return forward_raw(self, forward_batch, *args, **kwargs)
        start = steps.begin()
        out = forward_raw(self, forward_batch, *args, **kwargs)
        steps.end(int(forward_batch.batch_size), bool(getattr(out, "can_run_graph", False)), start)
        return out

    wrapper.sbo_check_step_timer = True  # type: ignore[attr-defined]
    return wrapper


def patch(module: ModuleType, steps: StepLog) -> None:
    runner = module.ModelRunner
    if not getattr(runner._forward_raw, "sbo_check_step_timer", False):
        runner._forward_raw = timed(runner._forward_raw, steps)


def read(path: str, offset: int = 0) -> tuple[list[tuple[int, bool, float]], int]:
    """The (batch, graph, ms) lines written from byte `offset` on, and the offset after them."""
    if not os.path.exists(path):
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]  # a line still being written waits for the next read
    rows = []
    for line in complete.splitlines():
        batch, graph, ms = line.split()
        rows.append((int(batch), graph == "1", float(ms)))
    return rows, offset + len(complete.encode())


def install() -> None:
    import torch

    steps = StepLog(os.environ[LOG_ENV], lambda: torch.cuda.Event(enable_timing=True))
    on_import.when_imported(MODULE, functools.partial(patch, steps=steps))
