"""The type checker sees the package as the code imports it: every part, under its absolute name,
so that a name imported through `sglang_pd.…` that does not exist fails `make lint`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MYPY = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
PARTS = {"deploy": "sglang_pd.deploy", "kernels": "sglang_pd.kernels", "sglang_patches": "sglang_pd.sglang_patches"}


def _lint_copy(tmp: Path, probe: str) -> subprocess.CompletedProcess[str]:
    """`mypy` with the project's configuration on a copy of the checked parts, with `probe` added as
    a product module (`deploy/_probe.py`)."""
    ignore = shutil.ignore_patterns("__pycache__")
    for part in (*PARTS, MYPY["mypy_path"]):
        shutil.copytree(REPO / part, tmp / part, symlinks=True, ignore=ignore)
    # The project's own configuration, pointed at the probe (mypy follows its imports from there).
    config = (REPO / "pyproject.toml").read_text()
    packages = next(line for line in config.splitlines() if line.startswith('packages = ["sglang_pd.deploy"'))
    (tmp / "pyproject.toml").write_text(config.replace(packages, 'packages = ["sglang_pd.deploy._probe"]'))
    (tmp / "deploy" / "_probe.py").write_text(probe)
    # `make lint` runs first in `make test`: its cache of the third-party modules (whose paths are the
    # same here) spares most of the work; the copied modules are checked afresh.
    if (REPO / ".mypy_cache").is_dir():
        shutil.copytree(REPO / ".mypy_cache", tmp / ".mypy_cache")
    argv = [sys.executable, "-m", "mypy", "--cache-dir", str(tmp / ".mypy_cache")]
    return subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=600)


def test_every_part_is_checked_under_its_import_name() -> None:
    root = REPO / MYPY["mypy_path"]
    for folder, package in PARTS.items():
        link = root.joinpath(*package.split("."))
        assert link.is_symlink() and link.resolve() == REPO / folder, link
        assert package in MYPY["packages"]


@pytest.mark.slow
def test_a_missing_name_imported_by_its_absolute_path_fails_the_check(tmp_path: Path) -> None:
    probe = (
        '"""A product module importing one real and one missing name by the absolute path."""\n'
        "from sglang_pd.deploy.router.workers.capacity import CapacityGate, no_such_name\n\n"
        "reveal_type(CapacityGate.wait)\n"
    )
    run = _lint_copy(tmp_path, probe)
    assert run.returncode == 1, run.stdout + run.stderr
    assert 'Module "sglang_pd.deploy.router.workers.capacity" has no attribute "no_such_name"' in run.stdout, run.stdout
    # The real name has its real type (an import resolved to Any would reveal "Any").
    assert 'Revealed type is "def [T] (self: sglang_pd.deploy.router.workers.capacity.CapacityGate' in run.stdout
