"""Hook (a): `initialize_moe_config` lets SBO through on sm_90 when the asked-for half can run.

sglang refuses `--enable-single-batch-overlap` on every compute capability 9.x GPU
(`sglang/srt/layers/moe/utils.py`, `initialize_moe_config`), because its sm_90 down GEMM has no
signal arguments. With our kernel the combine half can run; the shared-expert half never needed
DeepGEMM. The hook runs sglang's own function with SBO masked in whatever it reads, then sets the
runtime flag that the refusal guarded. The two releases read it from different places:

* sglang 0.5.23: `initialize_moe_config()` reads the published config bag
  `get_exec().overlap.enable_single_batch_overlap`; it is masked by a scoped override, which sglang
  restores;
* sglang 0.5.17 (the last release pinned to torch 2.11): `initialize_moe_config(server_args)` reads
  `server_args.enable_single_batch_overlap` (`srt/layers/moe/utils.py:298-320`); sglang gets a shallow
  copy with it off, so the caller's arguments still say what the operator asked.

When the asked-for half cannot run, sglang's refusal stands and our message says what is missing.
Once the MoE flags are set, the log line says what sglang will actually run, from its own `SboFlags`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from sglang_pd.sglang_patches import status

__all__ = ["TARGET", "effective_sbo", "ep_nodes", "initialize_moe_config", "missing_targets", "why_not"]

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.moe.utils.initialize_moe_config"
REQUIRES = (
    "sglang.srt.runtime_context.get_exec",
    "sglang.srt.runtime_context.get_flags",
    "sglang.srt.runtime_context.get_server_args",
    "sglang.srt.layers.moe.utils.get_moe_runner_backend",
    "sglang.srt.batch_overlap.single_batch_overlap.SboFlags",
)

#: Messages of hooks whose targets were missing at registration; they make SBO unavailable.
missing_targets: list[str] = []


def why_not(mode: str, ep_nodes: int = 1) -> str | None:
    """None when SBO `mode` can run on this sm_90 machine, for a decode EP over `ep_nodes` nodes; else why not."""
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
    combine = status.combine_half(ep_nodes=ep_nodes)
    if combine.ok:
        return None
    reason = (
        combine.reason
        if "decode.sbo: shared-only" in combine.reason
        else f"{combine.reason}; or set decode.sbo: shared-only"
    )
    return f"SBO full needs our sm_90 signal down-GEMM and a DeepEP that takes its signals: {reason}"


def _server_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """sglang 0.5.17's `server_args` argument, or None where sglang reads the published bags (0.5.23)."""
    if args:
        return args[0]
    return kwargs.get("server_args")


def ep_nodes(server_args: Any) -> int:
    """The nodes one decode EP group spans: sglang's EP is the TP group, which spans `--nnodes`."""
    if server_args is None:
        from sglang.srt.runtime_context import get_server_args

        try:
            server_args = get_server_args()
        except Exception:  # nothing published (a bare test): one node
            return 1
    nnodes = int(getattr(server_args, "nnodes", 1) or 1)
    ep_size = int(getattr(server_args, "ep_size", 1) or 1)
    return nnodes if ep_size > 1 else 1


def effective_sbo() -> str:
    """What sglang's `SboFlags` will run: "full", "shared-only" or "off" (read once sglang has set its MoE flags)."""
    from sglang.srt.batch_overlap.single_batch_overlap import SboFlags

    if SboFlags.enable_combine_down_gemm_two_stream_overlap():
        return "full"
    if SboFlags.fuse_shared_experts_inside_sbo():
        return "shared-only"
    return "off"


def _log_effective(mode: str, cap: tuple[int, int]) -> None:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    runs = effective_sbo()
    runner = getattr(get_moe_runner_backend(), "value", get_moe_runner_backend())
    if runs == "full":
        layout = status.deepep_layout().layout
        logger.info("sglang-pd: sglang runs SBO full on sm_%d%d (shared experts + down-GEMM/combine, %s signals)",
                    cap[0], cap[1], layout)  # fmt: skip
    elif mode == "full":
        # SboFlags.enable_combine_down_gemm_two_stream_overlap needs --moe-runner-backend deep_gemm on sm_90.
        logger.warning(
            "sglang-pd: SBO full was asked for, but sglang runs SBO %s on sm_%d%d: the down-GEMM/combine half is "
            "off in sglang's SboFlags with MoE runner %s (it needs --moe-runner-backend deep_gemm)",
            runs, cap[0], cap[1], runner,
        )  # fmt: skip
    else:
        logger.info("sglang-pd: sglang runs SBO %s on sm_%d%d (dispatch-recv/shared-expert half only)", runs, *cap)


def initialize_moe_config(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.runtime_context import get_exec, get_flags

    server_args = _server_args(args, kwargs)
    if server_args is not None:
        asked = bool(server_args.enable_single_batch_overlap)
    else:
        asked = bool(get_exec().overlap.enable_single_batch_overlap)
    cap = status.device_capability()
    if not asked or cap is None or cap[0] != 9:
        return original(*args, **kwargs)

    mode = status.sbo_mode()
    problem = why_not(mode, ep_nodes=ep_nodes(server_args))
    if problem is not None:
        try:
            result = original(*args, **kwargs)
        except ValueError as exc:
            raise ValueError(f"{exc} [sglang-pd: {problem}.]") from exc
        logger.warning("sglang accepted SBO on sm_90 without this plugin; sglang-pd's hooks stay idle: %s", problem)
        return result

    if server_args is not None:
        # ServerArgs is read-only once resolved (its __setattr__ raises outside ServerArgs.override, which
        # would also record the change on the caller's object): the copy's field is set beneath the guard.
        masked = copy.copy(server_args)
        object.__setattr__(masked, "enable_single_batch_overlap", False)
        result = original(masked, *args[1:], **kwargs) if args else original(**{**kwargs, "server_args": masked})
    else:
        with get_exec().overlap.override(enable_single_batch_overlap=False):
            result = original(*args, **kwargs)
    get_flags().moe.sbo_enabled = True
    _log_effective(mode, cap)
    return result
