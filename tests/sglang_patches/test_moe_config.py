"""Hook (a): on sm_90 `initialize_moe_config` accepts SBO when the asked-for half can run, else refuses saying why.

The config is the one sglang publishes from the decode command we render for the H200 preset
(`--enable-single-batch-overlap`, DeepEP low-latency); only the device capability is patched.
"""

from __future__ import annotations

import importlib.util
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


def test_full_sbo_is_accepted_when_our_kernel_is_usable(gate) -> None:
    from sglang.srt.runtime_context import get_exec

    initialize = gate("full")
    assert status.kernel_status().ok  # the real module imports here; only the capability is patched
    initialize()
    assert _sbo_flag() is True
    # The scoped override is undone: the published config still says what the operator asked.
    assert get_exec().overlap.enable_single_batch_overlap is True


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
