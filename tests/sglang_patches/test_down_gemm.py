"""Hook (b), GEMM side: sglang's down-GEMM call with overlap arguments reaches our kernel entry, in the right layout.

The call is made exactly as sglang's DeepGEMM runner makes it (`deep_gemm_wrapper.<fn>` with a
real `DownGemmOverlapArgs`); our entry point is replaced by a recording double.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest
import torch

from sglang_pd.sglang_patches import down_gemm, status

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

E, M, N, K = 4, 128, 256, 512  # local experts, rows per expert, hidden (out), intermediate (in)


class RecordingEntry:
    """Stands in for `sglang_pd.kernels.signal_gemm.fp8_m_grouped_gemm_nt_masked`; records each call."""

    def __init__(self, returns: tuple[int, int]) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.returns = returns

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        self.calls.append((args, kwargs))
        return self.returns


@pytest.fixture
def entry(monkeypatch: pytest.MonkeyPatch) -> RecordingEntry:
    kernel = importlib.import_module(status.KERNEL_MODULE)
    rec = RecordingEntry(returns=(129, 129))
    monkeypatch.setattr(kernel, status.KERNEL_ENTRY, rec)
    return rec


def _runner_call(signal: torch.Tensor, num_sms: int = 129) -> tuple[Any, ...]:
    """The down-GEMM call of sglang's DeepGEMM runner (`_run_masked_fp8_gemm`), on CPU tensors."""
    from sglang.srt.batch_overlap.single_batch_overlap import DownGemmOverlapArgs
    from sglang.srt.layers import deep_gemm_wrapper

    a = torch.zeros(E, M, K).to(torch.float8_e4m3fn)
    a_scale = torch.ones(E, M, K // 128)
    b = torch.zeros(E, N, K).to(torch.float8_e4m3fn)
    b_scale = torch.ones(E, N // 128, K // 128)
    out = torch.empty(E, M, N, dtype=torch.bfloat16)
    masked_m = torch.tensor([3, 0, 64, 128], dtype=torch.int32)
    overlap = DownGemmOverlapArgs(num_sms=num_sms, signal=signal, start_event=None)  # type: ignore[arg-type]
    result = deep_gemm_wrapper.grouped_gemm_nt_f8f8bf16_masked(
        (a, a_scale),
        (b, b_scale),
        out,
        masked_m,
        64,
        recipe_a=None,
        recipe_b=None,
        overlap_args=overlap,
        max_block_n=256,
    )
    return result, (a, a_scale), (b, b_scale), out, masked_m


def test_deepep_layout_for_the_installed_deepep(load_plugin, sm90, deepep_32_send_sms, entry: RecordingEntry) -> None:
    load_plugin("full")
    assert status.deepep_layout().layout == "deepep", status.deepep_layout()
    signal = torch.zeros(E, dtype=torch.uint32)
    result, lhs, rhs, out, masked_m = _runner_call(signal)

    assert result == (129, 129)  # the runner stores these as meta_overlap_args block_m / threshold
    [(args, kwargs)] = entry.calls
    assert args[0] == lhs and args[1] == rhs
    assert args[2] is out and args[3] is masked_m and args[4] == 64
    assert kwargs == {
        "max_block_n": 256,
        "enable_overlap": True,
        "signal": signal,
        "signal_layout": "deepep",
        "num_sms": 129,
    }


def test_sglang_layout_when_deepep_takes_comp_signal(
    load_plugin, sm90, entry: RecordingEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = ("x", "topk_idx", "topk_weights", "handle", "packed_recv_count", "comp_signal", "block_m", "threshold")
    decision = status.LayoutDecision(status.layout_for_params(params), "test", params)
    monkeypatch.setattr(status, "deepep_layout", lambda: decision)
    load_plugin("full")
    signal = torch.zeros(E * (M // 64), dtype=torch.int32)
    _runner_call(signal, num_sms=120)
    [(_, kwargs)] = entry.calls
    assert kwargs["signal_layout"] == "sglang" and kwargs["signal"] is signal and kwargs["num_sms"] == 120


def test_calls_without_overlap_go_to_sglang() -> None:
    seen: list[tuple[Any, ...]] = []

    def original(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "deep_gemm"

    assert down_gemm.grouped_gemm_nt_f8f8bf16_masked(original, "lhs", "rhs", "out", "m", 8) == "deep_gemm"
    [(args, kwargs)] = seen
    assert args == ("lhs", "rhs", "out", "m", 8) and kwargs["overlap_args"] is None


def test_overlap_calls_stay_with_sglang_unless_full_sbo_was_enabled(
    monkeypatch: pytest.MonkeyPatch, sm90, entry: RecordingEntry
) -> None:
    monkeypatch.setenv(status.SBO_MODE_ENV, "shared-only")
    sentinel = object()
    got = down_gemm.grouped_gemm_nt_f8f8bf16_masked(
        lambda *a, **k: sentinel, "lhs", "rhs", "out", "m", 8, overlap_args=object()
    )
    assert got is sentinel and entry.calls == []


def test_other_scale_recipes_are_refused(
    monkeypatch: pytest.MonkeyPatch, sm90, deepep_32_send_sms, entry: RecordingEntry
) -> None:
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    with pytest.raises(ValueError, match=r"DeepSeek FP8 scales .* got recipe_a=\(1, 32\)"):
        down_gemm.grouped_gemm_nt_f8f8bf16_masked(
            lambda *a, **k: None, "lhs", "rhs", "out", "m", 8, overlap_args=object(), recipe_a=(1, 32)
        )
