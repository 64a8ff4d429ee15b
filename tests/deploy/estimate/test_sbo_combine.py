"""SBO's down-GEMM/combine half in the estimate: row-blocks released in waves, a send capped by its SMs and the
link, a fixed cost; and what `plan --estimate` says of it."""

from __future__ import annotations

import json

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.estimate import estimate_topology
from sglang_pd.deploy.estimate.hardware import load_hardware
from sglang_pd.deploy.estimate.roofline import combine_link_gbps, sbo_combine
from sglang_pd.deploy.spec.sbo_sms import DEFAULT_SEND_SMS, DownGemmTiles
from sglang_pd.deploy.spec.topology import SBOMode, Topology, load_topology


def with_send_sms(t: Topology, sms: int | None) -> Topology:
    return t.model_copy(update={"decode": t.decode.model_copy(update={"sbo_send_sms": sms})})


def test_h200_preset_sbo_term_changes_sign_between_3_send_sms_and_the_default() -> None:
    t = load_topology("deepseek-r1-h200-1p1d")
    assert t.decode.sbo_send_sms == DEFAULT_SEND_SMS["H200"] == 16
    default = estimate_topology(with_send_sms(t, None))
    three = estimate_topology(with_send_sms(t, 3))  # sglang's own count on Hopper
    assert default.sbo is not None and three.sbo is not None
    assert (default.sbo.send_sms, default.sbo.send_sms_source) == (16, "the default for H200")
    assert three.sbo.send_sms == 3
    # 3 SMs send 60 GB/s against the 84 GB/s the combine leaves an H200 at: the send's tail outlasts the overlap.
    assert three.sbo.combine_us_per_layer < 0 < default.sbo.combine_us_per_layer
    assert three.sbo.us_per_layer < 0 < default.sbo.us_per_layer
    assert three.sbo_saving < 0 < default.sbo_saving
    assert three.decode.latency_ms > default.decode.latency_ms
    # The shared-expert half does not depend on the send.
    assert three.sbo.shared_us_per_layer == pytest.approx(default.sbo.shared_us_per_layer)
    assert estimate_topology(t).sbo_saving == pytest.approx(default.sbo_saving)


def test_sbo_per_step_is_per_layer_times_the_moe_layers() -> None:
    t = load_topology("deepseek-v3-h20-3p2d")
    e = estimate_topology(t)
    assert e.sbo is not None and e.sbo.moe_layers == 58
    assert e.sbo.ms_per_step == pytest.approx(e.sbo.us_per_layer * 58 / 1e3)
    off = estimate_topology(t.model_copy(update={"decode": t.decode.model_copy(update={"sbo": SBOMode.OFF})}))
    # The ITL the topology has, against the same topology without SBO: the per-step gain is their difference.
    assert off.decode.latency_ms - e.decode.latency_ms == pytest.approx(e.sbo.ms_per_step, rel=1e-6)


# H20-like: 720 tiles (16 experts x 1 row-block x 45 column blocks of 160) on 78 SMs.
H20_TILES = DownGemmTiles(experts=16, rows=17, hidden=7168, block_n=160)
# H200-like: 896 tiles (16 experts x 2 row-blocks x 28 column blocks of 256) on 132 SMs.
H200_TILES = DownGemmTiles(experts=16, rows=76, hidden=7168, block_n=256)


def test_a_long_gemm_hides_the_send_but_its_last_wave() -> None:
    # 6 send SMs leave 72 of 78: 10 waves, as on the whole GPU. 4.2 MB at min(6 x 20, 84) = 84 GB/s is 50 us;
    # each wave releases a tenth, so only the last tenth (5 us) follows the 200 us GEMM.
    m = sbo_combine(200.0, 4.2e6, 84.0, 6, 78, H20_TILES, per_sm_gbps=20.0, fixed_us=17.6)
    assert (m.waves, m.whole_gpu_waves, m.send_gbps) == (10, 10, 84.0)
    assert m.gemm_us == 200.0
    assert m.send_end_us == pytest.approx(205.0)
    assert m.serial_us == pytest.approx(250.0)
    assert m.gain_us == pytest.approx(250.0 - 205.0 - 17.6)


def test_a_slow_send_trails_the_gemm() -> None:
    # 3 send SMs move 60 GB/s, below an 80 GB/s link: 16 MB take 266.7 us from the first wave's release on.
    m = sbo_combine(64.0, 16e6, 80.0, 3, 132, H200_TILES, per_sm_gbps=20.0, fixed_us=17.6)
    assert (m.waves, m.whole_gpu_waves, m.send_gbps) == (7, 7, 60.0)
    assert m.send_end_us == pytest.approx(64.0 / 7 + 16e6 / 60e3)
    assert m.gain_us == pytest.approx(64.0 + 16e6 / 80e3 - m.send_end_us - 17.6)
    assert m.gain_us < 0
    fast = sbo_combine(64.0, 16e6, 80.0, 16, 132, H200_TILES, per_sm_gbps=20.0, fixed_us=17.6)
    assert fast.send_gbps == 80.0 and fast.gain_us > 0


def test_send_sms_that_cost_the_gemm_a_wave_stretch_it() -> None:
    # 24 send SMs leave 108 SMs: 896 tiles take 9 waves there against 7 on all 132.
    m = sbo_combine(64.0, 1e5, 80.0, 24, 132, H200_TILES, per_sm_gbps=20.0, fixed_us=0.0)
    assert (m.waves, m.whole_gpu_waves) == (9, 7)
    assert m.gemm_us == pytest.approx(64.0 * 9 / 7)
    control = sbo_combine(64.0, 1e5, 80.0, 20, 132, H200_TILES, per_sm_gbps=20.0, fixed_us=0.0)
    assert control.gemm_us == 64.0 * 8 / 7  # 112 SMs: 8 waves


@pytest.mark.parametrize("send_sms", [0, 132])
def test_the_model_refuses_a_send_that_leaves_either_side_nothing(send_sms: int) -> None:
    with pytest.raises(ValueError, match=rf"needs 1 to 131 SMs of 132, got {send_sms}"):
        sbo_combine(64.0, 1e6, 80.0, send_sms, 132, H200_TILES, per_sm_gbps=20.0, fixed_us=0.0)


def test_the_combine_link_rate_is_deepeps_table_on_this_link() -> None:
    hw = load_hardware()
    h200 = hw.gpu("H200")
    # DeepEP's EP16 combine: 128 tokens x 8 copies x 14336 B in 195 us, of which 20 us are fixed.
    assert combine_link_gbps(hw, h200, 16, 8) == pytest.approx(128 * 8 * 14336 / 175 / 1e3)
    # Within one node NVLink carries the 7 of 8 copies bound for the other GPUs, at 77 % of its 450 GB/s: DeepEP's
    # RDMA table scaled to NVLink's speed (1082 GB/s) would be faster than that.
    assert combine_link_gbps(hw, h200, 8, 8) == pytest.approx(450 * 0.77 * 8 / 7)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.mark.parametrize(("preset", "send_sms"), [("deepseek-r1-h200-1p1d", 16), ("deepseek-v3-h20-3p2d", 6)])
def test_plan_estimate_prints_the_sbo_term_and_its_send_sms(
    capsys: pytest.CaptureFixture[str], preset: str, send_sms: int
) -> None:
    code, out = run(capsys, "plan", preset, "--estimate")
    assert code == 0
    [line] = [x for x in out.splitlines() if x.startswith("SBO (full; ")]
    assert f"combine-send on {send_sms} SMs, decode.sbo_send_sms" in line
    assert "per MoE layer (" in line and "down GEMM against combine-send" in line
    assert "ms per step over 58 MoE layers: a gain" in line
    code, out = run(capsys, "plan", preset, "--estimate", "--format", "json")
    sbo = json.loads(out)["decode"]["sbo"]
    assert code == 0
    assert (sbo["send_sms"], sbo["send_sms_source"], sbo["moe_layers"]) == (send_sms, "decode.sbo_send_sms", 58)
    # Each figure is rounded to 0.1 us.
    assert sbo["gain_us_per_layer"] == pytest.approx(sbo["shared_us_per_layer"] + sbo["combine_us_per_layer"], abs=0.2)
    assert sbo["combine_us_per_layer"] > 0
