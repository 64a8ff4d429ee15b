"""Hook (d): in full SBO on sm_90, the shared expert runs on the alternate stream, as it does without SBO.

sglang has two places for the shared expert under SBO (`forward_deepep` in
`srt/models/deepseek_v2.py`): inside the dispatch-recv window, on the compute stream
(`SboFlags.enable_dispatch_shared_one_stream_overlap`, forced on for every GPU but Blackwell), or,
when `SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO` is set, on the alternate stream from
before the dispatch, while only the down GEMM overlaps the combine-send. On one H100 the first
place made full SBO's MoE layer slower than sglang's without SBO, and the second one did not
(`full@S` against `full_alt@S` in `benchmarks/bench_moe_layer.py`; the figures are in docs/sbo.md):
in the dispatch window the shared expert gives up the concurrency with the routed GEMMs that it has
without SBO. sglang reads the switch only where the first place is off, so on sm_90 it is ignored;
this hook turns the first place off whenever the switch is set, and the renderer sets the switch
with `decode.sbo: full` (deploy/sglang/render.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_pd.deploy.common.contract import ENV_SBO_SHARED_OUTSIDE
from sglang_pd.sglang_patches import status

__all__ = ["OUTSIDE_SBO_ENV", "TARGET", "enable_dispatch_shared_one_stream_overlap", "outside_sbo"]

TARGET = "sglang.srt.batch_overlap.single_batch_overlap.SboFlags.enable_dispatch_shared_one_stream_overlap"
#: sglang's switch (`srt/environ.py`, an `EnvBool`: "1", "true", "yes" or "y" set it).
OUTSIDE_SBO_ENV = ENV_SBO_SHARED_OUTSIDE


def outside_sbo() -> bool:
    """Whether sglang's switch is set in this process, read by sglang's own parser (`envs`)."""
    from sglang.srt.environ import envs

    return bool(getattr(envs, OUTSIDE_SBO_ENV).get())


def enable_dispatch_shared_one_stream_overlap(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if status.sbo_mode() == "full" and outside_sbo():
        return False
    return original(*args, **kwargs)
