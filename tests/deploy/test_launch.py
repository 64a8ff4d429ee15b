"""`sglang-pd launch`: node rank and leader from LeaderWorkerSet's env, pod checks, dry run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.launch import LaunchError, pod_checks, resolve_command
from sglang_pd.deploy.sglang_args import render_node
from sglang_pd.deploy.topology import load_topology

PRESET_DIR = Path(__file__).resolve().parents[2] / "deploy" / "presets"
R1 = PRESET_DIR / "deepseek-r1-h200-1p1d.yaml"
LWS = {"LWS_LEADER_ADDRESS": "decode-0.decode.llm", "LWS_GROUP_SIZE": "2"}


@pytest.fixture(scope="module")
def r1():
    return load_topology(R1)


@pytest.mark.parametrize("rank", [0, 1])
def test_multi_node_rank_and_leader_from_lws(r1, rank) -> None:
    cmd = resolve_command(r1, "decode", {**LWS, "LWS_WORKER_INDEX": str(rank)})
    assert cmd.argv == render_node(r1, "decode", node_rank=rank, leader_host="decode-0.decode.llm").argv
    assert cmd.argv[cmd.argv.index("--dist-init-addr") + 1] == "decode-0.decode.llm:5000"


def test_single_node_role_needs_no_lws(r1) -> None:
    assert resolve_command(r1, "prefill", {}).argv == render_node(r1, "prefill").argv


def test_missing_lws_env_is_explained(r1) -> None:
    with pytest.raises(LaunchError, match=r"decode spans 2 nodes but LWS_LEADER_ADDRESS, LWS_WORKER_INDEX"):
        resolve_command(r1, "decode", {})


def test_group_size_must_match_topology(r1) -> None:
    with pytest.raises(LaunchError, match=r"LWS_GROUP_SIZE=4 but the topology's decode.nodes=2"):
        resolve_command(r1, "decode", {**LWS, "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "0"})


def test_worker_index_out_of_range(r1) -> None:
    with pytest.raises(LaunchError, match=r"LWS_WORKER_INDEX=2 is outside 0..1"):
        resolve_command(r1, "decode", {**LWS, "LWS_WORKER_INDEX": "2"})


def test_pod_checks_name_the_fix(r1, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    checks = {c.name: c for c in pod_checks(r1, "decode")}
    assert set(checks) == {"gpus", "shm", "memlock", "rdma"}
    assert not checks["gpus"].ok
    assert checks["gpus"].detail == (
        "2 GPU(s) visible, topology needs 8 per node; the pod must request 8 GPUs (hardware.gpus_per_node)"
    )
    # This machine has no InfiniBand: the RDMA check fails and says how to expose it.
    if not Path("/sys/class/infiniband").is_dir():
        assert not checks["rdma"].ok and "rdma.mode" in checks["rdma"].detail
    assert pod_checks(r1, "router") == []


def test_dry_run_prints_argv_env_and_checks(capsys, monkeypatch) -> None:
    for k, v in {**LWS, "LWS_WORKER_INDEX": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["launch", "--role", "decode", "--topology", str(R1), "--dry-run"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["node_rank"] == 1 and doc["env"] == {
        "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "128",
        "SGLANG_PD_SBO_MODE": "full",
    }
    assert doc["argv"][doc["argv"].index("--node-rank") + 1] == "1"
    assert {c["name"] for c in doc["checks"]} == {"gpus", "shm", "memlock", "rdma"}


def test_failed_checks_stop_the_launch(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert main(["launch", "--role", "prefill", "--topology", str(R1)]) == 1
    err = capsys.readouterr().err
    assert "pod check gpus: FAILED: 1 GPU(s) visible, topology needs 8 per node" in err
    assert "pod check(s) failed; fix them or pass --skip-checks" in err


def test_router_role_passes_its_flags(capsys) -> None:
    assert main(["launch", "--role", "router", "--topology", str(R1), "--dry-run", "--", "--kubernetes"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["argv"][1:] == ["-m", "sglang_pd.deploy.cli", "router", "--topology", str(R1), "--kubernetes"]
    assert doc["checks"] == []


def test_invalid_topology_is_refused(tmp_path, capsys) -> None:
    text = R1.read_text().replace("ep: 16", "ep: 8")
    (tmp_path / "t.yaml").write_text(text)
    assert main(["launch", "--role", "decode", "--topology", str(tmp_path / "t.yaml"), "--dry-run"]) == 1
    assert "decode.ep: DeepEP is the all-to-all" in capsys.readouterr().err
