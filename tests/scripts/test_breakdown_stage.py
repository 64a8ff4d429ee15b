"""The GPU check's TTFT breakdown stage (scripts/gpu/breakdown_stage.py) and its injected delays
(scripts/gpu/faults/pd_check_delay.py): each verdict fails on a planted case, the delays wait only
while their flag exists and only where they belong, their targets are where sglang has them, and
the stage's measurement runs against a real `up local-cpu`."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from tests.deploy.ops.test_up import _topology
from tests.deploy.ops.test_up_smoke import _Up

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "scripts/gpu/faults"
sys.path.insert(0, str(REPO / "scripts/gpu"))
sys.path.insert(0, str(FAULTS))
stage = importlib.import_module("breakdown_stage")
delay = importlib.import_module("pd_check_delay")

SGLANG_0517 = REPO / ".venv/sglang-0.5.17"


def parts(**ms: float) -> dict[str, float]:
    base = dict.fromkeys(("queue", "retry", "prefill", "transfer", "decode", "router"), 0.0)
    base.update({k: v / 1000 for k, v in ms.items()})
    return base


def test_server_timing_is_read_in_seconds() -> None:
    got = stage.parse_server_timing("queue;dur=0.5, prefill;dur=1000, prefill_queue;dur=2.25")
    assert got == {"queue": 0.0005, "prefill": 1.0, "prefill_queue": 0.00225}


def test_parts_that_add_up_pass_and_any_that_do_not_fail() -> None:
    good = (0.100, parts(prefill=60, transfer=10, decode=28, router=1))
    assert stage.sums_verdict("none", [good]) is None
    off = (0.100, parts(prefill=60, transfer=10, decode=20, router=1))  # 9 % short
    assert "9.0% off" in (stage.sums_verdict("none", [good, off]) or "")
    lacking = (0.1, {"prefill": 0.1})
    assert "lacks queue" in (stage.sums_verdict("none", [lacking]) or "")
    assert "no timed request" in (stage.sums_verdict("prefill", []) or "")


def test_a_delay_must_be_blamed_on_its_own_part() -> None:
    slow_prefill = (1.1, parts(prefill=1050, transfer=20, decode=30))
    assert stage.blame_verdict("prefill", [slow_prefill]) is None
    assert "blames prefill" in (stage.blame_verdict("transfer", [slow_prefill]) or "")
    # The right part, but far less than the delay: the delay did not land there.
    small = (0.5, parts(prefill=400, transfer=20, decode=30))
    assert stage.blame_verdict("prefill", [small]) is not None
    assert stage.blame_verdict("none", [small]) is None


def test_a_negative_router_part_fails_the_sums() -> None:
    overlapping = (0.100, parts(prefill=70, transfer=20, decode=14, router=-4))
    assert "negative" in (stage.sums_verdict("none", [overlapping]) or "")


def test_the_control_needs_each_blame_to_fail_where_its_delay_was_not() -> None:
    none = [(0.1, parts(prefill=60, transfer=5, decode=35))]
    slow_prefill = [(1.1, parts(prefill=1050, transfer=20, decode=30))]
    slow_transfer = [(1.1, parts(prefill=50, transfer=1000, decode=40))]
    assert stage.control_verdict({"none": none, "prefill": slow_prefill, "transfer": slow_transfer}) is None
    # A breakdown that puts the KV-send delay in `prefill` (the transfer unmeasured): the prefill
    # blame passes on the transfer run, and the control says so.
    unmeasured = [(1.1, parts(prefill=1050, transfer=0, decode=40))]
    why = stage.control_verdict({"none": none, "prefill": slow_prefill, "transfer": unmeasured})
    assert why is not None and "transfer run's timings pass as a slowed prefill" in why


def test_the_table_gives_each_case_its_medians_in_ms() -> None:
    rows = stage.table({"prefill": [(1.0, parts(prefill=900, decode=100)), (1.2, parts(prefill=1100, decode=100))]})
    assert rows == [
        {
            "case": "prefill",
            "requests": 2,
            "client_ttft_ms": 1100.0,
            "queue_ms": 0.0,
            "retry_ms": 0.0,
            "prefill_ms": 1000.0,
            "transfer_ms": 0.0,
            "decode_ms": 100.0,
            "router_ms": 0.0,
            "parts_sum_ms": 1100.0,
        }
    ]


class _Scheduler:
    def __init__(self, mode: str) -> None:
        self.disaggregation_mode = types.SimpleNamespace(value=mode)

    def run_batch(self, batch: object) -> object:
        return batch


def _timed(fn: object, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return time.perf_counter() - t0


def test_a_delay_waits_only_while_its_flag_exists_and_only_in_the_prefill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(delay.DIR_ENV, str(tmp_path))
    run = delay.delayed(_Scheduler.run_batch, "prefill")
    prefill, decode = _Scheduler("prefill"), _Scheduler("decode")
    assert _timed(run, prefill, "b") < 0.1  # no flag
    (tmp_path / "prefill.on").write_text("0.3\n")
    assert _timed(run, prefill, "b") >= 0.3
    assert _timed(run, decode, "b") < 0.1  # a decode server's batches are not the prefill
    assert run(prefill, "batch") == "batch"  # the wrapped method still runs and answers
    (tmp_path / "prefill.on").unlink()
    assert _timed(run, prefill, "b") < 0.1
    logged = [json.loads(line) for line in (tmp_path / "delays.log").read_text().splitlines()]
    assert [(e["event"], e["part"], e["seconds"]) for e in logged] == [("delay", "prefill", 0.3)] * 2


def test_the_patch_wraps_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(delay.DIR_ENV, str(tmp_path))
    module = types.ModuleType("fake_scheduler")
    module.Scheduler = type("Scheduler", (_Scheduler,), {})  # type: ignore[attr-defined]
    patch = delay._patcher("prefill")
    patch(module)
    wrapped = module.Scheduler.run_batch  # type: ignore[attr-defined]
    patch(module)
    assert module.Scheduler.run_batch is wrapped  # type: ignore[attr-defined]
    assert wrapped.pd_check_delay == "prefill"


def _methods(source: Path, cls: str) -> dict[str, list[str]]:
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                f.name: [a.arg for a in f.args.args]
                for f in node.body
                if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
            }
    return {}


@pytest.mark.skipif(not SGLANG_0517.is_dir(), reason="sglang 0.5.17 is not unpacked under .venv")
@pytest.mark.parametrize("part", sorted(delay.TARGETS))
def test_each_target_is_where_sglang_has_it(part: str) -> None:
    module, cls, method = delay.TARGETS[part]
    source = SGLANG_0517 / (module.replace(".", "/") + ".py")
    args = _methods(source, cls).get(method)
    assert args is not None, f"{cls}.{method} is not in {source}"
    assert args[0] == "self"
    # The prefill's wait is told apart by the scheduler's mode, which sglang sets on the Scheduler.
    if part == "prefill":
        assert "self.disaggregation_mode = DisaggregationMode(" in source.read_text()


def test_the_delays_are_armed_only_with_the_checks_folder_and_variable(tmp_path: Path) -> None:
    probe = (
        "import json, sys; print(json.dumps({'delay': 'pd_check_delay' in sys.modules, 'finders': sorted("
        "getattr(f, 'module', '') for f in sys.meta_path if type(f).__name__ == '_PatchOnImport')}))"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("PD_CHECK_")}

    def run(env: dict[str, str]) -> dict[str, object]:
        out = subprocess.run([sys.executable, "-c", probe], env={**base, **env}, capture_output=True, text=True)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    armed = run({"PYTHONPATH": str(FAULTS), delay.DIR_ENV: str(tmp_path)})
    assert armed == {"delay": True, "finders": sorted(m for m, _, _ in delay.TARGETS.values())}
    assert run({"PYTHONPATH": str(FAULTS)}) == {"delay": False, "finders": []}


@pytest.mark.slow
@pytest.mark.serial
def test_the_measurement_adds_up_on_a_real_stack(tmp_path: Path) -> None:
    topo, port = _topology(tmp_path)
    url = f"http://127.0.0.1:{port}"
    up = _Up(topo, tmp_path / "logs", {"MC_MIN_RPC_PORT": "17700", "MC_MAX_RPC_PORT": "18200"})
    try:
        seen = up.read_until(lambda seen: any(ln.startswith("try: ") for ln in seen), timeout_s=180)
        assert up.proc.poll() is None, "".join(seen[-40:])
        result = stage.measure(url, None, tmp_path, cases=("none",))
    finally:
        up.stop()
    assert result["cases"]["none"]["load_completed"] >= stage.LOAD  # the load ran beside the timed requests
    assert stage.verdicts(result) == {"sums_none": None}
    with pytest.raises(ValueError, match="delay folder"):
        stage.measure(url, None, tmp_path, cases=("prefill",))
