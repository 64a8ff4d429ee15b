"""Hook (b), the GEMM side: sglang's sm_90 down GEMM with overlap arguments goes to our kernel.

sglang's DeepGEMM MoE runner calls
`deep_gemm_wrapper.grouped_gemm_nt_f8f8bf16_masked(..., overlap_args=DownGemmOverlapArgs, max_block_n=...)`
for the down projection when SBO's combine half is on, and that wrapper calls
`deep_gemm.fp8_m_grouped_gemm_nt_masked(..., enable_overlap=True, max_block_n=..., signal=...)`,
which the shipped sgl-deep-gemm does not have on sm_90. The hook sends exactly those calls
(overlap arguments present, SBO full enabled by this plugin, an sm_90 device) to our
DeepGEMM-compatible entry point, in the signal layout the installed DeepEP consumes; every
other call goes to sglang's wrapper unchanged. The runner stores what we return as
`(block_m, threshold)` for the combine: `(block_m, ceil(N / block_n))` in sglang's layout,
`(num_programs, num_programs)` in DeepEP's.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from sglang_pd.sglang_patches import engagement, status

__all__ = ["PARAMS", "TARGET", "grouped_gemm_nt_f8f8bf16_masked", "route_layout"]

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.deep_gemm_wrapper.entrypoint.grouped_gemm_nt_f8f8bf16_masked"
_ENTRY = (status.KERNEL_MODULE, status.KERNEL_ENTRY)
PARAMS = ("lhs", "rhs", "out", "masked_m", "expected_m", "overlap_args", "max_block_n", "recipe_a", "recipe_b")


@functools.cache
def route_layout() -> status.SignalLayout | None:
    """The layout to route overlap calls in, or None to leave them to sglang (decided once)."""
    if status.sbo_mode() != "full":
        return None
    combine = status.combine_half()
    if not combine.ok:
        return None
    layout: status.SignalLayout = combine.detail["layout"]
    logger.info("sglang-pd: sm_90 down GEMM with overlap -> %s.%s, %s signals", *_ENTRY, layout)
    return layout


def _kernel_entry() -> Callable[..., Any]:
    # Looked up on every call (a dict lookup) so that the entry point can be swapped in tests.
    return getattr(importlib.import_module(_ENTRY[0]), _ENTRY[1])


def grouped_gemm_nt_f8f8bf16_masked(
    original: Callable[..., Any],
    lhs: Any,
    rhs: Any,
    out: Any,
    masked_m: Any,
    expected_m: int,
    overlap_args: Any = None,
    max_block_n: int = 256,
    recipe_a: tuple[int, int] | None = None,
    recipe_b: tuple[int, int] | None = None,
) -> Any:
    layout = route_layout() if overlap_args is not None else None
    if layout is None:
        return original(
            lhs, rhs, out, masked_m, expected_m, overlap_args=overlap_args, max_block_n=max_block_n,
            recipe_a=recipe_a, recipe_b=recipe_b,
        )  # fmt: skip
    if recipe_a is not None or recipe_b is not None:
        raise ValueError(
            f"sglang-pd's sm_90 signal down-GEMM takes DeepSeek FP8 scales (1x128 activations, 128x128 "
            f"weights) only, got recipe_a={recipe_a}, recipe_b={recipe_b}; set decode.sbo: shared-only."
        )
    engagement.count_signal_gemm()
    return _kernel_entry()(
        lhs,
        rhs,
        out,
        masked_m,
        expected_m,
        max_block_n=max_block_n,
        enable_overlap=True,
        signal=overlap_args.signal,
        signal_layout=layout,
        num_sms=overlap_args.num_sms,
    )
