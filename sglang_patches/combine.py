"""Hook (b), the combine side: sm_90 speaks the installed DeepEP's signal contract.

On sm_90 sglang 0.5.23 allocates row-block counters (`int32[E * ceil(T / 64)]`) and calls
`low_latency_combine(..., packed_recv_count, comp_signal, block_m, threshold, num_sms)`. The
shipped sgl-deep-ep 0.1.2.post1 takes only DeepEP's per-expert contract,
`low_latency_combine(..., overlap, src_signals, src_signal_expect_value)` (the one sglang uses on
Blackwell). When `status.deepep_layout()` says "deepep", two hooks bridge the gap:

* `compute_overlap_args` (after): the signal becomes one zeroed `uint32` counter per local
  expert, shared by the down GEMM and the combine, as on Blackwell;
* the low-latency dispatcher's `_get_buffer` (around): with full SBO routed, the buffer is wrapped so
  that signalled combines are counted (`engagement`) and, for this layout, re-spelled as DeepEP's:
  `comp_signal` -> `src_signals`, `threshold` (our kernel's `num_programs`) -> `src_signal_expect_value`;
  `packed_recv_count`, `block_m` and `num_sms` have no counterpart and are dropped.

With a DeepEP that takes sglang's keywords ("sglang" layout) both hooks pass everything through
(the buffer wrapper only counts);
DeepEP's `antgroup-opt` branch (DeepEP PR #483, the one `scripts/gpu/build_deepep.sh` and the image
build) is one. The "deepep" layout is served only where `status.layout_contract` allows it: one node,
and sglang giving the combine the 32 send SMs sgl-deep-ep launches; elsewhere SBO full is refused at
start (`moe_config.why_not`) rather than trapping or hanging in the first overlapped combine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_pd.sglang_patches import down_gemm, engagement

__all__ = [
    "BUFFER_TARGET",
    "OVERLAP_ARGS_PARAMS",
    "OVERLAP_ARGS_TARGET",
    "DeepEPCombineAdapter",
    "compute_overlap_args",
    "get_buffer",
    "to_deepep_combine_kwargs",
]

OVERLAP_ARGS_TARGET = "sglang.srt.batch_overlap.single_batch_overlap.compute_overlap_args"
OVERLAP_ARGS_PARAMS = ("dispatch_output", "alt_stream")
BUFFER_TARGET = "sglang.srt.layers.moe.token_dispatcher.deepep._DeepEPDispatcherImplLowLatency._get_buffer"

#: sglang's sm_90 combine keywords that DeepEP's per-expert contract has no use for.
_SM90_ONLY = ("packed_recv_count", "block_m", "num_sms")


def to_deepep_combine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """sglang's sm_90 `low_latency_combine` keywords re-spelled for DeepEP's per-expert contract."""
    if "comp_signal" not in kwargs:
        return kwargs
    out = {k: v for k, v in kwargs.items() if k not in _SM90_ONLY}
    out["src_signals"] = out.pop("comp_signal")
    out["src_signal_expect_value"] = int(out.pop("threshold"))
    return out


class DeepEPCombineAdapter:
    """A DeepEP buffer whose signalled combines are counted (`engagement`) and, for sgl-deep-ep, re-spelled."""

    def __init__(self, buffer: Any, *, respell: bool) -> None:
        self._buffer = buffer
        self._respell = respell

    def low_latency_combine(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("comp_signal") is not None or kwargs.get("src_signals") is not None:
            engagement.count_signal_combine()
        if self._respell:
            kwargs = to_deepep_combine_kwargs(kwargs)
        return self._buffer.low_latency_combine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buffer, name)


def get_buffer(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    buffer = original(*args, **kwargs)
    layout = down_gemm.route_layout()
    if layout is None or isinstance(buffer, DeepEPCombineAdapter):
        return buffer
    return DeepEPCombineAdapter(buffer, respell=layout == "deepep")


def compute_overlap_args(result: Any, dispatch_output: Any, alt_stream: Any = None) -> Any:
    combine_args, down_gemm_args, meta = result
    if down_gemm_args is None or down_gemm.route_layout() != "deepep":
        return None  # HookRegistry keeps the original result
    import torch

    num_local_experts = dispatch_output.hidden_states.shape[0]
    signal = torch.zeros(num_local_experts, dtype=torch.uint32, device=dispatch_output.hidden_states.device)
    down_gemm_args.signal = signal
    combine_args.signal = signal
    return combine_args, down_gemm_args, meta
