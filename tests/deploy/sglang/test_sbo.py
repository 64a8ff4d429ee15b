"""`plan`'s SBO verdicts that depend on DeepEP say whose DeepEP they judged: the checking machine's."""

from __future__ import annotations

import importlib.util

import pytest

from sglang_pd.deploy.sglang import sbo
from sglang_pd.deploy.spec.topology import parse_topology
from sglang_pd.sglang_patches import status


def test_a_deepep_without_a_signal_layout_is_named_as_this_machines(preset_dict, monkeypatch) -> None:
    reason = "DeepEP 9.9's low_latency_combine takes neither comp_signal nor src_signals"
    monkeypatch.setattr(
        status, "deepep_layout", lambda: status.LayoutDecision(None, "deep_ep/buffer.py", reason=reason)
    )
    monkeypatch.setattr(status, "distribution_version", lambda name: "9.9" if name == "sgl-deep-ep" else "0.5.23")
    warnings = sbo.sbo_topology_warnings(parse_topology(preset_dict()))
    [warning] = [w for w in warnings if reason in w]
    assert warning.startswith(f"decode.sbo: full on H200: {reason}; set decode.sbo: shared-only (judged with the ")
    assert f"DeepEP installed where this check runs ({sbo.deepep_here()}), not the cluster image's" in warning


def test_deepep_here_names_the_module_without_importing_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")  # importing it would fail the test
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert sbo.deepep_here().endswith(f" at {package / '__init__.py'}")
    monkeypatch.setattr(sbo.importlib.util, "find_spec", lambda name: None)
    assert sbo.deepep_here() == "none"
    assert "(none), not the cluster image's" in sbo.deepep_caveat("none")
