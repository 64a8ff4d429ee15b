"""`decode.sbo_send_sms`: the default per GPU, the rule that refuses a count starving the send or the down GEMM
(each message names both sides' numbers and the fix), and what the renderer exports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sglang_pd.deploy.sglang.render import render_plan
from sglang_pd.deploy.spec.sbo_sms import (
    COMBINE_SEND_SMS_ENV,
    DEFAULT_SEND_SMS,
    DownGemmTiles,
    SendSMRange,
    send_sms_range,
)
from sglang_pd.deploy.spec.topology import PRESETS_DIR, RuleReport, TopologyError, check_rules, parse_topology

Preset = Callable[..., dict[str, Any]]
H200, H20 = "deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d"


def rules(d: dict[str, Any]) -> RuleReport:
    return check_rules(parse_topology(d, source_dir=PRESETS_DIR))


def with_send_sms(preset_dict: Preset, preset: str, sms: int | None) -> dict[str, Any]:
    d = preset_dict(preset)
    if sms is None:
        del d["decode"]["sbo_send_sms"]
    else:
        d["decode"]["sbo_send_sms"] = sms
    return d


@pytest.mark.parametrize(("preset", "fewest", "most"), [(H200, 5, 20), (H20, 5, 12)])
def test_each_default_lies_in_the_range_of_its_preset(preset_dict: Preset, preset: str, fewest: int, most: int) -> None:
    t = parse_topology(with_send_sms(preset_dict, preset, None), source_dir=PRESETS_DIR)
    judged = send_sms_range(t, t.load_model_config() or {})
    assert judged is not None
    assert (judged.fewest, judged.most) == (fewest, most)
    assert fewest <= DEFAULT_SEND_SMS[t.hardware.gpu] <= most
    # The shipped preset writes the default out.
    assert parse_topology(preset_dict(preset)).decode.sbo_send_sms == DEFAULT_SEND_SMS[t.hardware.gpu]
    assert rules(with_send_sms(preset_dict, preset, None)) == RuleReport(errors=[], warnings=[])


@pytest.mark.parametrize(
    ("preset", "sms", "gpu", "link"), [(H200, 3, "H200", 84), (H200, 4, "H200", 84), (H20, 4, "H20", 84)]
)
def test_a_send_slower_than_the_link_is_refused(
    preset_dict: Preset, preset: str, sms: int, gpu: str, link: int
) -> None:
    report = rules(with_send_sms(preset_dict, preset, sms))
    [msg] = report.errors
    assert msg.startswith(f"decode.sbo_send_sms: {sms} combine-send SMs (decode.sbo_send_sms) send {sms * 20} GB/s ")
    assert f"({sms} x 20 GB/s a SM), below the {link} GB/s at which DeepEP's low-latency combine leaves {gpu}" in msg
    assert "over the NIC (EP16 over 2 nodes)" in msg
    fix = "Set decode.sbo_send_sms between 5 and 20." if gpu == "H200" else "Set decode.sbo_send_sms between 5 and 12."
    assert msg.endswith(fix)
    # Control: the fewest that keep pace pass.
    assert rules(with_send_sms(preset_dict, preset, 5)).errors == []


@pytest.mark.parametrize(
    ("preset", "sms", "needle"),
    [
        (
            H200, 21,
            "leave the down GEMM 111 of the H200's 132 SMs, fewer than the 112 tiles per wave that keep it to 8 "
            "waves, one more than on the whole GPU (at 128 requests per rank: 16 experts x 2 row-blocks of 64 x 28 "
            "column blocks of 256 = 896 tiles, 7 waves on 132 SMs, 9 on 111). Set decode.sbo_send_sms between 5 and "
            "20.",
        ),
        (
            H20, 13,
            "leave the down GEMM 65 of the H20's 78 SMs, fewer than the 66 tiles per wave that keep it to 11 waves, "
            "one more than on the whole GPU (at 32 requests per rank: 16 experts x 1 row-block of 64 x 45 column "
            "blocks of 160 = 720 tiles, 10 waves on 78 SMs, 12 on 65). Set decode.sbo_send_sms between 5 and 12.",
        ),
    ],
)  # fmt: skip
def test_a_send_that_costs_the_gemm_two_waves_is_refused(
    preset_dict: Preset, preset: str, sms: int, needle: str
) -> None:
    [msg] = rules(with_send_sms(preset_dict, preset, sms)).errors
    assert msg == f"decode.sbo_send_sms: {sms} combine-send SMs (decode.sbo_send_sms) {needle}"
    # Control: one fewer keeps the GEMM within one wave of the whole GPU's.
    assert rules(with_send_sms(preset_dict, preset, sms - 1)).errors == []


def test_a_send_taking_every_sm_is_refused(preset_dict: Preset) -> None:
    [msg] = rules(with_send_sms(preset_dict, H200, 132)).errors
    assert msg == (
        "decode.sbo_send_sms: 132 combine-send SMs (decode.sbo_send_sms) would leave the down GEMM none of the "
        "H200's 132 SMs. Set decode.sbo_send_sms between 5 and 20."
    )


def test_the_default_is_refused_where_the_layout_needs_another(preset_dict: Preset) -> None:
    # One node, EP8: the combine leaves over NVLink at 396 GB/s, which 16 send SMs (320 GB/s) cannot keep up with.
    d = with_send_sms(preset_dict, H200, None)
    d["decode"].update(nodes=1, tp=8, attn_dp_size=8, ep=8, max_running_requests=1024)
    [msg] = rules(d).errors
    assert msg.startswith("decode.sbo_send_sms: 16 combine-send SMs (the default for H200) send 320 GB/s")
    assert "below the 396 GB/s at which DeepEP's low-latency combine leaves H200 over NVLink (EP8 in one node)" in msg
    assert msg.endswith("Set decode.sbo_send_sms: 20.")
    d["decode"]["sbo_send_sms"] = 20
    assert rules(d).errors == []


def test_other_rules_are_reported_first(preset_dict: Preset) -> None:
    # A layout the other rules refuse is not judged: its figures would assume it.
    d = with_send_sms(preset_dict, H200, 3)
    d["decode"]["ep"] = 8
    assert [e.split(":")[0] for e in rules(d).errors] == ["decode.ep"]


def test_a_count_without_full_sbo_is_a_warning(preset_dict: Preset) -> None:
    d = preset_dict(H200)
    d["decode"]["sbo"] = "shared-only"
    assert rules(d).warnings == [
        "decode.sbo_send_sms: 16 is read only with decode.sbo: full (sglang sends on its own SMs only while the down "
        "GEMM overlaps the combine), and decode.sbo is shared-only; remove it."
    ]
    del d["decode"]["sbo_send_sms"]
    assert rules(d) == RuleReport(errors=[], warnings=[])


def test_a_hopper_gpu_without_a_default_warns_of_sglangs_3(preset_dict: Preset) -> None:
    d = with_send_sms(preset_dict, H200, None)
    d["hardware"]["gpu"] = "H800"
    [warning] = rules(d).warnings
    assert warning.startswith("decode.sbo_send_sms: unset, and sglang-pd has no default for H800")
    assert "sglang sends the combine on its own 3 SMs" in warning and warning.endswith("set decode.sbo_send_sms.")
    d["decode"]["sbo_send_sms"] = 16
    assert rules(d).warnings == []


@pytest.mark.parametrize("value", [True, 0, 2.5, "many"])
def test_the_field_takes_a_whole_positive_number(preset_dict: Preset, value: object) -> None:
    d = preset_dict(H200)
    d["decode"]["sbo_send_sms"] = value
    with pytest.raises(TopologyError, match=r"decode\.sbo_send_sms: "):
        parse_topology(d)


def test_the_variable_is_set_through_the_field_not_env(preset_dict: Preset) -> None:
    d = preset_dict(H200)
    d["decode"]["env"] = {COMBINE_SEND_SMS_ENV: "32"}
    [msg] = rules(d).errors
    assert msg.startswith(f"decode.env.{COMBINE_SEND_SMS_ENV}: set decode.sbo_send_sms instead")


@pytest.mark.parametrize(("preset", "sms"), [(H200, None), (H200, 8), (H20, None)])
def test_the_renderer_exports_the_count_with_full_sbo(preset_dict: Preset, preset: str, sms: int | None) -> None:
    t = parse_topology(with_send_sms(preset_dict, preset, sms), source_dir=PRESETS_DIR)
    plan = render_plan(t)
    want = str(sms or DEFAULT_SEND_SMS[t.hardware.gpu])
    assert [c.env[COMBINE_SEND_SMS_ENV] for c in plan["decode"]] == [want] * t.decode.nodes
    assert all(COMBINE_SEND_SMS_ENV not in c.env for c in plan["prefill"])


@pytest.mark.parametrize("sbo", ["shared-only", "off"])
def test_without_the_gemm_overlap_nothing_is_exported(preset_dict: Preset, sbo: str) -> None:
    d = with_send_sms(preset_dict, H200, None)
    d["decode"]["sbo"] = sbo
    plan = render_plan(parse_topology(d, source_dir=PRESETS_DIR))
    assert all(COMBINE_SEND_SMS_ENV not in c.env for c in plan["decode"])


def test_a_link_no_count_can_keep_pace_with_beside_the_gemm_is_refused_whole() -> None:
    # 500 GB/s takes 25 send SMs; 896 tiles on 132 SMs (7 waves) may run 8 on no fewer than 112, leaving 20.
    tiles = DownGemmTiles(experts=16, rows=76, hidden=7168, block_n=256)
    judged = SendSMRange("H200", 132, 20.0, 500.0, "NVLink (EP8 in one node)", 128, tiles)
    assert (judged.fewest, judged.most) == (25, 20)
    [msg] = judged.problems(25, "decode.sbo_send_sms")
    assert msg.startswith("decode.sbo_send_sms: 25 combine-send SMs (decode.sbo_send_sms): no count serves this decode")
    assert "takes 25 send SMs at 20 GB/s each, and the down GEMM's 112 tiles per wave" in msg
    assert msg.endswith("leave at most 20. Set decode.sbo: shared-only, or lower the per-rank decode batch.")
    # Control: at 400 GB/s 20 send SMs keep pace and leave the GEMM its 112.
    assert SendSMRange("H200", 132, 20.0, 400.0, "NVLink", 128, tiles).problems(20, "x") == []
