"""The DeepEP the image builds, so that `plan --check` judges SBO with it on any machine.

The image builds DeepEP at deploy/common/contract.py's DEEPEP_REVISION (DeepEP's antgroup-opt branch,
DeepEP PR #483). The sglang-pd plugin decides the SBO halves from the `deep_ep.Buffer` it finds
(`sglang_patches.status`: `deepep_layout`, `shared_half`), which on a laptop or CI machine is another
DeepEP, or none. `judged_as_image()` makes those two answer for the image's Buffer instead, from its
parameters quoted below and the plugin's own decision code, until the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sglang_pd.deploy.common.contract import DEEPEP_REVISION
from sglang_pd.sglang_patches import status

__all__ = ["COMBINE_PARAMS", "DISPATCH_PARAMS", "IMAGE_DEEPEP", "judged_as_image"]

# deep_ep/buffer.py at DEEPEP_REVISION: Buffer.low_latency_combine (line 629) and
# Buffer.low_latency_dispatch (line 560), their parameters after `self`, in order.
# tests/deploy/sglang/test_image_deepep.py holds them equal to tests/support/deepep_revision.py's quote.
COMBINE_PARAMS = (
    "x", "topk_idx", "topk_weights", "handle", "overlap", "packed_recv_count", "comp_signal", "block_m",
    "threshold", "num_sms", "use_logfmt", "zero_copy", "async_finish", "return_recv_hook", "out",
    "combine_wait_recv_cost_stats",
)  # fmt: skip
DISPATCH_PARAMS = (
    "x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts", "cumulative_local_expert_recv_stats",
    "dispatch_wait_recv_cost_stats", "use_fp8", "round_scale", "use_ue8m0", "async_finish", "return_recv_hook",
)  # fmt: skip

#: How `plan --check` names the DeepEP it judged.
IMAGE_DEEPEP = f"the image's DeepEP (antgroup-opt at {DEEPEP_REVISION}, deploy/common/contract.py DEEPEP_REVISION)"
_SOURCE = f"deep_ep/buffer.py at {DEEPEP_REVISION} (deploy/sglang/image_deepep.py)"


def _layout() -> status.LayoutDecision:
    layout = status.layout_for_params(COMBINE_PARAMS)
    reason = "" if layout else f"the image's low_latency_combine takes no signal layout the plugin knows ({_SOURCE})"
    return status.LayoutDecision(layout, _SOURCE, COMBINE_PARAMS, reason)


def _shared_half() -> status.Availability:
    if "return_recv_hook" not in DISPATCH_PARAMS:
        return status.Availability(False, "the image's DeepEP low_latency_dispatch has no return_recv_hook")
    return status.Availability(True, detail={"source": _SOURCE})


@contextlib.contextmanager
def judged_as_image() -> Iterator[None]:
    """Inside the block, the plugin's DeepEP questions are answered for the image's DeepEP."""
    saved = status.deepep_layout, status.shared_half
    status.deepep_layout = _layout  # type: ignore[assignment]
    status.shared_half = _shared_half
    try:
        yield
    finally:
        status.deepep_layout, status.shared_half = saved
