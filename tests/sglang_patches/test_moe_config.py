"""Hook (a): on sm_90 `initialize_moe_config` accepts SBO when the asked-for half can run, else refuses saying why.

The config is the one sglang 0.5.23 publishes from the decode command we render for the H200 preset
(`--enable-single-batch-overlap`, DeepEP low-latency, decode EP16 over 2 nodes); only the device
capability is patched. The DeepEP is the installed sgl-deep-ep, or antgroup-opt's sources where a
test asks for it. tests/sglang_patches/test_releases.py runs the same function of 0.5.17 too.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import pytest

from sglang_pd.sglang_patches import status

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

SGLANG_REFUSAL = "SBO (single batch overlap) is not supported on SM90 GPUs"


@pytest.fixture
def gate(load_plugin, published_decode, sm90):
    """`gate(mode)`: the plugin loaded for `mode`; returns sglang's (hooked) initialize_moe_config."""

    def load(mode: str):
        import sglang.srt.layers.moe.utils as moe_utils

        load_plugin(mode)
        return moe_utils.initialize_moe_config

    return load


def _sbo_flag() -> bool:
    from sglang.srt.runtime_context import get_flags

    return bool(get_flags().moe.sbo_enabled)


def test_unhooked_sglang_refuses_sbo_on_sm90(published_decode, sm90) -> None:
    from sglang.srt.layers.moe.utils import initialize_moe_config

    assert not hasattr(initialize_moe_config, "__wrapped__")
    with pytest.raises(ValueError, match=r"not supported on SM90"):
        initialize_moe_config()


def test_full_sbo_is_accepted_when_our_kernel_is_usable(
    gate, antgroup_deepep, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.runtime_context import get_exec

    initialize = gate("full")
    assert status.kernel_status().ok  # the real module imports here; only the capability is patched
    assert status.deepep_layout().layout == "sglang"
    with caplog.at_level(logging.INFO, logger="sglang_pd.sglang_patches"):
        initialize()
    assert _sbo_flag() is True
    # The scoped override is undone: the published config still says what the operator asked.
    assert get_exec().overlap.enable_single_batch_overlap is True
    # What sglang will run, from its own SboFlags.
    assert "sglang-pd: sglang runs SBO full on sm_90 (shared experts + down-GEMM/combine, sglang signals)" in (
        caplog.messages
    )


def test_another_moe_runner_is_logged_as_the_shared_half_only(
    gate, antgroup_deepep, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.runtime_context import get_exec

    initialize = gate("full")
    with get_exec().moe.override(moe_runner_backend="triton"), caplog.at_level(logging.INFO):
        initialize()
    assert _sbo_flag() is True
    [line] = [m for m in caplog.messages if m.startswith("sglang-pd: ")]
    assert line.startswith("sglang-pd: SBO full was asked for, but sglang runs SBO shared-only on sm_90")
    assert "with MoE runner triton (it needs --moe-runner-backend deep_gemm)" in line


@pytest.mark.skipif(status.distribution_version("sgl-deep-ep") is None, reason="sgl-deep-ep is not installed")
def test_full_sbo_with_sgl_deep_ep_across_nodes_is_refused_at_start(gate) -> None:
    """The preset's decode EP spans 2 nodes: sgl-deep-ep's overlapped combine would trap there, so start-up stops."""
    initialize = gate("full")
    assert status.deepep_layout().layout == "deepep"
    with pytest.raises(ValueError) as info:
        initialize()
    message = str(info.value)
    assert SGLANG_REFUSAL in message
    assert "traps on a peer across nodes, and decode EP here spans 2 nodes" in message
    assert "it sends on 32 SMs while sglang leaves 3 to combine-send" in message
    assert "Fix: build DeepEP's antgroup-opt branch (DeepEP PR #483" in message


@pytest.mark.parametrize(
    ("ep_nodes", "send_sms", "problems"),
    [
        (1, 32, ()),
        (1, 3, ("it sends on 32 SMs while sglang leaves 3",)),
        (2, 32, ("decode EP here spans 2 nodes",)),
        (2, 3, ("decode EP here spans 2 nodes", "it sends on 32 SMs while sglang leaves 3")),
    ],
)
def test_the_sgl_deep_ep_layout_contract(ep_nodes: int, send_sms: int, problems: tuple[str, ...]) -> None:
    verdict = status.layout_contract("deepep", ep_nodes=ep_nodes, send_sms=send_sms)
    assert verdict.ok is (not problems)
    for problem in problems:
        assert problem in verdict.reason
    assert status.layout_contract("sglang", ep_nodes=ep_nodes, send_sms=send_sms).ok


def test_sglangs_send_sms_come_from_its_environment_variable() -> None:
    assert status.sglang_combine_send_sms({}) == 3  # sglang's sm_90 default (compute_overlap_args)
    assert status.sglang_combine_send_sms({status.COMBINE_SEND_SMS_ENV: "32"}) == 32


def test_full_sbo_is_refused_with_our_message_when_the_kernel_does_not_import(
    gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    initialize = gate("full")
    monkeypatch.setitem(sys.modules, status.KERNEL_MODULE, None)  # `import` now raises ImportError
    with pytest.raises(ValueError) as info:
        initialize()
    message = str(info.value)
    assert SGLANG_REFUSAL in message  # sglang's refusal stands ...
    assert "our kernel sglang_pd.kernels.signal_gemm does not import" in message  # ... saying what is missing
    assert "or set decode.sbo: shared-only" in message


def test_full_sbo_is_refused_without_a_deepep_signal_contract(gate, monkeypatch: pytest.MonkeyPatch) -> None:
    initialize = gate("full")
    no_layout = status.LayoutDecision(None, "test", reason="DeepEP's low_latency_combine was not found (test)")
    monkeypatch.setattr(status, "deepep_layout", lambda: no_layout)
    with pytest.raises(ValueError, match=r"low_latency_combine was not found"):
        initialize()


def test_shared_only_needs_no_kernel(gate, monkeypatch: pytest.MonkeyPatch) -> None:
    initialize = gate("shared-only")
    monkeypatch.setitem(sys.modules, status.KERNEL_MODULE, None)
    initialize()
    assert _sbo_flag() is True


def test_shared_only_switches_the_combine_half_off(gate) -> None:
    from sglang.srt.batch_overlap.single_batch_overlap import SboFlags

    gate("shared-only")
    assert SboFlags.enable_combine_down_gemm_two_stream_overlap() is False


def test_mode_off_keeps_the_refusal_and_says_how_to_enable(gate) -> None:
    initialize = gate("off")
    with pytest.raises(ValueError, match=r"only when SGLANG_PD_SBO_MODE is full or shared-only"):
        initialize()


def test_other_gpus_are_left_to_sglang(gate, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    initialize = gate("full")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))
    monkeypatch.setattr(status, "device_capability", lambda: (10, 0))
    initialize()  # sglang itself allows SBO on Blackwell
    assert _sbo_flag() is True
