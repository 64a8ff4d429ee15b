"""`sglang-pd plan`: formats, exit codes, speed, and no sglang import on the plain path."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.sglang.check import sglang_available
from sglang_pd.deploy.spec.topology import PRESETS_DIR

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

R1 = str(PRESETS_DIR / "deepseek-r1-h200-1p1d.yaml")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table(capsys) -> None:
    code, out, _ = run(capsys, "plan", R1)
    assert code == 0
    assert out.startswith("topology deepseek-r1-h200-1p1d: deepseek-ai/DeepSeek-R1 served as 'deepseek-r1'")
    assert "3 nodes, 24 GPUs" in out
    assert "TP16 attn-DP16 EP16 deepep/low_latency SBO(full)" in out
    assert "decode group 0 node 1:" in out


def test_plan_json_lists_node_commands(capsys) -> None:
    code, out, _ = run(capsys, "plan", R1, "--format", "json")
    doc = json.loads(out)
    assert code == 0
    assert doc["nodes"] == {"prefill": 1, "decode": 2, "total": 3}
    assert doc["gpus"]["total"] == 24
    assert [n["node_rank"] for n in doc["roles"]["decode"]] == [0, 1]
    first = doc["roles"]["prefill"][0]
    assert first["argv"][:2] == ["-m", "sglang.launch_server"] and first["env"] == {}  # `launch`/`up` add Python
    assert doc["roles"]["decode"][0]["env"] == {
        "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "128",
        "SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS": "16",
        "SGLANG_PD_SBO_MODE": "full",
        "SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO": "1",
    }


def test_plan_counts_the_gpu_and_node_colocated_roles_share_once(capsys) -> None:
    # single-h200: prefill and decode share GPU 0 of one node.
    code, out, _ = run(capsys, "plan", "single-h200")
    assert code == 0
    assert out.splitlines()[0].endswith("; 1 node, 1 GPU, shared by prefill and decode")
    code, out, _ = run(capsys, "plan", "single-h200", "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["colocated"] is True
    assert doc["nodes"] == {"prefill": 1, "decode": 1, "total": 1}
    assert doc["gpus"] == {"prefill": 1, "decode": 1, "total": 1}
    # local-cpu: both reference engines on this host's CPUs.
    code, out, _ = run(capsys, "plan", "local-cpu")
    assert code == 0 and out.splitlines()[0].endswith("; 1 node, no GPU")


def test_plan_counts_the_nodes_of_separate_roles_each(capsys) -> None:
    # deepseek-r1-h200-1p1d: one prefill node of 8 GPUs, one decode group of 2 nodes of 8.
    _, out, _ = run(capsys, "plan", "deepseek-r1-h200-1p1d", "--format", "json")
    doc = json.loads(out)
    assert doc["colocated"] is False
    assert doc["nodes"] == {"prefill": 1, "decode": 2, "total": 3}
    assert doc["gpus"] == {"prefill": 8, "decode": 16, "total": 24}
    _, out, _ = run(capsys, "plan", "deepseek-r1-h200-1p1d")
    assert out.splitlines()[0].endswith("; 3 nodes, 24 GPUs")


def test_plan_yaml_and_shell(capsys) -> None:
    _, out, _ = run(capsys, "plan", "local-cpu", "--format", "yaml")
    assert yaml.safe_load(out)["name"] == "local-cpu"
    _, out, _ = run(capsys, "plan", "local-cpu", "--format", "shell")
    lines = [ln for ln in out.splitlines() if not ln.startswith("#")]
    assert len(lines) == 2 and all(ln.startswith("MC_FORCE_TCP=1 python3 -m sglang.launch_server") for ln in lines)


def test_invalid_topology_exits_1_with_the_rule(capsys, preset_dict, write_topology) -> None:
    d = preset_dict()
    d["decode"]["ep"] = 8
    code, out, err = run(capsys, "plan", str(write_topology(d)))
    assert code == 1 and out == ""
    assert "breaks 1 rule(s)" in err and "decode.ep: DeepEP is the all-to-all" in err


def test_unknown_key_exits_1(capsys, preset_dict, write_topology) -> None:
    d = preset_dict()
    d["router"]["polcy"] = "random"
    code, _, err = run(capsys, "plan", str(write_topology(d)))
    assert code == 1 and "router.polcy: unknown key" in err


def test_missing_file_names_presets(capsys) -> None:
    code, _, err = run(capsys, "plan", "no-such-preset")
    assert code == 1 and "presets: deepseek-r1-h200-1p1d, deepseek-v3-h20-3p2d, local-cpu" in err


def test_plan_is_fast_and_does_not_import_sglang() -> None:
    probe = (
        f"import sys; from sglang_pd.deploy.cli import main; rc = main(['plan', {R1!r}]); "
        "assert 'sglang' not in sys.modules and 'torch' not in sys.modules, 'plan imported sglang/torch'; "
        "sys.exit(rc)"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert "prefill instance 0 node 0:" in proc.stdout
    assert elapsed < 2.0, f"plan took {elapsed:.2f} s"


@pytest.mark.sglang
@pytest.mark.skipif(not sglang_available(), reason="sglang is not installed (the `validate` extra)")
def test_plan_check_runs_sglang(capsys, antgroup_deepep) -> None:
    code, out, _ = run(capsys, "plan", R1, "--check", "--format", "json")
    doc = json.loads(out)
    assert code == 0
    assert [c["ok"] for c in doc["sglang_check"]] == [True, True, True]


def test_plan_check_without_sglang_says_so(capsys, monkeypatch, antgroup_deepep) -> None:
    import sglang_pd.deploy.sglang.check as chk

    monkeypatch.setattr(chk, "sglang_available", lambda: False)
    code, out, err = run(capsys, "plan", R1, "--check")
    assert code == 3
    assert "sglang is not installed here" in err and "pip install --no-deps sglang==0.5.23" in err
    assert "prefill instance 0 node 0:" in out
