"""The startup probe's budget from a volume: weights read at 1 GB/s unless told otherwise, the same figure in the
launcher's check, and NOTES.txt naming the rates it assumed with a command that measures the read rate."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.ops.launch import pod_settings_from_env
from sglang_pd.deploy.spec import topology
from sglang_pd.deploy.spec.topology import check_rules, load_topology, required_startup_s

from .conftest import CHART, PRESETS, one

NOTES = "sglang-pd/templates/NOTES.txt"
# The R1 preset's checkpoint as the chart knows it (files/model-sizes.yaml, generated from its config.json).
WEIGHTS = yaml.safe_load((CHART / "files" / "model-sizes.yaml").read_text())["deepseek-v3-config.json"]
VOLUMES: dict[str, dict[str, Any]] = {
    "pvc": {"model": {"source": "pvc", "pvc": {"claimName": "weights"}, "path": "/models/DeepSeek-R1"}},
    "hostPath": {"model": {"source": "hostPath", "hostPath": {"path": "/data/models"}, "path": "/models/DeepSeek-R1"}},
}


def _leader(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    templates = one(docs, "LeaderWorkerSet", f"-{role}")["spec"]["leaderWorkerTemplate"]
    return dict(templates.get("leaderTemplate", templates["workerTemplate"])["spec"]["containers"][0])


def _budget(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return int(probe["periodSeconds"]) * int(probe["failureThreshold"])


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_default_read_rate_is_1_gb_per_second_in_the_chart_and_the_launcher() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["startupBudget"]["loadBytesPerSecond"] == topology.DEFAULT_LOAD_BYTES_PER_S == 1_000_000_000


@pytest.mark.parametrize("source", sorted(VOLUMES))
def test_a_volume_budget_covers_the_weights_at_1_gb_per_second(render, source: str) -> None:
    assert WEIGHTS > 600e9  # DeepSeek-V3/R1: the budget below is worth checking only for a large checkpoint
    need = -(-WEIGHTS // 1_000_000_000) + 1200
    docs = render(VOLUMES[source])
    for role in ("prefill", "decode"):
        c = _leader(docs, role)
        assert need <= _budget(c) < need + 10, role  # rounded up to whole 10 s periods, no more
        assert _env(c)["SGLANG_PD_POD_LOAD_BYTES_PER_S"] == "1000000000"
        # The pod checks its budget with the chart's own figures, and they agree.
        pod = pod_settings_from_env(_env(c))
        assert pod is not None and pod.load_bytes_per_s == 1e9
        assert check_rules(load_topology(PRESETS / "deepseek-r1-h200-1p1d.yaml"), pod).ok


def test_the_budget_follows_a_measured_rate(render) -> None:
    slow = render({**VOLUMES["pvc"], "startupBudget": {"loadBytesPerSecond": 500_000_000}})
    fast = render({**VOLUMES["pvc"], "startupBudget": {"loadBytesPerSecond": 4_000_000_000}})
    assert _budget(_leader(slow, "decode")) >= required_startup_s(WEIGHTS, "pvc", load_bytes_per_s=5e8) > 2500
    assert _budget(_leader(fast, "decode")) < 1400


def test_a_budget_derived_at_2_gb_per_second_fails_a_pod_that_reads_at_1(render) -> None:
    # Control: the old 2 GB/s budget (1550 s) is what the launcher refuses for a pod that reads at 1 GB/s.
    c = _leader(render({**VOLUMES["pvc"], "startupBudget": {"loadBytesPerSecond": 2_000_000_000}}), "decode")
    assert _budget(c) == 1550
    env = {**_env(c), "SGLANG_PD_POD_LOAD_BYTES_PER_S": "1000000000"}
    pod = pod_settings_from_env(env, role="decode")
    assert pod is not None
    errors = check_rules(load_topology(PRESETS / "deepseek-r1-h200-1p1d.yaml"), pod).errors
    assert len(errors) == 1 and errors[0].startswith("decode.startupProbe: a startup budget of 1550s")


@pytest.mark.parametrize("source", ["hub", *sorted(VOLUMES)])
def test_notes_print_the_assumed_rates_and_how_to_measure_the_read_rate(chart, source: str) -> None:
    values = VOLUMES.get(source, {})
    notes = chart.render(values, name="demo", namespace="llm")[NOTES]
    assert f"weights    {WEIGHTS // 1_000_000_000} GB" in notes
    assert "read rate  1000 MB/s (startupBudget.loadBytesPerSecond)" in notes
    assert "warm-up    1200 s (startupBudget.warmupSeconds)" in notes
    assert ("download   500 MB/s (model.hub.downloadBytesPerSecond)" in notes) == (source == "hub")
    command = re.search(r"kubectl -n llm exec (\S+) -c sglang -- \\\n\s+sh -c '(.+)'", notes)
    assert command is not None, notes
    # The decode group 0's leader pod (LeaderWorkerSet names it <set>-<group>), reading a shard of the weights
    # where that pod mounts them, past the page cache.
    assert command.group(1) == "demo-sglang-pd-decode-0"
    where = "/cache/huggingface" if source == "hub" else "/models/DeepSeek-R1"
    assert f'find -L {where} -name "*.safetensors"' in command.group(2)
    assert "of=/dev/null" in command.group(2) and "iflag=direct" in command.group(2)
    # A rate the operator measured is the one printed.
    measured = {**values, "startupBudget": {"loadBytesPerSecond": 650_000_000}}
    assert "read rate  650 MB/s" in chart.render(measured, name="demo", namespace="llm")[NOTES]


def test_cpu_topologies_print_no_weight_budget(chart) -> None:
    notes = chart.render({"preset": "local-cpu", "rdma": {"mode": "none"}}, name="demo", namespace="llm")[NOTES]
    assert "read rate" not in notes and "dd if=" not in notes
