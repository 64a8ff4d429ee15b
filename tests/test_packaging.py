"""Packaging promises: every subpackage and the gsm8k data ship, the images have the package's dependencies, CI runs
the README's tests."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from sglang_pd.deploy.common.contract import DEEPEP_REVISION, MOONCAKE_VERSION, SGLANG_GPU_VERSION, SGLANG_VERSION
from sglang_pd.deploy.evals.data import GSM8K_SHA256

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


CHECK_MOONCAKE = REPO / "deploy" / "docker" / "check_mooncake.py"


def test_the_image_pins_the_contracts_mooncake_and_checks_it_before_and_after() -> None:
    dockerfile = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^ARG MOONCAKE_VERSION={re.escape(MOONCAKE_VERSION)}$", dockerfile, re.M), (
        f"deploy/docker/Dockerfile: ARG MOONCAKE_VERSION must be {MOONCAKE_VERSION} (deploy/common/contract.py)"
    )
    assert _make_variable("MOONCAKE_VERSION") == MOONCAKE_VERSION
    # The extras pin the same release (pyproject.toml cannot read the contract).
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert extras["kv-cpu"] == [f"mooncake-transfer-engine-non-cuda=={MOONCAKE_VERSION}"]
    assert extras["kv-cuda"] == [f"mooncake-transfer-engine=={MOONCAKE_VERSION}"]
    pins = re.findall(r'"(mooncake[\w-]*[<>=!~][^"]*)"', dockerfile)
    assert pins == ["mooncake-transfer-engine==${MOONCAKE_VERSION}"], (
        f"the image must pin Mooncake from the ARG: {pins}"
    )
    steps = _run_steps(dockerfile)
    [install] = [i for i, step in enumerate(steps) if "mooncake-transfer-engine==" in step]
    # What the base image had is printed before the pin replaces it, in the same step.
    assert steps[install].index("check_mooncake.py base") < steps[install].index("mooncake-transfer-engine==")
    [check] = [i for i, step in enumerate(steps) if "check_mooncake.py pinned" in step]
    assert check > install and 'check_mooncake.py pinned "${MOONCAKE_VERSION}"' in steps[check]


def _check_mooncake(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK_MOONCAKE), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_mooncake_check_passes_on_a_working_engine_and_names_a_wrong_pin() -> None:
    # This machine has the non-CUDA wheel (the kv-cpu extra): the same module and engine as the CUDA one.
    base = _check_mooncake("base")
    assert base.returncode == 0
    assert f"mooncake-transfer-engine-non-cuda {MOONCAKE_VERSION}; the pin replaces it" in base.stdout
    ok = _check_mooncake("pinned", MOONCAKE_VERSION, "--distribution", "mooncake-transfer-engine-non-cuda")
    assert ok.returncode == 0, ok.stderr
    assert "transfer engine initializes over TCP" in ok.stdout
    wrong = _check_mooncake("pinned", "9.9.9", "--distribution", "mooncake-transfer-engine-non-cuda")
    assert wrong.returncode == 1
    assert (
        f"mooncake-transfer-engine-non-cuda==9.9.9 is pinned, but the installed Mooncake is "
        f"mooncake-transfer-engine-non-cuda {MOONCAKE_VERSION}; pip did not install the pin"
    ) in wrong.stderr


@pytest.mark.parametrize(
    ("engine_py", "said"),
    [
        (
            "raise ImportError('libcudart.so.13: cannot open shared object file')\n",
            "is installed but `from mooncake.engine import TransferEngine` fails: ImportError: libcudart.so.13",
        ),
        (
            "class TransferEngine:\n    def __init__(self):\n        raise RuntimeError('no CUDA driver')\n",
            "imports, but its transfer engine cannot be constructed: RuntimeError: no CUDA driver",
        ),
        (
            "class TransferEngine:\n    def initialize(self, *args):\n        return -1\n",
            "its transfer engine failed to initialize over TCP on 127.0.0.1 (status -1)",
        ),
    ],
)
def test_the_mooncake_check_fails_the_build_when_the_pinned_engine_does_not_work(
    tmp_path: Path, engine_py: str, said: str
) -> None:
    # A broken build of the module, found before the installed one (as a wheel with a wrong CUDA would load).
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    (tmp_path / "mooncake" / "engine.py").write_text(engine_py)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = _check_mooncake("pinned", MOONCAKE_VERSION, "--distribution", "mooncake-transfer-engine-non-cuda", env=env)
    assert result.returncode == 1
    assert f"error: mooncake: mooncake-transfer-engine-non-cuda {MOONCAKE_VERSION} " in result.stderr
    assert said in result.stderr


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert block is not None
    commands = [line.split("#")[0].strip() for line in block.group(1).strip().splitlines()]
    assert commands == ["make run", "make test"]
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    ci = [ln for ln in lines if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]


def test_the_wheel_ships_the_gsm8k_test_set_with_its_license(tmp_path: Path) -> None:
    """The gate reads its data from the installed package (no network): the built wheel must hold it whole."""
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*build, "."], cwd=REPO, check=True, capture_output=True)
    (wheel,) = tmp_path.glob("sglang_pd-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        body = zf.read("sglang_pd/deploy/evals/gsm8k_data/test.jsonl")
        notice = zf.read("sglang_pd/deploy/evals/gsm8k_data/LICENSE").decode()
    assert hashlib.sha256(body).hexdigest() == GSM8K_SHA256
    assert "MIT License" in notice and "Copyright (c) 2021 OpenAI" in notice


# The slim CPU image (router, gate, kv-probe): the package with the kv-cpu extra, never torch or sglang.
CPU_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.cpu"
# What only the GPU image may hold: CUDA builds and the engine.
GPU_ONLY = {"torch", "torchvision", "triton", "sglang", "mooncake-transfer-engine", "sgl-deep-ep", "sgl-kernel"}


def _pip_install_args(dockerfile: str) -> list[str]:
    code = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    code = code.replace("\\\n", " ")
    args: list[str] = []
    for command in re.findall(r"pip install ([^&\n]*)", code):
        args += [a.strip('"') for a in command.split() if not a.startswith("-")]
    return args


def test_the_cpu_image_installs_only_what_pyproject_pins() -> None:
    args = _pip_install_args(CPU_DOCKERFILE.read_text())
    extras: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
    pinned = set(PYPROJECT["project"]["dependencies"]) | {r for reqs in extras.values() for r in reqs}
    chosen: list[str] = []
    for arg in args:
        package = re.fullmatch(r"\.\[([a-z0-9,-]+)\]", arg)
        if package:
            chosen += package.group(1).split(",")
        else:
            assert arg in pinned, f"deploy/docker/Dockerfile.cpu installs {arg!r}: write it as pyproject.toml pins it"
    assert chosen == ["kv-cpu"], f"Dockerfile.cpu must install the package as '.[kv-cpu]', not with extras {chosen}"
    installed = {_name(r) for r in [*PYPROJECT["project"]["dependencies"], *extras["kv-cpu"], *args] if r[0] != "."}
    assert installed & GPU_ONLY == set(), "the CPU image would pull these GPU-only packages"
    mooncake = [r for r in extras["kv-cpu"] if _name(r).startswith("mooncake")]
    assert len(mooncake) == 1 and re.fullmatch(r"mooncake-transfer-engine-non-cuda==[\w.]+", mooncake[0]), (
        f"the kv-cpu extra must pin exactly the non-CUDA Mooncake wheel with ==, not {mooncake}"
    )


def test_the_cpu_image_base_is_a_slim_python_that_pyproject_allows() -> None:
    dockerfile = CPU_DOCKERFILE.read_text()
    version = re.search(r"^ARG PYTHON_VERSION=(\d+\.\d+(?:\.\d+)?)$", dockerfile, re.M)
    assert version, "deploy/docker/Dockerfile.cpu: ARG PYTHON_VERSION=X.Y must name the base image's Python"
    assert re.search(r"^FROM python:\$\{PYTHON_VERSION\}-slim-\w+(@sha256:[0-9a-f]{64})?$", dockerfile, re.M)
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert requires.contains(version.group(1)), f"Python {version.group(1)} is outside requires-python {requires}"
    # Mooncake's non-CUDA wheel links libibverbs even for TCP (the Makefile installs it on developer machines).
    assert re.search(r"apt-get install [^\n]*libibverbs1", dockerfile)


def _dry_run_make(target: str) -> subprocess.CompletedProcess[str]:
    """What `make TARGET` would run (`make -n`) for registry.example.com/ml at tag 1.2.3."""
    return subprocess.run(
        ["make", "-s", "-n", target, "REGISTRY=registry.example.com/ml", "TAG=1.2.3", "DOCKER=docker"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )


def test_make_image_builds_and_pushes_both_images_to_the_registry_given() -> None:
    make = _dry_run_make("image")
    gpu = f"registry.example.com/ml/sglang-pd:1.2.3-sglang{SGLANG_VERSION}"
    cpu = "registry.example.com/ml/sglang-pd-cpu:1.2.3"
    lines = make.stdout.splitlines()
    assert (
        f"docker build -f deploy/docker/Dockerfile --build-arg SGLANG_VERSION={SGLANG_VERSION} "
        f"--build-arg MOONCAKE_VERSION={MOONCAKE_VERSION} -t {gpu} ."
    ) in lines
    assert f"docker build -f deploy/docker/Dockerfile.cpu -t {cpu} ." in lines
    assert f"docker push {gpu}" in lines and f"docker push {cpu}" in lines


REFERENCE_DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile.reference"


def test_make_image_reference_builds_and_pushes_the_cpu_image_and_the_reference_engine_on_it() -> None:
    make = _dry_run_make("image-reference")
    cpu = "registry.example.com/ml/sglang-pd-cpu:1.2.3"
    lines = make.stdout.splitlines()
    assert lines[:4] == [
        f"docker build -f deploy/docker/Dockerfile.cpu -t {cpu} .",
        f"docker build -f deploy/docker/Dockerfile.reference --build-arg CPU_IMAGE={cpu} -t {cpu}-reference .",
        f"docker push {cpu}",
        f"docker push {cpu}-reference",
    ]
    # The chart's CPU presets pull that tag by default.
    values = yaml.safe_load((REPO / "helm" / "sglang-pd" / "values.yaml").read_text())
    assert values["referenceEngine"]["image"]["tag"] == f"{PYPROJECT['project']['version']}-reference"


def test_the_reference_image_installs_the_reference_extra_as_pinned() -> None:
    args = _pip_install_args(REFERENCE_DOCKERFILE.read_text())
    extras: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
    assert ".[kv-cpu,reference]" in args
    torch = next(a for a in args if a.startswith("torch=="))
    assert _torch_range("reference").contains(torch.removeprefix("torch==")), (
        f"Dockerfile.reference installs {torch}; the reference extra pins it otherwise"
    )
    assert not {_name(r) for r in extras["reference"]} & (GPU_ONLY - {"torch"}), "GPU-only packages in the extra"


def _torch_range(extra: str) -> SpecifierSet:
    requirement = next(r for r in PYPROJECT["project"]["optional-dependencies"][extra] if _name(r) == "torch")
    return SpecifierSet(requirement.removeprefix("torch"))


def test_make_run_installs_a_cpu_torch_the_reference_extra_admits_and_test_installs_the_rest() -> None:
    # `make run` takes the CPU build (no CUDA libraries); `make test` then installs the validate extra's
    # torch over it, which the reference extra must admit too, or one venv could not serve both.
    run_torch = _make_variable("RUN_TORCH")
    assert run_torch == "torch==2.13.0"
    assert _torch_range("reference").contains("2.13.0")
    validate_torch = next(r for r in PYPROJECT["project"]["optional-dependencies"]["validate"] if _name(r) == "torch")
    assert _torch_range("reference").contains(validate_torch.removeprefix("torch=="))
    # The run install is the subset: the dev and validate extras and sglang come only with the test install.
    make = _make_dry_run("install-run")
    assert "'.[reference,kv-cpu]'" in make and "torch==2.13.0" in make
    for test_only in ("dev,", "validate", "sglang=="):
        assert test_only not in make, f"make run's install would bring {test_only}"
    make = _make_dry_run("install-test")
    assert "'.[dev,validate,kv-cpu]'" in make and "sglang==" in make
    assert make.index("'.[reference,kv-cpu]'") < make.index("'.[dev,validate,kv-cpu]'")
    assert "--quiet" not in make, "an install that prints nothing for minutes looks hung"


def _make_dry_run(target: str) -> str:
    """What `make TARGET` would run in a venv that does not exist yet (a fresh machine)."""
    return subprocess.run(
        ["make", "-s", "-n", target, "VENV=/nonexistent/venv"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
