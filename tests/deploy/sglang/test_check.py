"""Every rendered command passes sglang's own resolver and checks; its errors come back verbatim.

The effective view: sglang's own predicates (SboFlags, is_tbo_enabled, ...) evaluated on the
resolved arguments at the topology's GPU capability say what sglang will actually run.
"""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.ops.plan import build_plan, format_plan
from sglang_pd.deploy.sglang.check import SglangUnavailable, check_with_sglang, sglang_available
from sglang_pd.deploy.sglang.render import render_plan
from sglang_pd.deploy.spec.topology import PRESETS_DIR, Topology, check_rules, load_topology, parse_topology
from sglang_pd.sglang_patches import status
from tests.support import deepep_revision
from tests.support.override_cases import OVERRIDES

PRESET_DIR = PRESETS_DIR

needs_sglang = pytest.mark.skipif(
    not sglang_available(), reason="sglang is not installed (the `validate` extra + sglang --no-deps)"
)
pytestmark = [pytest.mark.sglang, needs_sglang, pytest.mark.slow]  # a fresh interpreter per resolve


@pytest.fixture(scope="module", autouse=True)
def _antgroup_deepep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The DeepEP installed here is antgroup-opt (the image's), for the checks that judge this machine's
    (`local_deepep`): with sgl-deep-ep the plugin refuses full SBO on the presets' multi-node decode
    (tests/deploy/ops/test_doctor.py and test_plan_check.py show that refusal)."""
    with pytest.MonkeyPatch.context() as mp:
        deepep_revision.install(tmp_path_factory.mktemp("antgroup-opt"), mp)
        yield
    status.deepep_layout.cache_clear()


@pytest.fixture(scope="module")
def preset_checks():
    """`preset_checks(name)`: sglang's verdicts on a preset, computed once per module (a child process each)."""
    cache: dict[str, list] = {}

    def get(name: str) -> list:
        if name not in cache:
            cache[name] = check_with_sglang(load_topology(PRESET_DIR / f"{name}.yaml"))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def r1_checks(preset_checks):
    return preset_checks("deepseek-r1-h200-1p1d")


def test_r1_prefill_resolves(r1_checks) -> None:
    prefill = [c for c in r1_checks if c.command.role == "prefill"]
    assert len(prefill) == 1 and prefill[0].ok, prefill[0].error
    r = prefill[0].resolved
    assert r["disaggregation_mode"] == "prefill"
    assert r["disaggregation_bootstrap_port"] == 8998
    assert (r["tp_size"], r["ep_size"], r["attn_dp_size"]) == (8, 8, 8)
    assert r["page_size"] == 64
    assert r["enable_two_batch_overlap"] is True
    assert (r["moe_a2a_backend"], r["deepep_mode"]) == ("deepep", "normal")


def test_r1_decode_resolves(r1_checks) -> None:
    decode = [c for c in r1_checks if c.command.role == "decode"]
    assert [c.command.node_rank for c in decode] == [0, 1]
    for c in decode:
        assert c.ok, c.error
        r = c.resolved
        assert r["disaggregation_mode"] == "decode"
        assert (r["tp_size"], r["attn_dp_size"], r["ep_size"]) == (16, 16, 16)
        assert r["page_size"] == 64
        assert r["cuda_graph_max_bs_decode"] == 128
        assert r["enable_single_batch_overlap"] is True
        assert r["enable_two_batch_overlap"] is False
        assert (r["moe_a2a_backend"], r["deepep_mode"]) == ("deepep", "low_latency")
        assert (r["nnodes"], r["node_rank"]) == (2, c.command.node_rank)


@pytest.mark.parametrize("name", ["deepseek-v3-h20-3p2d", "local-cpu"])
def test_other_presets_resolve(preset_checks, name: str) -> None:
    t = load_topology(PRESET_DIR / f"{name}.yaml")
    checks = preset_checks(name)
    assert len(checks) == sum(len(v) for v in render_plan(t).values())
    for c in checks:
        assert c.ok, (c.command.role, c.error)
        r = c.resolved
        spec = t.prefill if c.command.role == "prefill" else t.decode
        assert r["disaggregation_mode"] == c.command.role
        assert (r["tp_size"], r["attn_dp_size"], r["ep_size"]) == (spec.tp, spec.attn_dp_size, spec.ep)
        assert r["page_size"] == t.model.page_size
        assert r["disaggregation_bootstrap_port"] == t.prefill.bootstrap_port
    if name == "deepseek-v3-h20-3p2d":
        decode = [c for c in checks if c.command.role == "decode"]
        assert all(c.resolved["cuda_graph_max_bs_decode"] == 32 for c in decode)
        assert all(c.resolved["enable_single_batch_overlap"] for c in decode)


def test_sglang_rejection_comes_back_as_its_own_text(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["extra_args"] = ["--attention-backend", "no-such-backend"]
    checks = check_with_sglang(parse_topology(d, source_dir=PRESET_DIR))
    decode = [c for c in checks if c.command.role == "decode"]
    assert all(not c.ok for c in decode)
    assert "--attention-backend" in decode[0].error and "no-such-backend" in decode[0].error
    assert all(c.ok for c in checks if c.command.role == "prefill")


def test_workarounds_touch_only_the_copy() -> None:
    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    before = render_plan(t)
    checks = check_with_sglang(t)
    after = render_plan(t)
    assert before == after
    deployed = checks[0].command.argv
    assert "--device" not in deployed and "--disaggregation-ib-device" in deployed
    assert deployed[deployed.index("--model-path") + 1] == "deepseek-ai/DeepSeek-R1"


def test_hub_model_without_config_json_is_explained(preset_dict) -> None:
    d = preset_dict()
    del d["model"]["config_json"]
    with pytest.raises(SglangUnavailable, match=r"set model.config_json in the topology"):
        check_with_sglang(parse_topology(d, source_dir=PRESET_DIR))


def _child_of(check, python: Path):  # type: ignore[no-untyped-def]
    [child] = [r for (exe, cap, _), r in check._RESOLVERS.items() if (exe, cap) == (str(python), (9, 0)) and r.alive]
    return child


def test_one_child_serves_every_check_of_a_gpu_generation_and_a_dead_one_is_replaced(tmp_path: Path) -> None:
    from sglang_pd.deploy.sglang import check

    # A stand-in child that answers every job as sglang's resolver would refuse it.
    python = tmp_path / "python"
    python.write_text(
        '#!/bin/sh\nwhile read -r job; do echo \'sglang-pd-result {"ok": false, "error": "stand-in"}\'; done\n'
    )
    python.chmod(0o755)
    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    assert {c.error for c in check_with_sglang(t, python=str(python))} == {"stand-in"}
    child = _child_of(check, python)
    check_with_sglang(t, python=str(python))
    assert _child_of(check, python) is child
    child._proc.kill()
    child._proc.wait()
    assert {c.error for c in check_with_sglang(t, python=str(python))} == {"stand-in"}
    assert _child_of(check, python) is not child


def test_a_resolver_that_dies_is_an_error_not_a_hang(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'no sglang here' >&2\nexit 3\n")
    python.chmod(0o755)
    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    with pytest.raises(RuntimeError, match=r"(?s)failed \(exit 3\) before checking every command.*no sglang here"):
        check_with_sglang(t, python=str(python))


# --- the effective view -------------------------------------------------------------------------


def facts(check) -> dict:
    return {k: v.get("value", v.get("error")) for k, v in check.effective["facts"].items()}


@pytest.mark.parametrize("name", ["deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d"])
def test_presets_run_both_sbo_halves_on_decode_and_tbo_on_prefill(preset_checks, name: str) -> None:
    checks = preset_checks(name)
    for c in checks:
        assert c.passed, (c.command.role, c.error, c.problems)
        assert c.effective["capability"] == "sm_90"
        assert c.effective["sglang_version"] == importlib.metadata.version("sglang")
    for c in (c for c in checks if c.command.role == "decode"):
        f = facts(c)
        # sglang's own SboFlags at compute capability 9.0, with the sglang-pd plugin loaded.
        assert f["sbo_enabled"] is True
        assert f["sbo_combine_down_gemm_overlap"] is True  # enable_combine_down_gemm_two_stream_overlap()
        assert f["sbo_dispatch_shared_overlap"] is True  # enable_dispatch_shared_one_stream_overlap()
        assert (f["moe_runner_backend"], f["deepep_mode"], f["attn_dp_size"]) == ("deep_gemm", "low_latency", 16)
        assert f["tbo"] is False
        assert f["cuda_graph_decode"]["backend"] == "full"
        assert f["cuda_graph_decode"]["max_bs"] >= -(
            -load_topology(PRESET_DIR / f"{name}.yaml").decode.max_running_requests // 16
        )
        assert f["lm_head"] == "vocab-sharded, all-to-all"  # sglang's default (PR #32313)
        assert f["decode_attention_backend"] == "fa3"  # sglang's Hopper default for MLA
    for c in (c for c in checks if c.command.role == "prefill"):
        f = facts(c)
        assert f["tbo"] is True and f["sbo_enabled"] is False
        assert (f["attn_dp_size"], f["deepep_mode"]) == (8, "normal")


def test_sbo_without_the_deep_gemm_runner_is_named(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["moe_runner_backend"] = "triton"  # check_rules refuses this; the effective view must too
    checks = check_with_sglang(parse_topology(d, source_dir=PRESET_DIR))
    decode = [c for c in checks if c.command.role == "decode"]
    for c in decode:
        assert c.ok and not c.passed  # sglang accepts the flags, but would not run the overlap
        assert facts(c)["sbo_combine_down_gemm_overlap"] is False
        assert facts(c)["sbo_dispatch_shared_overlap"] is True
        (problem,) = c.problems
        assert "SBO's down-GEMM/combine overlap is not effective" in problem
        assert "add --moe-runner-backend deep_gemm" in problem


@pytest.mark.parametrize(
    ("change", "names", "not_named"),
    [
        # DeepEP low-latency is already set: the advice must name the flag, not decode.deepep_mode.
        (
            {"extra_args": ["--disable-cuda-graph"]},
            "decode.extra_args has --disable-cuda-graph, which turns them off; remove it from decode.extra_args",
            "decode.deepep_mode",
        ),
        (
            {"extra_args": ["--cuda-graph-backend-decode", "disabled"]},
            "decode.extra_args has --cuda-graph-backend-decode disabled",
            "decode.deepep_mode",
        ),
        (
            {"deepep_mode": "normal", "sbo": "off"},
            "(decode.deepep_mode: normal); set decode.deepep_mode: low_latency",
            "decode.extra_args has",
        ),
    ],
)
def test_decode_without_cuda_graphs_names_the_field_that_turned_them_off(
    preset_dict, change: dict, names: str, not_named: str
) -> None:
    d = preset_dict()
    d["decode"].update(change)
    checks = check_with_sglang(parse_topology(d, source_dir=PRESET_DIR))
    decode = [c for c in checks if c.command.role == "decode"]
    assert decode
    for c in decode:
        assert facts(c)["cuda_graph_decode"]["backend"] == "disabled"  # sglang's own resolution
        (problem,) = [p for p in c.problems if "without CUDA graphs" in p]
        assert names in problem and not_named not in problem, problem


def test_sbo_verdicts_name_the_images_deepep_by_default(r1_checks) -> None:
    from sglang_pd.deploy.sglang.check import effective_problems
    from sglang_pd.deploy.sglang.image_deepep import IMAGE_DEEPEP

    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    (decode, *_) = [c for c in r1_checks if c.command.role == "decode"]
    assert (decode.effective["deepep"], decode.effective["deepep_judged"]) == (IMAGE_DEEPEP, "image")
    effective = json.loads(json.dumps(decode.effective))
    effective["facts"]["sbo_combine_down_gemm_overlap"] = {"value": False}
    (problem,) = effective_problems(t, decode.command, effective)
    assert "SBO's down-GEMM/combine overlap is not effective" in problem
    assert f"judged with {IMAGE_DEEPEP}; `sglang-pd doctor --expect full` in a pod" in problem
    plan = replace(build_plan(t, check_rules(t)), sglang_checks=[c.as_dict() for c in r1_checks])
    assert f"down-GEMM/combine True; with {IMAGE_DEEPEP})" in format_plan(plan, "table")


def test_local_deepep_verdicts_say_they_judge_this_machines_deepep_not_the_images() -> None:
    from sglang_pd.deploy.sglang.check import effective_problems
    from sglang_pd.deploy.sglang.sbo import deepep_here

    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    checks = check_with_sglang(t, local_deepep=True)
    (decode, *_) = [c for c in checks if c.command.role == "decode"]
    # The child that resolved reports the DeepEP it saw: here the antgroup-opt sources this module installs.
    assert decode.passed and decode.effective["deepep"] == deepep_here() != "none"
    effective = json.loads(json.dumps(decode.effective))
    effective["facts"]["sbo_combine_down_gemm_overlap"] = {"value": False}
    (problem,) = effective_problems(t, decode.command, effective)
    assert (
        f"judged with the DeepEP installed where this check runs ({decode.effective['deepep']}), not the cluster "
        "image's; `sglang-pd doctor --expect full` in the image" in problem
    )
    plan = replace(build_plan(t, check_rules(t)), sglang_checks=[c.as_dict() for c in checks])
    assert f"with this machine's DeepEP, {decode.effective['deepep']}, not necessarily the image's" in format_plan(
        plan, "table"
    )


def test_an_sbo_refusal_is_reported_once_not_again_for_each_moe_fact_it_hid(r1_checks) -> None:
    from sglang_pd.deploy.sglang.check import effective_problems

    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    (decode, *_) = [c for c in r1_checks if c.command.role == "decode"]
    effective = json.loads(json.dumps(decode.effective))
    # What the child reports when the plugin refuses full SBO with this machine's DeepEP: sglang's
    # initialize_moe_config raised, so every MoE fact carries that error.
    raised = "sglang's initialize_moe_config raised ValueError: SBO (single batch overlap) is not supported"
    moe = ("moe_a2a_backend", "moe_runner_backend", "deepep_mode", "tbo", "sbo_enabled", "sbo_shared_overlap")
    effective["facts"].update({name: {"error": raised} for name in moe})
    (problem,) = effective_problems(t, decode.command, effective)
    assert problem.startswith(f"decode: sglang refuses --enable-single-batch-overlap on H200: {raised}")
    assert "judged with the image's DeepEP" in problem
    # An unknown fact for another reason is still named.
    effective["facts"]["tbo"] = {"error": "AttributeError: no is_tbo_enabled"}
    assert any(
        p.startswith("decode: cannot tell whether two-batch overlap")
        for p in effective_problems(t, decode.command, effective)
    )


def test_tbo_and_lm_head_asked_but_not_effective_are_named(r1_checks) -> None:
    from sglang_pd.deploy.sglang.check import effective_problems

    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    (prefill,) = [c for c in r1_checks if c.command.role == "prefill"]
    effective = json.loads(json.dumps(prefill.effective))
    effective["facts"]["tbo"] = {"value": False}
    effective["facts"]["dp_lm_head"] = {"value": True}
    problems = effective_problems(t, prefill.command, effective)
    assert any("check --enable-two-batch-overlap" in p for p in problems)
    assert any("check --enable-dp-lm-head" in p for p in problems)
    effective["facts"]["tbo"] = {"error": "AttributeError: no is_tbo_enabled"}
    assert any(
        p.startswith("prefill: cannot tell whether two-batch overlap")
        for p in effective_problems(t, prefill.command, effective)
    )


def test_plan_check_json_includes_the_effective_view(capsys) -> None:
    assert main(["plan", "deepseek-r1-h200-1p1d", "--check", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    decode = [c for c in doc["sglang_check"] if c["role"] == "decode"]
    assert decode and all(c["ok"] and c["problems"] == [] for c in decode)
    f = decode[0]["effective"]["facts"]
    assert f["sbo_combine_down_gemm_overlap"] == {"value": True}
    assert f["sbo_dispatch_shared_overlap"] == {"value": True}


def test_plan_check_fails_when_sbo_is_asked_with_the_triton_runner(capsys, preset_dict, write_topology) -> None:
    d = preset_dict()
    d["decode"]["moe_runner_backend"] = "triton"
    assert main(["plan", str(write_topology(d)), "--check", "--format", "json"]) == 1
    err = capsys.readouterr().err
    assert "--moe-runner-backend deep_gemm" in err and "decode.moe_runner_backend" in err


def test_plan_table_shows_the_effective_view(r1_checks) -> None:
    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    plan = replace(build_plan(t, check_rules(t)), sglang_checks=[c.as_dict() for c in r1_checks])
    out = format_plan(plan, "table")
    assert "what it will run (the effective view)" in out
    assert "SBO True (shared True, down-GEMM/combine True; with the image's DeepEP" in out and "TBO True" in out


# --- the batches sglang resolves, against the DeepEP dispatch budget it reads ------------------------------


def _dispatch_problems(checks, role: str) -> list[str]:
    return [p for c in checks if c.command.role == role for p in c.problems if "DeepEP's host assert" in p]


def test_graph_sizes_sglang_derives_beyond_the_budget_are_named(preset_dict) -> None:
    # Neither cuda_graph_max_bs nor max_running_requests: the rules have nothing to compare, sglang picks the
    # graph sizes itself.
    d = preset_dict()
    del d["decode"]["cuda_graph_max_bs"], d["decode"]["max_running_requests"]
    checks = check_with_sglang(parse_topology(d, source_dir=PRESET_DIR))
    decode = [c for c in checks if c.command.role == "decode"]
    largest = facts(decode[0])["cuda_graph_decode"]["max_bs"]
    assert largest > 128  # sglang's own choice here
    for c in decode:
        (problem,) = _dispatch_problems([c], "decode")
        assert problem.startswith(f"decode: sglang captures decode CUDA graphs up to batch {largest} a rank, above ")
        assert "(SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=128)" in problem
        assert "Set decode.cuda_graph_max_bs to at most 128" in problem
    assert _dispatch_problems(checks, "prefill") == []  # DeepEP normal on prefill: no low-latency budget


def _overridden(preset_dict, budget: str | None = None) -> Topology:
    """The chunk and graph-size overrides the rules refuse (tests/support/override_cases.py), as sglang gets them."""
    d = OVERRIDES["decode graph sizes"].apply(OVERRIDES["prefill chunk"].apply(preset_dict()))
    if budget is not None:
        for role in ("prefill", "decode"):
            d[role]["env"] = {**d[role].get("env", {}), "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": budget}
    return parse_topology(d, source_dir=PRESET_DIR)


def test_the_effective_command_is_judged_against_the_budget(preset_dict) -> None:
    checks = check_with_sglang(_overridden(preset_dict))
    assert all(c.ok for c in checks), [c.error for c in checks]
    (chunk,) = _dispatch_problems(checks, "prefill")
    # 8192 from extra_args, divided over 8 attention-DP ranks: what sglang resolved, not the topology's 128.
    assert chunk.startswith("prefill: sglang dispatches chunks of 1024 tokens a rank through DeepEP low-latency")
    assert "Set prefill.chunked_prefill_size to at most 1024" in chunk
    for c in (c for c in checks if c.command.role == "decode"):
        (graphs,) = _dispatch_problems([c], "decode")
        assert graphs.startswith("decode: sglang captures decode CUDA graphs up to batch 256 a rank")


def test_the_budget_is_the_one_sglang_reads_from_the_commands_env(preset_dict) -> None:
    """The control: the same batches under a budget of 1024 tokens a rank are no problem."""
    checks = check_with_sglang(_overridden(preset_dict, budget="1024"))
    assert all(c.ok for c in checks) and _dispatch_problems(checks, "prefill") == []
    assert _dispatch_problems(checks, "decode") == []
