"""Packaging promises: every subpackage ships, the image has the package's dependencies, CI runs the README's tests."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from sglang_pd.deploy.common.contract import SGLANG_VERSION

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ROOTS = {"deploy": "sglang_pd.deploy", "kernels": "sglang_pd.kernels", "sglang_patches": "sglang_pd.sglang_patches"}


def _name(requirement: str) -> str:
    return re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0].lower()


def test_every_subpackage_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, package in ROOTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([package, *rel.parts]) if rel.parts else package)
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_image_installs_the_core_dependencies() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    installed = {_name(m) for m in re.findall(r'"([A-Za-z0-9_.\-\[\]]+[<>=][^"]*)"', dockerfile)}
    needed = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    # The image has CUDA: it takes Mooncake's CUDA wheel instead of the non-CUDA one (never both).
    needed = {"mooncake-transfer-engine" if n == "mooncake-transfer-engine-non-cuda" else n for n in needed}
    assert needed - installed == set()


def test_the_image_and_the_makefile_install_the_sglang_release_the_contract_names() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(SGLANG_VERSION)}$", dockerfile, re.M), (
        f"deploy/docker/Dockerfile: ARG SGLANG_VERSION must be {SGLANG_VERSION} (deploy/common/contract.py)"
    )
    make = subprocess.run(
        ["make", "-s", "-f", "Makefile", "--eval=print-sglang: ; @echo $(SGLANG_VERSION)", "print-sglang"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert make.stdout.strip() == SGLANG_VERSION


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]
    assert commands == ["make run", "make test"]
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci = [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]
