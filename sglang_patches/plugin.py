"""The plugin function sglang calls (entry point `sglang_pd` in the group `sglang.srt.plugins`).

`register()` picks the hooks the SBO mode needs, checks that each target exists in the
installed sglang, and registers the present ones with sglang's `HookRegistry`;
`load_plugins()` then applies them. A missing target is recorded, so that the
`initialize_moe_config` hook refuses SBO naming it, and raised: sglang logs a plugin's exception
with its traceback and carries on, so the message is both in the log and in the refusal.
"""

from __future__ import annotations

import logging

from sglang_pd.sglang_patches import combine, down_gemm, moe_config, shared_only, shared_stream, status
from sglang_pd.sglang_patches.targets import (
    SGLANG_TARGET_VERSION,
    SUPPORTED_SGLANG_VERSIONS,
    HookSpec,
    HookTargetMissing,
    check_target,
)

__all__ = ["HOOKS", "hooks_for", "register"]

logger = logging.getLogger(__name__)

HOOKS: dict[str, HookSpec] = {
    spec.name: spec
    for spec in (
        HookSpec(
            name="moe-config",
            target=moe_config.TARGET,
            hook=moe_config.initialize_moe_config,
            hook_type="around",
            requires=moe_config.REQUIRES,
            why="let SBO through sglang's sm_90 refusal when the asked-for half can run",
        ),
        HookSpec(
            name="down-gemm",
            target=down_gemm.TARGET,
            hook=down_gemm.grouped_gemm_nt_f8f8bf16_masked,
            hook_type="around",
            params=down_gemm.PARAMS,
            why="route the sm_90 down GEMM with overlap arguments to our signal kernel",
        ),
        HookSpec(
            name="combine-signal",
            target=combine.OVERLAP_ARGS_TARGET,
            hook=combine.compute_overlap_args,
            hook_type="after",
            params=combine.OVERLAP_ARGS_PARAMS,
            why="per-expert uint32 signals when DeepEP takes src_signals",
        ),
        HookSpec(
            name="combine-call",
            target=combine.BUFFER_TARGET,
            hook=combine.get_buffer,
            hook_type="around",
            why="re-spell sm_90 combine keywords for a DeepEP that takes src_signals",
        ),
        HookSpec(
            name="shared-stream",
            target=shared_stream.TARGET,
            hook=shared_stream.enable_dispatch_shared_one_stream_overlap,
            hook_type="around",
            requires=(f"sglang.srt.environ.envs.{shared_stream.OUTSIDE_SBO_ENV}",),
            why="honour sglang's shared-experts-outside-SBO switch on sm_90: the shared expert on the alternate stream",
        ),
        HookSpec(
            name="shared-only",
            target=shared_only.TARGET,
            hook=shared_only.enable_combine_down_gemm_two_stream_overlap,
            hook_type="around",
            why="switch off the down-GEMM/combine half, keep the shared-expert half",
        ),
    )
}

_BY_MODE = {
    "off": ("moe-config",),
    "full": ("moe-config", "down-gemm", "combine-signal", "combine-call", "shared-stream"),
    "shared-only": ("moe-config", "shared-only"),
}


def hooks_for(mode: str) -> list[HookSpec]:
    return [HOOKS[name] for name in _BY_MODE[mode]]


def register() -> None:
    """Register the hooks for `SGLANG_PD_SBO_MODE`; raise HookTargetMissing after registering the rest."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    mode = status.sbo_mode()
    installed = status.distribution_version("sglang")
    if installed not in SUPPORTED_SGLANG_VERSIONS:
        logger.warning(
            "sglang-pd plugin: hooks were written for sglang %s (and tested in %s), this is sglang %s; "
            "their targets are checked (`sglang-pd doctor` also probes their effect).",
            SGLANG_TARGET_VERSION,
            ", ".join(SUPPORTED_SGLANG_VERSIONS),
            installed,
        )
    missing: list[str] = []
    for spec in hooks_for(mode):
        problem = check_target(spec)
        if problem is not None:
            missing.append(problem)
            continue
        HookRegistry.register(spec.target, spec.hook, HookType(spec.hook_type))
    moe_config.missing_targets[:] = missing
    if missing:
        raise HookTargetMissing("\n".join(missing))
    logger.info("sglang-pd plugin: SBO mode %s, hooks %s", mode, ", ".join(_BY_MODE[mode]))
