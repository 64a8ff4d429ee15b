"""Every rendered command passes sglang 0.5.23's own resolver and checks; its errors come back verbatim."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_pd.deploy.sglang_args import render_plan
from sglang_pd.deploy.sglang_check import SglangUnavailable, check_with_sglang, sglang_available
from sglang_pd.deploy.topology import load_topology, parse_topology

PRESET_DIR = Path(__file__).resolve().parents[2] / "deploy" / "presets"

needs_sglang = pytest.mark.skipif(
    not sglang_available(), reason="sglang is not installed (the `validate` extra + sglang --no-deps)"
)
pytestmark = [pytest.mark.sglang, needs_sglang]


@pytest.fixture(scope="module")
def r1_checks():
    return check_with_sglang(load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml"))


def test_r1_prefill_resolves(r1_checks) -> None:
    prefill = [c for c in r1_checks if c.command.role == "prefill"]
    assert len(prefill) == 1 and prefill[0].ok, prefill[0].error
    r = prefill[0].resolved
    assert r["disaggregation_mode"] == "prefill"
    assert r["disaggregation_bootstrap_port"] == 8998
    assert (r["tp_size"], r["ep_size"], r["attn_dp_size"]) == (8, 8, 1)
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
        assert r["cuda_graph_max_bs_decode"] == 64
        assert r["enable_single_batch_overlap"] is True
        assert r["enable_two_batch_overlap"] is False
        assert (r["moe_a2a_backend"], r["deepep_mode"]) == ("deepep", "low_latency")
        assert (r["nnodes"], r["node_rank"]) == (2, c.command.node_rank)


@pytest.mark.parametrize("name", ["deepseek-v3-h20-3p2d", "local-cpu"])
def test_other_presets_resolve(name: str) -> None:
    t = load_topology(PRESET_DIR / f"{name}.yaml")
    checks = check_with_sglang(t)
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
