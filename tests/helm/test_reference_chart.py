"""A CPU topology in the chart: the reference engine's pods, their command from the topology, and what is refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .conftest import helm_python, one, preset_topology
from .test_chart import lws_pod_templates


def _engine(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    templates = lws_pod_templates(one(docs, "LeaderWorkerSet", f"-{role}"))
    return dict(templates["workerTemplate"]["spec"]["containers"][0])


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_engines_command_follows_the_topology(render) -> None:
    t = preset_topology("local-cpu")
    t["prefill"].update(port=31000, bootstrap_port=9100, max_running_requests=8)
    t["model"].update(served_name="tiny", path="tiny-deepseek-v3", page_size=32)
    t["model"].pop("context_length")
    docs = render({"topology": t})
    prefill, decode = _engine(docs, "prefill")["command"], _engine(docs, "decode")["command"]
    assert prefill[:4] == ["sglang-pd", "engine", "--role", "prefill"]
    assert (_flag(prefill, "--port"), _flag(prefill, "--bootstrap-port")) == ("31000", "9100")
    assert _flag(prefill, "--max-running-requests") == "8" and _flag(decode, "--max-running-requests") == "32"
    for argv in (prefill, decode):
        assert _flag(argv, "--model") == "tiny-deepseek-v3" and _flag(argv, "--served-model-name") == "tiny"
        assert _flag(argv, "--page-size") == "32" and "--context-length" not in argv
        assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--kv-protocol") == "tcp"
    assert "--bootstrap-port" not in decode
    # The router finds them as it finds sglang's pods.
    ann = lws_pod_templates(one(docs, "LeaderWorkerSet", "-prefill"))["workerTemplate"]["metadata"]["annotations"]
    assert (ann["sglang-pd/port"], ann["sglang-pd/bootstrap-port"]) == ("31000", "9100")


def test_the_engines_advertise_the_pod_address_for_kv_and_take_the_worker_key(render) -> None:
    env = {
        e["name"]: e
        for e in _engine(render({"preset": "local-cpu", "workerKeySecret": {"name": "wk"}}), "decode")["env"]
    }
    assert env["SGLANG_PD_KV_HOSTNAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["SGLANG_PD_WORKER_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wk", "key": "worker-key"}}


def test_the_image_and_resources_come_from_the_reference_values(render) -> None:
    values = {
        "preset": "local-cpu-mla",
        "cpuImage": {"repository": "reg.example/ml/sglang-pd-cpu"},
        "referenceEngine": {"resources": {"requests": {"cpu": "2", "memory": "3Gi"}}},
    }
    engine = _engine(render(values), "prefill")
    assert engine["image"] == "reg.example/ml/sglang-pd-cpu:0.1.0-reference"
    assert engine["resources"] == {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"memory": "4Gi"}}
    values["referenceEngine"]["image"] = {"repository": "reg.example/other/ref", "tag": "7"}
    assert _engine(render(values), "prefill")["image"] == "reg.example/other/ref:7"


def _refused(chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render(copy.deepcopy(values), name="demo", namespace="llm")
    return str(info.value)


def test_a_cpu_topology_the_reference_engine_cannot_run_is_refused_with_the_fix(chart) -> None:
    t = preset_topology("local-cpu")
    t["decode"].update(nodes=2, tp=2)
    t["hardware"]["gpus_per_node"] = 1
    said = _refused(chart, {"topology": t})
    assert "decode.nodes: a CPU topology (hardware.gpu cpu) runs the reference engine, one pod per group, but" in said
    assert "Set decode.nodes to 1 (more instances: prefill.instances, decode.groups)." in said
    t = preset_topology("local-cpu")
    t["model"]["path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    said = _refused(chart, {"topology": t})
    assert 'not "HuggingFaceTB/SmolLM2-135M-Instruct". Set topology.model.path to one of them' in said
    t = preset_topology("local-cpu")
    t["transfer"]["protocol"] = "rdma"
    said = _refused(chart, {"topology": t, "rdma": {"mode": "devicePlugin"}})
    assert "topology.transfer.protocol: the reference engine's pods carry no RDMA NIC" in said


def test_a_volume_holding_a_model_directory_serves_it(render) -> None:
    values = {"preset": "local-cpu", "model": {"source": "pvc", "pvc": {"claimName": "w"}, "path": "/models/smol"}}
    engine = _engine(render(values), "decode")
    assert _flag(engine["command"], "--model") == "/models/smol"
    assert engine["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True}]


def test_the_workers_network_policy_covers_the_reference_pods(render) -> None:
    # Their pods use pod networking whatever rdma.mode says, so the policy that fences their ports applies.
    docs = render({"preset": "local-cpu", "networkPolicy": {"enabled": True}})
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy")
    assert names == ["demo-sglang-pd-router", "demo-sglang-pd-workers"]
    assert not lws_pod_templates(one(docs, "LeaderWorkerSet", "-decode"))["workerTemplate"]["spec"].get("hostNetwork")
