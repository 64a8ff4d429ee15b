"""Full SBO on sm_90 with sglang's outside-SBO switch: the shared expert runs on the alternate stream."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from sglang_pd.sglang_patches import probes, shared_stream

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


def _flags(mode_switch: str | None, monkeypatch: pytest.MonkeyPatch) -> tuple[bool, bool, bool]:
    """(shared inside SBO, its dispatch-window place, down GEMM overlapping combine) as forward_deepep reads them."""
    import sglang.srt.layers.moe.utils as moe_utils
    from sglang.srt.batch_overlap.single_batch_overlap import SboFlags
    from sglang.srt.runtime_context import get_flags

    if mode_switch is None:
        monkeypatch.delenv(shared_stream.OUTSIDE_SBO_ENV, raising=False)
    else:
        monkeypatch.setenv(shared_stream.OUTSIDE_SBO_ENV, mode_switch)
    moe = get_flags().moe
    monkeypatch.setattr(moe, "sbo_enabled", True)
    monkeypatch.setattr(moe, "runner_backend", moe_utils.MoeRunnerBackend.DEEP_GEMM)
    return (
        SboFlags.fuse_shared_experts_inside_sbo(),
        SboFlags.enable_dispatch_shared_one_stream_overlap(),
        SboFlags.enable_combine_down_gemm_two_stream_overlap(),
    )


def test_with_the_switch_full_sbo_runs_the_shared_expert_outside_and_keeps_the_down_gemm_overlap(
    load_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_plugin("full")
    assert _flags("1", monkeypatch) == (False, False, True)


@pytest.mark.parametrize("switch", [None, "0"])
def test_without_the_switch_sglang_keeps_its_dispatch_window_place(
    load_plugin, monkeypatch: pytest.MonkeyPatch, switch: str | None
) -> None:
    load_plugin("full")
    assert _flags(switch, monkeypatch) == (True, True, True)


def test_unhooked_sglang_ignores_the_switch_off_blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the hook exists: sglang alone keeps the shared expert in the dispatch window with the switch set."""
    assert _flags("1", monkeypatch)[:2] == (True, True)


def test_shared_only_mode_is_not_moved(load_plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    load_plugin("shared-only")
    assert _flags("1", monkeypatch) == (True, True, False)


PASSTHROUGH_HOOKS = """
from dataclasses import replace

from sglang_pd.sglang_patches.plugin import HOOKS as _REAL


def passthrough(original, *args, **kwargs):
    return original(*args, **kwargs)


HOOKS = {**_REAL, "shared-stream": replace(_REAL["shared-stream"], hook=passthrough)}
"""


def test_the_effect_probe_catches_a_shared_stream_hook_without_effect(tmp_path: Path) -> None:
    (tmp_path / "passthrough_hooks.py").write_text(PASSTHROUGH_HOOKS)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    effects = probes.hook_effects("passthrough_hooks:HOOKS", env=env)
    assert effects["shared-stream"].startswith("no effect: with the outside-SBO switch"), effects
    assert probes.hook_effects(env=env)["shared-stream"] == probes.OK
