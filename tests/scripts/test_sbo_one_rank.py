"""The one-rank SBO run's pieces that need no GPU: the layer benchmark's variants and the rows it
gathers (through its own `gather_row`, on a one-process gloo group), and the report that judges them."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
dist = pytest.importorskip("torch.distributed")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts/gpu"))
sys.path.insert(0, str(REPO / "benchmarks"))
import sbo_one_rank_report as report_mod  # noqa: E402
import sbo_waves  # noqa: E402
from replay_check import ReplayTally  # noqa: E402

pytestmark = pytest.mark.slow  # imports torch, triton and the kernels: a few seconds


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """benchmarks/bench_moe_layer.py as a module, on a one-process gloo group (its `gather_row`
    gathers across ranks); the environment it sets at import is put back afterwards."""
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location("bench_moe_layer", REPO / "benchmarks/bench_moe_layer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield module
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


# %%
# The benchmark's variants
# ------------------------


def test_variant_names_parse_and_bad_ones_say_what_exists(bench: ModuleType) -> None:
    assert bench.parse_variant("full@16") == ("full", 16)
    assert bench.parse_variant("deepgemm") == ("deepgemm", None)
    for bad in ("full", "none@3", "fast@3", "shared@1"):
        with pytest.raises(ValueError, match="unknown decode variant"):
            bench.parse_variant(bad)


def test_the_sweep_gives_one_full_variant_per_send_sm_count_and_the_controls_use_the_first(bench: ModuleType) -> None:
    args = type("Args", (), {"combine_sms": [3, 8, 16], "replay_check": 100, "full_alt": False})()
    timed, extra = bench.decode_variants(args, deepgemm=True)
    assert timed == ["none", "deepgemm", "shared", "full@3", "full@8", "full@16"]
    assert extra == ["full_split@3", "full_skip_wait@3"]
    args.replay_check = 0
    timed, extra = bench.decode_variants(args, deepgemm=False)
    assert "deepgemm" not in timed and extra == []


def test_full_alt_times_each_send_sm_count_beside_full_with_the_shared_expert_where_sglang_runs_it(
    bench: ModuleType,
) -> None:
    args = type("Args", (), {"combine_sms": [3, 16], "replay_check": 0, "full_alt": True})()
    timed, _ = bench.decode_variants(args, deepgemm=False)
    assert timed == ["none", "shared", "full@3", "full_alt@3", "full@16", "full_alt@16"]
    assert bench.parse_variant("full_alt@16") == ("full_alt", 16)
    # none's arrangement for the shared expert; full's runs it inside the dispatch window
    assert "full_alt" in bench.SHARED_ON_ALT and "full" not in bench.SHARED_ON_ALT
    with pytest.raises(ValueError, match="unknown decode variant"):
        bench.parse_variant("full_alt")


def test_sglang_h20_rule_caps_the_overlapped_down_gemm_only_up_to_64_rows(bench: ModuleType) -> None:
    assert [bench.full_max_block_n(160, m) for m in (1, 64, 65, 128)] == [160, 160, 256, 256]
    assert [bench.full_max_block_n(256, m) for m in (1, 128)] == [256, 256]


# %%
# Rows as the benchmark gathers them, and the report
# --------------------------------------------------


def _tally(name: str, replays: int, mismatched: int = 0, must_fail: bool = False) -> dict[str, Any]:
    tally = ReplayTally(name, must_fail=must_fail)
    for i in range(replays):
        tally.add(i, 5 if i < mismatched else 0)
    return tally.as_dict()


def _row(bench: ModuleType, t: int, bn: int, us: dict[str, float], caught: int = 10) -> dict[str, Any]:
    """One token count's row as `decode_one` builds it on a rank, through the benchmark's `gather_row`."""
    em = max(1, -(-t * 8 // 16))
    good = {"rel_err": 0.012, "max_abs_err": 0.04, "finite": True}
    variants: dict[str, Any] = {k: {"eager_check": good, "us": v, "us_min": v, "timing": "cuda-graph", "ok": True}
                                for k, v in us.items()}  # fmt: skip
    variants["full_split@3"] = {"eager_check": good, "timing": "cuda-graph", "ok": True}
    tallies = {k: _tally(k, 10) for k in (*[k for k in us if k not in ("none", "deepgemm")], "full_split@3")}
    tallies["full_skip_wait@3"] = _tally("full_skip_wait@3", 10, caught, must_fail=True)
    variants["full_skip_wait@3"] = {"eager_check": {"rel_err": float("inf"), "finite": False}, "ok": caught > 0}
    row = {
        "tokens_per_rank": t, "expected_m": em, "combine_sms": [3, 16],
        "max_block_n_full": bench.full_max_block_n(bn, em), "variants": variants,
        "waves": {"3": sbo_waves.describe([t * 8 // 16] * 16, block_m=64, n_blocks=28, programs=129, expected_m=em,
                                          m_max=256, warp_specialized=True, send_sms=3)},
        "recv_tokens": t * 8, "experts_without_tokens": 0,
        "replay_check": {"replays": 10, "seconds": 0.1, "tallies": tallies,
                         "last_input_none_vs_torch": good},
    }  # fmt: skip
    return bench.gather_row(0, 1, row)


def _write_run(bench: ModuleType, out: Path, *, slow_160: float = 1.0, caught: int = 10, cut_off: bool = False) -> None:
    out.mkdir()
    for bn in (256, 160):
        rows = []
        for t in (8, 256):
            scale = slow_160 if bn == 160 and t == 8 else 1.0
            us = {"none": 300.0, "shared": 301.0, "full@3": 330.0 * scale, "full@16": 301.0 * scale}
            if bn == 256:
                us["deepgemm"] = 310.0
            rows.append(_row(bench, t, bn, us, caught))
        result = {"command": "bench", "gpu": "NVIDIA H200", "date": "2026-12-04", "torch": "2.11.0", "triton": "3.6.0",
                  "complete": True, "deep_ep": {"revision": "76f0271"}, "decode": rows}  # fmt: skip
        (out / f"decode_1gpu_bn{bn}.json").write_text(json.dumps(result))
    (out / "kernel_tests_fp8_a.log").write_text(
        "........ [100%]\n==== 273 passed, 599 deselected in 81.20s (0:01:21) ====\n"
        if not cut_off
        else ".................................................................... [ 24%]\n......F. [ 27%]\n"
    )
    (out / "kernel_tests_ordering.log").write_text("sglang: 1000 runs\n4 passed, 868 deselected in 40.1s\n")
    (out / "ptx_fences.json").write_text(json.dumps({"ok": True, "releases": 41, "unfenced": []}))
    (out / "steps.jsonl").write_text('{"step": "deepep_build", "exit": 0, "seconds": 101}\n')


def test_a_clean_run_is_ok_and_its_table_reads_the_sweep(bench: ModuleType, tmp_path: Path) -> None:
    _write_run(bench, tmp_path / "out")
    result = report_mod.report(tmp_path / "out", "abc1234", "cmd")
    assert result["verdict"] == {"ok": True, "problems": []}
    rows = result["layer"]["max_block_n_256"]
    assert rows[0]["full_vs_none_pct"] == {"full@3": 10.0, "full@16": 0.33}
    assert rows[0]["full_vs_deepgemm_pct"]["full@3"] == pytest.approx(6.45)
    assert rows[0]["replay_check"]["controls_caught"] == {"full_skip_wait@3": "10/10"}
    assert rows[0]["waves"]["3"]["gemm_waves"] == 4
    text = report_mod.table(result)
    assert "verdict: ok" in text and "+10.0/  +6.5" in text and "caught 10/10" in text


def test_a_control_not_caught_fails_the_run(bench: ModuleType, tmp_path: Path) -> None:
    _write_run(bench, tmp_path / "out", caught=0)
    result = report_mod.report(tmp_path / "out")
    assert not result["verdict"]["ok"]
    assert any("NOT caught" in p for p in result["verdict"]["problems"]), result["verdict"]
    assert report_mod.main([str(tmp_path / "out")]) == 1
    assert json.loads((tmp_path / "out" / "sbo_one_rank.json").read_text())["verdict"]["ok"] is False


def test_tests_cut_off_by_the_budget_fail_the_run_and_show_how_far_they_got(bench: ModuleType, tmp_path: Path) -> None:
    _write_run(bench, tmp_path / "out", cut_off=True)
    result = report_mod.report(tmp_path / "out")
    assert result["kernel_tests"]["fp8_a"] == {
        "complete": False, "counts": {"passed": 75, "failed": 1}, "seconds": None,
        "summary": "cut off (no summary line)", "failures": [],
    }  # fmt: skip
    assert any("cut off" in p for p in result["verdict"]["problems"])


def test_tests_that_all_skipped_fail_the_run(bench: ModuleType, tmp_path: Path) -> None:
    _write_run(bench, tmp_path / "out")
    (tmp_path / "out" / "kernel_tests_fp8_a.log").write_text("273 skipped, 655 deselected in 4.62s\n")
    problems = report_mod.report(tmp_path / "out")["verdict"]["problems"]
    assert any("none passed" in p for p in problems), problems


def test_full_alt_is_judged_beside_full_and_a_layer_only_run_needs_no_kernel_tests(
    bench: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    _write_run(bench, out)
    for name in ("kernel_tests_fp8_a.log", "kernel_tests_ordering.log", "ptx_fences.json"):
        (out / name).unlink()
    data = json.loads((out / "decode_1gpu_bn256.json").read_text())
    data["decode"][0]["variants"]["full_alt@16"] = {"us": 303.0, "us_min": 303.0, "timing": "cuda-graph", "ok": True}
    (out / "decode_1gpu_bn256.json").write_text(json.dumps(data))
    # the whole run still needs its kernel tests and PTX check: missing, they fail it
    problems = report_mod.report(out)["verdict"]["problems"]
    assert "no kernel test log" in problems and any("PTX" in p for p in problems), problems
    result = report_mod.report(out, layer_only=True)
    assert result["verdict"] == {"ok": True, "problems": []} and result["parts"].startswith("the layer benchmark only")
    assert result["layer"]["max_block_n_256"][0]["full_vs_none_pct"]["full_alt@16"] == 1.0
    assert "+1.0/" in report_mod.table(result)


def test_pytest_summaries_parse() -> None:
    r = report_mod.pytest_result("F.\nFAILED tests/x.py::t - boom\n=== 1 failed, 272 passed, 1 error in 81.23s ===\n")
    assert r["complete"] and r["counts"] == {"failed": 1, "passed": 272, "error": 1} and r["seconds"] == 81.23
    assert r["failures"] == ["FAILED tests/x.py::t - boom"]


@pytest.mark.parametrize(("slow", "costs"), [(1.05, True), (1.005, False)])
def test_the_160_decision_weighs_full_sbo_against_the_spread_of_none(
    bench: ModuleType, tmp_path: Path, slow: float, costs: bool
) -> None:
    _write_run(bench, tmp_path / "out", slow_160=slow)
    decision = report_mod.report(tmp_path / "out")["max_block_n_160_decision"]
    by_t = {x["tokens_per_rank"]: x for x in decision["rows"]}
    assert by_t[8]["max_block_n_full"] == 160 and by_t[8]["costs"] is costs
    assert by_t[256]["max_block_n_full"] == 256 and by_t[256]["costs"] is False  # the rule ends at 64 rows
    assert ("T = [8]" in decision["reading"]) is costs


def test_the_report_refuses_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        report_mod.main([str(tmp_path / "nowhere")])
    assert "is not a folder" in capsys.readouterr().err


def test_the_benchmark_prints_one_line_per_token_count(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    row = _row(bench, 8, 256, {"none": 300.0, "deepgemm": 310.0, "shared": 301.0, "full@3": 330.0})
    bench.print_decode_row(row)
    out = capsys.readouterr().out
    assert "full@3" in out and "330.0" in out and "10.0" in out and "yes ok" in out
