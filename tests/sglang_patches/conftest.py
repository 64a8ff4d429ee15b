"""Fixtures for the plugin tests: sglang's real plugin loader, a published decode config, an sm_90 device.

These tests run sglang 0.5.23's own code (installed with --no-deps) on CPU. The device is the
one thing faked: the capability is patched to (9, 0) where a test says so.
"""

from __future__ import annotations

import os
import pkgutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.spec.topology import PRESETS_DIR
from sglang_pd.sglang_patches import down_gemm, moe_config, plugin, status
from tests.support import deepep_revision

PRESETS = PRESETS_DIR


def _split(target: str) -> tuple[Any, str]:
    parent, attr = target.rsplit(".", 1)
    return pkgutil.resolve_name(parent), attr


def _unpatch(saved: dict[str, tuple[Any, str, Any, Any]]) -> None:
    """Undo HookRegistry's patches: the target attribute and every `from X import Y` copy it rebound."""
    for obj, attr, raw, current in saved.values():
        now = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
        if now is raw:
            continue
        setattr(obj, attr, raw)
        wrapped = getattr(now, "__func__", now)
        for mod in list(sys.modules.values()):
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for name, value in list(d.items()):
                if value is wrapped:
                    setattr(mod, name, current)


@pytest.fixture
def load_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """`load(mode)`: sglang's `load_plugins()` with SGLANG_PD_SBO_MODE=mode, undone after the test."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    saved: dict[str, tuple[Any, str, Any, Any]] = {}
    for spec in plugin.HOOKS.values():
        try:
            obj, attr = _split(spec.target)
        except Exception:  # e.g. on a GPU machine without sgl_kernel: the plugin skips that hook too
            continue
        raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
        saved[spec.target] = (obj, attr, raw, getattr(obj, attr))

    def load(mode: str) -> None:
        monkeypatch.setenv(status.SBO_MODE_ENV, mode)
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
        HookRegistry.reset()
        monkeypatch.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()

    yield load
    _unpatch(saved)
    HookRegistry.reset()
    moe_config.missing_targets.clear()


@pytest.fixture(autouse=True)
def _fresh_decisions() -> Iterator[None]:
    down_gemm.route_layout.cache_clear()
    yield
    down_gemm.route_layout.cache_clear()


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compute capability 9.0 device, as both sglang and this plugin see it."""
    import sglang.srt.layers.moe.utils as moe_utils
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(moe_utils, "is_cuda", lambda: True)
    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))


@pytest.fixture
def deepep_32_send_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    """sglang gives the combine sgl-deep-ep's 32 send SMs: the one setting (on one node) where its layout is safe."""
    monkeypatch.setenv(status.COMBINE_SEND_SMS_ENV, str(status.DEEPEP_LAYOUT_SEND_SMS))


@pytest.fixture
def antgroup_deepep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """DeepEP antgroup-opt (the "sglang" signal layout) as the installed DeepEP, here and in child processes."""
    yield deepep_revision.install(tmp_path / "antgroup-opt", monkeypatch)
    status.deepep_layout.cache_clear()


@pytest.fixture(scope="session")
def published_decode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """sglang's config bags published from the decode command our renderer makes for the H200 preset."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import prepare_server_args

    from sglang_pd.deploy.sglang.check import _validation_copy, _write_model_dir
    from sglang_pd.deploy.sglang.render import render_plan
    from sglang_pd.deploy.spec.topology import load_topology

    t = load_topology(PRESETS / "deepseek-r1-h200-1p1d.yaml")
    cmd = render_plan(t)["decode"][0]
    model_dir = _write_model_dir(t.load_model_config() or {}, tmp_path_factory.mktemp("model"))
    argv, env = _validation_copy(cmd, model_dir)
    old = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k != status.SBO_MODE_ENV})
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
        runtime_context.publish(args, role="test")
    except ModuleNotFoundError as exc:
        # On a CUDA machine sglang's argument resolution imports its quantization modules, which
        # import sgl_kernel there (sglang-kernel: a 373 MB CUDA wheel, more than a device call can
        # carry). On CPU they take their non-CUDA branch, so this skip happens only on a GPU.
        pytest.skip(f"sglang's server-args resolution needs {exc.name}, which is not installed here")
    finally:
        os.environ.clear()
        os.environ.update(old)
    yield
    runtime_context.reset_context()
