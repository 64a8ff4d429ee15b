"""Hook (a): `initialize_moe_config` lets SBO through on sm_90 when the asked-for half can run.

sglang 0.5.23 refuses `--enable-single-batch-overlap` on every compute capability 9.x GPU
(`sglang/srt/layers/moe/utils.py`), because its sm_90 down GEMM has no signal arguments. With
our kernel the combine half can run; the shared-expert half never needed DeepGEMM. The hook
runs sglang's own function with the SBO leaf masked for the duration (a scoped override of the
published config, which sglang restores), then sets the runtime flag that the refusal guarded.
When the asked-for half cannot run, sglang's refusal stands and our message says what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_pd.sglang_patches import status

__all__ = ["TARGET", "initialize_moe_config", "missing_targets", "why_not"]

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.moe.utils.initialize_moe_config"
REQUIRES = ("sglang.srt.runtime_context.get_exec", "sglang.srt.runtime_context.get_flags")

#: Messages of hooks whose targets were missing at registration; they make SBO unavailable.
missing_targets: list[str] = []


def why_not(mode: str) -> str | None:
    """None when SBO `mode` can run on this sm_90 machine; otherwise what is missing."""
    if mode == "off":
        return (
            f"this plugin enables SBO on sm_90 only when {status.SBO_MODE_ENV} is full or shared-only "
            "(sglang-pd renders it from the topology's decode.sbo)"
        )
    if missing_targets:
        return " ".join(missing_targets)
    shared = status.shared_half()
    if not shared.ok:
        return f"SBO {mode} needs DeepEP's receive hook: {shared.reason}"
    if mode == "shared-only":
        return None
    combine = status.combine_half()
    if combine.ok:
        return None
    return f"SBO full needs our sm_90 signal down-GEMM: {combine.reason}; or set decode.sbo: shared-only"


def initialize_moe_config(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.runtime_context import get_exec, get_flags

    overlap = get_exec().overlap
    cap = status.device_capability()
    if not overlap.enable_single_batch_overlap or cap is None or cap[0] != 9:
        return original(*args, **kwargs)

    mode = status.sbo_mode()
    problem = why_not(mode)
    if problem is not None:
        try:
            result = original(*args, **kwargs)
        except ValueError as exc:
            raise ValueError(f"{exc} [sglang-pd: {problem}.]") from exc
        logger.warning("sglang accepted SBO on sm_90 without this plugin; sglang-pd's hooks stay idle: %s", problem)
        return result

    with overlap.override(enable_single_batch_overlap=False):
        result = original(*args, **kwargs)
    get_flags().moe.sbo_enabled = True
    detail = status.deepep_layout().layout if mode == "full" else "dispatch-recv half only"
    logger.info("sglang-pd: SBO %s enabled on sm_%d%d (%s)", mode, cap[0], cap[1], detail)
    return result
