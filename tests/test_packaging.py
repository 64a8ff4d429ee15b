"""Packaging promises: every subpackage ships, the image has the package's dependencies, CI runs the README's tests."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from sglang_pd.deploy.common.contract import DEEPEP_REVISION, SGLANG_GPU_VERSION, SGLANG_VERSION

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


def _make_variable(name: str) -> str:
    make = subprocess.run(
        ["make", "-s", "-f", "Makefile", f"--eval=print-var: ; @echo $({name})", "print-var"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return make.stdout.strip()


def test_the_image_and_the_makefile_install_the_sglang_release_the_contract_names() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(SGLANG_VERSION)}$", dockerfile, re.M), (
        f"deploy/docker/Dockerfile: ARG SGLANG_VERSION must be {SGLANG_VERSION} (deploy/common/contract.py)"
    )
    assert _make_variable("SGLANG_VERSION") == SGLANG_VERSION
    # The GPU machine's release, installed beside the venv for the plugin's tests.
    assert _make_variable("SGLANG_GPU_VERSION") == SGLANG_GPU_VERSION
    makefile = (REPO / "Makefile").read_text()
    assert "--target $(VENV)/sglang-$(SGLANG_GPU_VERSION) sglang==$(SGLANG_GPU_VERSION)" in makefile


def _run_steps(dockerfile: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def test_the_image_builds_the_pinned_deepep_that_takes_our_signals() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^ARG DEEPEP_REF={DEEPEP_REVISION}$", dockerfile, re.M), (
        f"deploy/docker/Dockerfile: ARG DEEPEP_REF must be {DEEPEP_REVISION} (deploy/common/contract.py)"
    )
    assert re.search(r"^ARG DEEPEP_REPO=https://github.com/deepseek-ai/DeepEP.git$", dockerfile, re.M)
    [build] = [step for step in _run_steps(dockerfile) if "DEEPEP_REF" in step]
    # The commit is checked, not trusted; sgl-deep-ep (same module name) goes before DeepEP is installed.
    assert 'test "$(git rev-parse HEAD)" = "${DEEPEP_REF}"' in build
    assert build.index("pip uninstall -y sgl-deep-ep") < build.index("pip install --no-cache-dir --no-build-isolation")
    assert "TORCH_CUDA_ARCH_LIST=9.0" in build


def test_the_image_build_fails_unless_full_sbo_would_engage() -> None:
    import argparse
    import shlex

    from sglang_pd.deploy.ops import doctor

    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    steps = _run_steps(dockerfile)
    [check] = [i for i, step in enumerate(steps) if "sglang-pd doctor" in step]
    installs = [i for i, step in enumerate(steps) if "pip install --no-cache-dir --no-deps ." in step]
    assert installs and max(installs) < check  # doctor judges the finished image
    words = shlex.split(steps[check].split("sglang-pd doctor", 1)[1].split("&&", 1)[0])
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    args = parser.parse_args(words)  # the flags the image passes are doctor's own
    assert args.expect == "full" and args.capability == (9, 0) and args.ep_nodes == 2
    assert not args.skip_targets  # hook targets and their effect are probed in the image's sglang


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]
    assert commands == ["make run", "make test"]
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci = [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]
