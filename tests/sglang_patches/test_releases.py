"""The plugin inside each sglang release it supports: 0.5.23 (deployed) and 0.5.17 (the GPU machine's, torch 2.11).

One child interpreter per release runs `release_cases.py`: sglang's real `initialize_moe_config` at
compute capability (9, 0), without and with the plugin's hooks, and the hooks' effect probes. 0.5.17
comes from its side install (the Makefile puts it in `.venv/sglang-<version>` with --no-deps);
0.5.17 reads SBO from `server_args`, 0.5.23 from the published config bags.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.common.contract import SGLANG_GPU_VERSION, SGLANG_VERSION
from sglang_pd.sglang_patches import status
from tests.support import deepep_revision

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,  # a fresh interpreter importing sglang per release
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]

CASES = Path(__file__).with_name("release_cases.py")
SIDE_INSTALL = Path(sys.prefix) / f"sglang-{SGLANG_GPU_VERSION}"
REFUSAL = "SBO (single batch overlap) is not supported on SM90 GPUs"


@pytest.fixture(scope="module", params=[SGLANG_VERSION, SGLANG_GPU_VERSION])
def release(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case's outcome inside one sglang release (one child interpreter)."""
    version: str = request.param
    env = {k: v for k, v in os.environ.items() if k not in (status.SBO_MODE_ENV, status.COMBINE_SEND_SMS_ENV)}
    if version != SGLANG_VERSION:
        if not (SIDE_INSTALL / "sglang").is_dir():
            pytest.skip(f"sglang {version} is not installed beside the venv ({SIDE_INSTALL}; `make` installs it)")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SIDE_INSTALL), env.get("PYTHONPATH", "")) if p)
    antgroup = tmp_path_factory.mktemp("antgroup-opt")
    deepep_revision.write_package(antgroup)
    proc = subprocess.run(
        [sys.executable, str(CASES), str(antgroup)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["sglang"] == version
    return doc


def test_the_release_reads_sbo_where_the_hook_expects(release: dict[str, Any]) -> None:
    assert release["takes_server_args"] is (release["sglang"] == SGLANG_GPU_VERSION)


def test_sglangs_plugin_loader_applies_the_full_modes_hooks(release: dict[str, Any]) -> None:
    assert release["patched_by_load_plugins"] == [
        "combine-call",
        "combine-signal",
        "down-gemm",
        "moe-config",
        "shared-stream",
    ]


def test_unhooked_sglang_refuses_sbo_on_sm90(release: dict[str, Any]) -> None:
    case = release["unhooked"]
    assert not case["accepted"] and case["error"].startswith(REFUSAL)


def test_every_hook_takes_effect(release: dict[str, Any]) -> None:
    assert release["probes"] == dict.fromkeys(
        ("moe-config", "down-gemm", "combine-signal", "combine-call", "shared-stream", "shared-only"), "ok"
    )


@pytest.mark.parametrize("case", ["full", "full-two-nodes"])
def test_full_sbo_is_accepted_with_antgroup_opt(release: dict[str, Any], case: str) -> None:
    got = release[case]
    assert got["accepted"] and got["sbo_enabled"] is True, got
    assert got["asked_still_recorded"]  # sglang saw SBO masked; the operator's arguments still say it was asked
    assert got["layout"] == "sglang" and got["effective"] == "full"
    assert got["log"] == [
        "sglang-pd: sglang runs SBO full on sm_90 (shared experts + down-GEMM/combine, sglang signals)"
    ]


def test_shared_only_is_accepted_with_sgl_deep_ep_across_nodes(release: dict[str, Any]) -> None:
    got = release["shared-only"]
    assert got["accepted"] and got["sbo_enabled"] is True and got["effective"] == "shared-only", got


def test_another_moe_runner_is_logged_as_shared_only(release: dict[str, Any]) -> None:
    got = release["full-triton-runner"]
    assert got["accepted"] and got["effective"] == "shared-only", got
    [line] = got["log"]
    assert "SBO full was asked for, but sglang runs SBO shared-only" in line
    assert "MoE runner triton (it needs --moe-runner-backend deep_gemm)" in line


def test_sgl_deep_ep_is_refused_across_nodes(release: dict[str, Any]) -> None:
    got = release["full-sgl-deep-ep-two-nodes"]
    assert not got["accepted"] and got["error"].startswith(REFUSAL)
    assert "traps on a peer across nodes, and decode EP here spans 2 nodes" in got["error"]
    assert "Fix: build DeepEP's antgroup-opt branch (DeepEP PR #483" in got["error"]


def test_sgl_deep_ep_is_refused_where_its_send_sms_do_not_match(release: dict[str, Any]) -> None:
    got = release["full-sgl-deep-ep-3-send-sms"]
    assert not got["accepted"]
    assert "it sends on 32 SMs while sglang leaves 3 to combine-send" in got["error"]
    assert "across nodes" not in got["error"]
    ok = release["full-sgl-deep-ep-32-send-sms"]  # one node, sglang giving the combine its 32 SMs
    assert ok["accepted"] and ok["layout"] == "deepep" and ok["effective"] == "full", ok
