"""What a new user meets first in the CLI: `--version`, `plan` given a folder, estimate options without
`--estimate`, and `plan local-cpu` saying what `up` runs. Each through a real `sglang-pd` process."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO
    )


def test_version() -> None:
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"sglang-pd {version('sglang-pd')}", (r.stdout, r.stderr)


def test_plan_of_a_folder_is_a_clear_error_naming_its_yaml_files() -> None:
    r = _cli("plan", "deploy/spec/presets")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(
        "error: deploy/spec/presets: is a folder, not a topology file; give a topology YAML file or a preset name"
    )
    assert "It holds deepseek-r1-h200-1p1d.yaml," in r.stderr
    r = _cli("plan", "docs")  # a folder without topology files: no list
    assert r.returncode == 1 and "It holds" not in r.stderr and "is a folder" in r.stderr


def test_estimate_options_without_estimate_are_refused() -> None:
    r = _cli("plan", "local-cpu", "--input-len", "100")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (
        "error: --input-len applies only to the performance estimate; add --estimate "
        "(sglang-pd plan local-cpu --estimate --input-len N).\n"
    )
    r = _cli("plan", "deepseek-r1-h200-1p1d", "--estimate", "--input-len", "100")  # the control
    assert r.returncode == 0 and "input 100, output 1536 tokens" in r.stdout, r.stderr
    r = _cli("plan", "deepseek-r1-h200-1p1d", "--estimate")  # the defaults still apply with --estimate
    assert r.returncode == 0 and "input 4096, output 1536 tokens" in r.stdout, r.stderr


def test_plan_of_a_cpu_topology_says_up_runs_the_reference_engine() -> None:
    r = _cli("plan", "local-cpu")
    assert r.returncode == 0, r.stderr
    assert "`sglang-pd up local-cpu` (and `make run`) runs these roles with the reference engine" in r.stdout
    r = _cli("plan", "single-h200")  # a GPU topology: sglang runs the commands shown
    assert r.returncode == 0 and "reference engine" not in r.stdout
