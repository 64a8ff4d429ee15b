"""The SBO server check's step timer (scripts/gpu/faults/step_timer.py): it wraps sglang's forward
only where the check arms it, times decode forwards alone, and its file reads back line by line."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "scripts/gpu/faults"
sys.path.insert(0, str(FAULTS))
step_timer = importlib.import_module("step_timer")

#: sglang 0.5.17's module path and method name, as a stand-in package the subprocess imports.
FAKE_RUNNER = """
class ModelRunner:
    def _forward_raw(self, forward_batch, pp_proxy_tensors=None):
        return "out"
"""
PROBE = (
    "import json, sglang.srt.model_executor.model_runner as m;"
    "print(json.dumps({'timed': getattr(m.ModelRunner._forward_raw, 'sbo_check_step_timer', False)}))"
)


class FakeEvent:
    """A CUDA event whose completion the test decides: query() is False until `done` is set."""

    clock = 0.0

    def __init__(self) -> None:
        self.at: float | None = None
        self.done = False

    def record(self) -> None:
        FakeEvent.clock += 1.5
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def _batch(decode: bool, size: int) -> Any:
    return SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: decode), batch_size=size)


def test_the_forward_is_wrapped_only_where_the_check_arms_it(tmp_path: Path) -> None:
    pkg = tmp_path / "sglang/srt/model_executor"
    pkg.mkdir(parents=True)
    (pkg / "model_runner.py").write_text(FAKE_RUNNER)
    for folder in (pkg, pkg.parent, pkg.parent.parent):  # regular packages, ahead of an installed sglang
        (folder / "__init__.py").touch()
    base = {k: v for k, v in os.environ.items() if k != step_timer.LOG_ENV}
    path = os.pathsep.join([str(FAULTS), str(tmp_path)])

    def probe(env: dict[str, str]) -> bool:
        out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return bool(json.loads(out.stdout.strip().splitlines()[-1])["timed"])

    assert probe({"PYTHONPATH": path, step_timer.LOG_ENV: str(tmp_path / "steps")})
    assert not probe({"PYTHONPATH": path})  # the folder without the switch
    assert not probe({"PYTHONPATH": str(tmp_path), step_timer.LOG_ENV: str(tmp_path / "steps")})  # the switch alone


def test_decode_forwards_are_timed_and_written_once_their_end_is_reached(tmp_path: Path) -> None:
    log = tmp_path / "steps"
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    steps = step_timer.StepLog(str(log), new_event)
    steps.thread = object()  # the test drains by hand: no reader thread

    class Output:
        can_run_graph = True

    forward = step_timer.timed(lambda self, batch: Output(), steps)
    forward(None, _batch(False, 7))  # a prefill: not timed
    assert not events
    forward(None, _batch(True, 4))
    forward(None, _batch(True, 8))
    assert len(events) == 4
    assert steps.drain() == 0 and not log.exists()  # the GPU has reached neither end
    events[1].done = True
    assert steps.drain() == 1
    rows, offset = step_timer.read(str(log))
    assert rows == [(4, True, 1.5)]
    events[3].done = True
    steps.drain()
    with log.open("a") as f:
        f.write("16 1 2.")  # a line still being written is left for the next read
    rows, offset = step_timer.read(str(log), offset)
    assert rows == [(8, True, 1.5)]
    assert step_timer.read(str(log), offset) == ([], offset)
    assert step_timer.read(str(tmp_path / "absent")) == ([], 0)
