"""Hook (c): SBO's shared-expert half alone (`decode.sbo: shared-only`).

On sm_90 sglang's SBO is two independent overlaps: shared experts run while DeepEP's
dispatch-recv is in flight (only DeepEP's receive hook is needed), and the down GEMM signals
combine-send (needs a signalling GEMM). In shared-only mode the second one is switched off at
its single switch, `SboFlags.enable_combine_down_gemm_two_stream_overlap`, so sglang never
builds down-GEMM overlap arguments and no GEMM call carries a signal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_pd.sglang_patches import status

__all__ = ["TARGET", "enable_combine_down_gemm_two_stream_overlap"]

TARGET = "sglang.srt.batch_overlap.single_batch_overlap.SboFlags.enable_combine_down_gemm_two_stream_overlap"


def enable_combine_down_gemm_two_stream_overlap(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if status.sbo_mode() == "shared-only":
        return False
    return original(*args, **kwargs)
