"""The SBO server check's must-fail control (scripts/gpu/faults/sbo_check_gemm_fault.py) and its
verdict (gpu_sbo_server.gemm_fault_verdict): the fault is armed only where the check arms it, gates
SBO's down GEMM only while its flag file exists, and a control that is not caught fails the check."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "scripts/gpu/faults"
sys.path.insert(0, str(REPO / "scripts/gpu"))
sys.path.insert(0, str(FAULTS))
run = importlib.import_module("gpu_sbo_server")
fault = importlib.import_module("sbo_check_gemm_fault")

PROBE = (
    "import json, sys, importlib; m = importlib.import_module('sglang_pd.kernels.signal_gemm');"
    "print(json.dumps({'wrapped': getattr(m.fp8_m_grouped_gemm_nt_masked, 'sbo_check_fault', False)}))"
)


def _python(code: str, env: dict[str, str]) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SBO_CHECK_GEMM_FAULT")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_env_names_match_the_fault_module() -> None:
    assert (run.GEMM_FAULT_FLAG_ENV, run.GEMM_FAULT_LOG_ENV) == (fault.FLAG_ENV, fault.LOG_ENV)
    assert run.GEMM_FAULT_SETTLE_S > 5 * fault.POLL_S


def test_the_kernel_entry_is_wrapped_only_with_the_checks_folder_and_flag(tmp_path: Path) -> None:
    flag = {fault.FLAG_ENV: str(tmp_path / "on"), fault.LOG_ENV: str(tmp_path / "log")}
    path = os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")])
    assert _python(PROBE, {"PYTHONPATH": path, **flag}) == {"wrapped": True}
    events = [json.loads(line)["event"] for line in (tmp_path / "log").read_text().splitlines()]
    assert events == ["armed"]
    # Control: the folder without the flag variable wraps nothing.
    assert _python(PROBE, {"PYTHONPATH": path}) == {"wrapped": False}


def _wait_for(predicate: Any, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(fault.POLL_S)
    return False


def test_the_gate_zeroes_the_faulty_experts_scales_only_while_the_flag_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, log = tmp_path / "on", tmp_path / "log"
    monkeypatch.setenv(fault.LOG_ENV, str(log))
    seen: list[torch.Tensor] = []

    def entry(lhs: tuple[torch.Tensor, torch.Tensor], *args: Any, **kwargs: Any) -> tuple[None, None]:
        seen.append(lhs[1].clone())
        return None, None

    gemm = fault.faulty(entry, fault.Gates(str(flag)))
    experts = 16

    def call() -> torch.Tensor:
        scale = torch.full((experts, 8, 4), 2.0)  # (experts, rows, K / 128), as sglang passes it
        gemm((torch.zeros(1), scale), None, None, None, 8)
        return seen[-1]

    assert bool((call() == 2.0).all())  # off: untouched
    flag.touch()
    assert _wait_for(lambda: bool((call()[list(fault.FAULTY_EXPERTS)] == 0).all()))
    got = call()
    assert bool((got[len(fault.FAULTY_EXPERTS) :] == 2.0).all())  # every other expert as it was
    flag.unlink()
    assert _wait_for(lambda: bool((call() == 2.0).all()))
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert events[:2] == ["gate", "gated"] and "on" in events and events[-1] == "off"


def test_an_integer_scale_is_refused_by_name(tmp_path: Path) -> None:
    gemm = fault.faulty(lambda *a, **k: None, fault.Gates(str(tmp_path / "on")))
    with pytest.raises(RuntimeError, match="float activation scales"):
        gemm((torch.zeros(1), torch.zeros(4, 2, dtype=torch.int32)))


def _out(ids: list[int]) -> dict[str, Any]:
    return {"status": 200, "ids": ids, "logprobs": [-0.5] * len(ids)}


def _sbo(with_fault: list[list[int]], after: list[list[int]], events: list[str]) -> dict[str, Any]:
    return {
        "outputs": [_out([1, 2, 3]), _out([4, 5, 6])],
        "gemm_fault": {
            "before_fault": [_out([1, 2, 3]), _out([4, 5, 6])],
            "with_fault": [_out(i) for i in with_fault],
            "after_fault": [_out(i) for i in after],
            "events": [{"event": e} for e in events],
        },
    }


NOSBO = {"outputs": [_out([1, 2, 3]), _out([4, 5, 6])]}
EVENTS = ["armed", "gate", "gated", "on", "off"]


def test_the_control_passes_when_the_fault_changes_an_output_and_the_switch_is_clean() -> None:
    got = run.gemm_fault_verdict(_sbo([[1, 9, 9], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], EVENTS))
    assert got["verdict"] == "passed"
    assert got["with_fault_vs_before"]["identical"] == "1/2"


@pytest.mark.parametrize(
    ("with_fault", "after", "events", "reason"),
    [
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], EVENTS, "control not caught"),
        ([[1, 9, 9], [4, 5, 6]], [[1, 9, 9], [4, 5, 6]], EVENTS, "did not return to its own outputs"),
        ([[1, 9, 9], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], ["armed", "on", "off"], "never passed the fault's gate"),
        (
            [[1, 9, 9], [4, 5, 6]],
            [[1, 2, 3], [4, 5, 6]],
            ["armed", "gate", "gated", "on"],
            "did not switch on and then off",
        ),
    ],
)
def test_the_control_fails_the_check(
    with_fault: list[list[int]], after: list[list[int]], events: list[str], reason: str
) -> None:
    got = run.gemm_fault_verdict(_sbo(with_fault, after, events))
    assert reason in got["verdict"]


def test_the_comparisons_give_a_verdict_for_each_requirement(tmp_path: Path) -> None:
    report: dict[str, Any] = {"sbo": _sbo([[1, 9, 9], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], EVENTS), "nosbo": NOSBO}
    run.add_comparisons(report, tmp_path / "no-ref.json")
    assert report["verdicts"] == {"sbo_vs_nosbo_one_at_a_time": "passed", "gemm_fault_control": "passed"}
    # A planted difference between SBO on and off fails the identity verdict.
    report = {
        "sbo": _sbo([[1, 9, 9], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], EVENTS),
        "nosbo": {"outputs": [_out([1, 2, 3]), _out([4, 5, 7])]},
    }
    run.add_comparisons(report, tmp_path / "no-ref.json")
    assert "1/2 identical" in report["verdicts"]["sbo_vs_nosbo_one_at_a_time"]


def test_only_the_sbo_server_is_armed(tmp_path: Path) -> None:
    class Started:
        def __init__(self) -> None:
            self.out = tmp_path
            self.envs: dict[str, dict[str, str]] = {}

        def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
            self.envs[name] = dict(env or {})

    stack = Started()
    topology = run.derived_topology(tmp_path)
    for name in ("sbo", "nosbo"):
        run.start_server(stack, topology, name, gemm_fault=True)  # type: ignore[arg-type]
    assert stack.envs["sbo"][fault.FLAG_ENV] == str(tmp_path / "gemm-fault.on")
    assert stack.envs["sbo"]["PYTHONPATH"].split(os.pathsep)[0] == str(FAULTS)
    # Both servers carry the step timer (the faults folder on their path, each its own file); only SBO's is armed.
    assert fault.FLAG_ENV not in stack.envs["nosbo"] and fault.LOG_ENV not in stack.envs["nosbo"]
    assert stack.envs["nosbo"]["PYTHONPATH"].split(os.pathsep)[0] == str(FAULTS)
    assert {stack.envs[n][run.step_timer.LOG_ENV] for n in ("sbo", "nosbo")} == {
        str(tmp_path / "sbo.steps"),
        str(tmp_path / "nosbo.steps"),
    }
    assert not (tmp_path / "gemm-fault.on").exists()  # armed, but off until the check switches it on


def test_each_fault_pass_request_starts_from_an_empty_cache_and_a_refused_flush_is_asked_again() -> None:
    """A loopback server answering as sglang does: `/flush_cache` is 400 while a request runs (here the
    first time it is asked), `/generate` carries meta_info's output_token_logprobs."""
    import asyncio

    from aiohttp import web

    seen: list[str] = []
    refused = {"left": 1}

    async def flush(_: web.Request) -> web.Response:
        seen.append("flush")
        if refused["left"]:
            refused["left"] -= 1
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(text="Cache flushed.\n")

    async def generate(request: web.Request) -> web.Response:
        seen.append("generate " + (await request.json())["text"])
        return web.json_response({"meta_info": {"output_token_logprobs": [[-0.5, 7, None]]}})

    async def main() -> list[dict[str, Any]]:
        app = web.Application()
        app.router.add_post("/flush_cache", flush)
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await run.greedy(f"http://127.0.0.1:{port}", ["a", "b"], flush=True)
        finally:
            await runner.cleanup()

    got = asyncio.run(main())
    assert got == [{"status": 200, "ids": [7], "logprobs": [-0.5]}] * 2
    assert seen == ["flush", "flush", "generate a", "flush", "generate b"]
