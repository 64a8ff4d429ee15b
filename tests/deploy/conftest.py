"""Factories for topology tests: a valid preset as a dict, to mutate one field at a time; the image's DeepEP."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.spec.topology import PRESETS_DIR
from sglang_pd.sglang_patches import status
from tests.support import deepep_revision

PRESETS = PRESETS_DIR


@pytest.fixture
def preset_dict() -> Callable[[str], dict[str, Any]]:
    def load(name: str = "deepseek-r1-h200-1p1d") -> dict[str, Any]:
        return copy.deepcopy(yaml.safe_load((PRESETS / f"{name}.yaml").read_text()))

    return load


@pytest.fixture
def write_topology(tmp_path: Path) -> Callable[[Any], Path]:
    """Write a dict (as YAML) or raw text to a topology file beside a copy of the config.json."""

    def write(data: Any, name: str = "topology.yaml") -> Path:
        (tmp_path / "deepseek-v3-config.json").write_text((PRESETS / "deepseek-v3-config.json").read_text())
        path = tmp_path / name
        path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
        return path

    return write


@pytest.fixture
def antgroup_deepep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """DeepEP antgroup-opt (the image's) as the installed DeepEP, here and in child processes: with this
    machine's sgl-deep-ep, `plan --check` refuses full SBO on a multi-node decode (test_doctor.py shows it)."""
    yield deepep_revision.install(tmp_path / "antgroup-opt", monkeypatch)
    status.deepep_layout.cache_clear()
