"""sglang's own loader finds the plugin through its entry point and applies the hooks; missing targets fail loudly."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging

import pytest

from sglang_pd.sglang_patches import moe_config, plugin
from sglang_pd.sglang_patches.targets import SGLANG_TARGET_VERSION, HookSpec, HookTargetMissing, check_target

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


def test_entry_point_is_installed() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert eps.get("sglang_pd") == "sglang_pd.sglang_patches:register", (
        "the plugin's entry point is not installed: pip install -e . --no-deps"
    )


@pytest.mark.parametrize(
    ("mode", "hooks"),
    [
        ("full", ("moe-config", "down-gemm", "combine-signal", "combine-call", "shared-stream")),
        ("shared-only", ("moe-config", "shared-only")),
        ("off", ("moe-config",)),
    ],
)
def test_load_plugins_applies_our_hooks(load_plugin, mode: str, hooks: tuple[str, ...]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugin(mode)
    wanted = {plugin.HOOKS[name].target for name in hooks}
    assert wanted <= HookRegistry._patched
    others = {spec.target for spec in plugin.HOOKS.values()} - wanted
    assert not others & HookRegistry._patched
    assert moe_config.missing_targets == []


def test_hooks_wrap_the_names_sglang_calls(load_plugin) -> None:
    """The runner calls `deep_gemm_wrapper.<fn>` (the package re-export): that binding is patched too."""
    import sglang.srt.layers.deep_gemm_wrapper as package
    import sglang.srt.layers.deep_gemm_wrapper.entrypoint as entrypoint
    import sglang.srt.layers.moe.utils as moe_utils

    load_plugin("full")
    assert package.grouped_gemm_nt_f8f8bf16_masked is entrypoint.grouped_gemm_nt_f8f8bf16_masked
    assert hasattr(entrypoint.grouped_gemm_nt_f8f8bf16_masked, "__wrapped__")
    assert hasattr(moe_utils.initialize_moe_config, "__wrapped__")


def test_every_target_exists_in_the_installed_sglang() -> None:
    assert importlib.metadata.version("sglang") == SGLANG_TARGET_VERSION
    for spec in plugin.HOOKS.values():
        assert check_target(spec) is None, spec.name


def test_a_missing_target_names_the_hook_version_and_target() -> None:
    spec = HookSpec(
        name="down-gemm",
        target="sglang.srt.layers.deep_gemm_wrapper.entrypoint.grouped_gemm_nt_f8f8bf16_masked_v2",
        hook=lambda original, *a, **k: None,
        hook_type="around",
    )
    message = check_target(spec)
    assert message is not None
    assert "hook 'down-gemm' was written for sglang 0.5.23" in message
    assert f"in the installed sglang {importlib.metadata.version('sglang')}" in message
    assert "grouped_gemm_nt_f8f8bf16_masked_v2 is missing" in message
    assert "Install sglang==0.5.23" in message


def test_a_missing_parameter_is_a_missing_target() -> None:
    spec = HookSpec(
        name="down-gemm",
        target=plugin.HOOKS["down-gemm"].target,
        hook=lambda original, *a, **k: None,
        hook_type="around",
        params=("overlap_args", "signal_layout"),
    )
    message = check_target(spec)
    assert message is not None and "has no parameter(s) signal_layout" in message


def test_load_plugins_logs_the_missing_target_and_sbo_is_refused_naming_it(
    load_plugin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    bad = HookSpec(
        name="down-gemm",
        target="sglang.srt.layers.deep_gemm_wrapper.entrypoint.renamed_masked_gemm",
        hook=plugin.HOOKS["down-gemm"].hook,
        hook_type="around",
    )
    monkeypatch.setitem(plugin.HOOKS, "down-gemm", bad)
    with caplog.at_level(logging.ERROR, logger="sglang.srt.plugins"):
        load_plugin("full")
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "Failed to execute general plugin: sglang_pd" in logged
    assert "HookTargetMissing" in logged and "renamed_masked_gemm is missing" in logged
    # The hooks whose targets exist are still applied; the gate now refuses SBO naming the gap.
    assert plugin.HOOKS["moe-config"].target in HookRegistry._patched
    problem = moe_config.why_not("full")
    assert problem is not None and "renamed_masked_gemm is missing" in problem


def test_register_raises_for_a_missing_target(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    bad = HookSpec(name="shared-only", target="sglang.srt.no_such_module.f", hook=lambda o: o, hook_type="around")
    monkeypatch.setitem(plugin.HOOKS, "shared-only", bad)
    monkeypatch.setenv("SGLANG_PD_SBO_MODE", "shared-only")
    try:
        with pytest.raises(HookTargetMissing, match=r"sglang.srt.no_such_module.f is missing"):
            plugin.register()
    finally:
        HookRegistry.reset()
        moe_config.missing_targets.clear()


def test_a_bad_mode_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PD_SBO_MODE", "both")
    with pytest.raises(ValueError, match=r"SGLANG_PD_SBO_MODE has value 'both'. Not one of off, full, shared-only"):
        plugin.register()


def test_a_module_that_fails_to_import_is_not_reported_as_an_upgrade(tmp_path, monkeypatch) -> None:
    # As on the GPU machine without sglang's CUDA packages: the module is there, its import fails.
    pkg = tmp_path / "sglang_pd_broken_target"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'IPython'\", name='IPython')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = HookSpec(name="broken", target="sglang_pd_broken_target.fn", hook=lambda: None, hook_type="around")
    message = check_target(spec)
    assert message is not None
    assert (
        "sglang_pd_broken_target.fn cannot be checked: sglang module sglang_pd_broken_target does not import here: "
        "No module named 'IPython' (install sglang's runtime dependencies)"
    ) in message
