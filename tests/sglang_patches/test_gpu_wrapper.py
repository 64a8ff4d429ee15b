"""On an sm_90 GPU: our kernel called through the path sglang uses, with sglang's plugin loader and the real device.

sglang's `compute_overlap_args` (plus our signal hook) allocates the signal on the device;
`deep_gemm_wrapper.grouped_gemm_nt_f8f8bf16_masked` (hooked) runs our kernel; the output is
checked against a float64 reference and the signals against their final values. Run on the
device machine: `pytest -m gpu tests/sglang_patches/test_gpu_wrapper.py -v`.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_pd.sglang_patches import combine, status

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
    ),
]

E, T, N, K = 8, 128, 7168, 2048  # local experts, tokens per expert (static), hidden, moe intermediate


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as exc:  # report which sglang module cannot import on this machine, and why
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")


@pytest.fixture
def sbo_flags() -> Any:
    """sglang's runtime MoE flags as a decode scheduler with SBO and the DeepGEMM runner has them."""
    rc = _import("sglang.srt.runtime_context")
    moe_utils = _import("sglang.srt.layers.moe.utils")
    moe = rc.get_flags().moe
    saved = (moe.sbo_enabled, moe.runner_backend)
    moe.sbo_enabled, moe.runner_backend = True, moe_utils.MoeRunnerBackend.DEEP_GEMM
    yield
    moe.sbo_enabled, moe.runner_backend = saved


def _operands(masked: list[int]) -> tuple[Any, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(E, T, K, device="cuda", generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    b = torch.randn(E, N, K, device="cuda", generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    a_scale = torch.rand(E, T, K // 128, device="cuda", generator=g) + 0.5
    b_scale = torch.rand(E, N // 128, K // 128, device="cuda", generator=g) * 0.01 + 0.005
    masked_m = torch.tensor(masked, dtype=torch.int32, device="cuda")
    return a, a_scale, b, b_scale, masked_m


@pytest.mark.parametrize("layout", ["deepep", "sglang"])
def test_down_gemm_through_sglangs_wrapper(
    load_plugin, sbo_flags, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    sbo = _import("sglang.srt.batch_overlap.single_batch_overlap")
    wrapper = _import("sglang.srt.layers.deep_gemm_wrapper")
    kernel = _import(status.KERNEL_MODULE)
    if layout == "sglang":  # as if DeepEP took comp_signal/block_m/threshold
        params = ("x", "comp_signal", "block_m", "threshold")
        monkeypatch.setattr(status, "deepep_layout", lambda: status.LayoutDecision("sglang", "test", params))
    load_plugin("full")

    hidden = torch.empty(E, T, N, dtype=torch.bfloat16, device="cuda")
    combine_args, down_args, meta = sbo.compute_overlap_args(SimpleNamespace(hidden_states=hidden), torch.cuda.Stream())
    assert down_args is not None and combine_args.signal is down_args.signal
    if layout == "deepep":
        assert down_args.signal.dtype == torch.uint32 and down_args.signal.shape == (E,)
    else:
        assert down_args.signal.dtype == torch.int32 and down_args.signal.numel() == E * (T // 64)

    a, a_scale, b, b_scale, masked_m = _operands([0, 1, 17, 64, 65, 100, 128, 3])
    out = torch.zeros(E, T, N, dtype=torch.bfloat16, device="cuda")
    block_m, threshold = wrapper.grouped_gemm_nt_f8f8bf16_masked(
        (a, a_scale), (b, b_scale), out, masked_m, 64,
        recipe_a=None, recipe_b=None, overlap_args=down_args, max_block_n=256,
    )  # fmt: skip
    torch.cuda.synchronize()

    ref = kernel.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale)
    rows = torch.arange(T, device="cuda")[None, :] < masked_m[:, None]
    got = torch.where(rows[:, :, None], out.double(), 0.0)
    assert ((got - ref).norm() / ref.norm()).item() < 4e-3
    signal = down_args.signal.view(torch.int32).cpu()
    if layout == "deepep":
        assert block_m == threshold == meta["compute_num_sms"] == down_args.num_sms
        assert torch.equal(signal, kernel.reference_deepep_signal(E, threshold))
        kwargs = combine.to_deepep_combine_kwargs(
            {"overlap": True, "packed_recv_count": None, "comp_signal": combine_args.signal,
             "block_m": block_m, "threshold": threshold, "num_sms": combine_args.num_sms}
        )  # fmt: skip
        assert kwargs["src_signals"] is down_args.signal and kwargs["src_signal_expect_value"] == threshold
    else:
        config = kernel.pick_config(64, 256)
        expected = kernel.reference_sglang_signal(masked_m, T, N, block_m, config.block_n)
        assert torch.equal(signal[: expected.numel()], expected) and threshold == -(-N // config.block_n)


def test_plugin_enables_sbo_on_this_gpu(load_plugin, published_decode) -> None:
    """The real device, no capability patch: sglang's refusal is lifted by the plugin."""
    moe_utils = _import("sglang.srt.layers.moe.utils")
    rc = _import("sglang.srt.runtime_context")
    load_plugin("full")
    moe_utils.initialize_moe_config()
    assert rc.get_flags().moe.sbo_enabled is True
