"""The kv-probe `helm test` pod: it runs where decode pods run, with what they get, and registers GPU memory."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import one, preset_topology
from .test_chart import lws_pod_templates

# Where a cluster keeps its decode nodes: labels, a taint, an affinity term, and an RDMA device plugin.
PLACED = {
    "rdma": {"mode": "devicePlugin", "devicePlugin": {"resourceName": "rdma/hca_shared", "count": 2}},
    "decode": {
        "nodeSelector": {"pool": "h200-decode"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "fabric", "operator": "In", "values": ["ib-rail-1"]}]}
                    ]
                }
            }
        },
    },
    # The prefill pods live elsewhere: the probe must not follow them.
    "prefill": {"nodeSelector": {"pool": "h200-prefill"}},
}


def _decode_pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    templates = lws_pod_templates(one(docs, "LeaderWorkerSet", "-decode"))
    return dict(templates.get("leaderTemplate", templates["workerTemplate"])["spec"])


def _probe(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(one(docs, "Pod", "-test-kv-probe")["spec"])


def test_the_probe_pod_has_the_decode_pods_placement(render) -> None:
    docs = render(PLACED)
    probe, decode = _probe(docs), _decode_pod_spec(docs)
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert probe[key] == decode[key], key
    assert probe["nodeSelector"] == {"pool": "h200-decode"}


def test_the_probe_pod_requests_one_gpu_and_the_decode_pods_rdma_resources(render) -> None:
    docs = render(PLACED)
    probe = _probe(docs)["containers"][0]
    decode = _decode_pod_spec(docs)["containers"][0]
    for side in ("requests", "limits"):
        assert probe["resources"][side]["nvidia.com/gpu"] == 1, side
        assert probe["resources"][side]["rdma/hca_shared"] == decode["resources"][side]["rdma/hca_shared"] == 2
    # The GPU image (torch with CUDA, Mooncake's CUDA wheel), as the decode pods run.
    assert probe["image"] == decode["image"]


def test_the_probe_registers_gpu_memory_with_the_topologys_transfer(render) -> None:
    command = _probe(render())["containers"][0]["command"]
    assert command[:2] == ["sglang-pd", "kv-probe"]
    assert command[command.index("--memory") + 1] == "gpu"
    assert command[command.index("--protocol") + 1] == "rdma"


@pytest.mark.parametrize(("mode", "host_network"), [("hostNetwork", True), ("devicePlugin", False), ("none", False)])
def test_the_probe_pod_reaches_the_nics_as_decode_pods_do(render, mode, host_network) -> None:
    values: dict[str, Any] = {"rdma": {"mode": mode}}
    if mode == "none":
        values["topology"] = {"name": "tcp", **_tcp_topology()}
    docs = render(values)
    probe, decode = _probe(docs), _decode_pod_spec(docs)
    assert probe.get("hostNetwork", False) == decode.get("hostNetwork", False) == host_network
    assert probe["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def _tcp_topology() -> dict[str, Any]:
    t = preset_topology("deepseek-r1-h200-1p1d")
    t.pop("name")
    t["transfer"] = {"backend": "mooncake", "protocol": "tcp"}
    return t


def test_the_gpu_image_and_the_resource_name_follow_the_values(render) -> None:
    docs = render({"gpu": {"resourceName": "amd.com/gpu"}, "image": {"repository": "reg.example/me/pd", "tag": "t1"}})
    probe = _probe(docs)["containers"][0]
    assert probe["resources"]["requests"] == {"cpu": "2", "memory": "8Gi", "amd.com/gpu": 1}
    assert probe["image"] == "reg.example/me/pd:t1"


def test_the_probe_pod_gets_the_decode_pods_fabric_environment(render) -> None:
    values = {"fabric": {"preset": "roce", "gidIndex": 5}, "decode": {"env": {"MC_LOG_LEVEL": "INFO"}}}
    docs = render(values)
    probe = {e["name"]: e["value"] for e in _probe(docs)["containers"][0]["env"]}
    decode = {e["name"]: e.get("value") for e in _decode_pod_spec(docs)["containers"][0]["env"]}
    assert probe["MC_GID_INDEX"] == decode["MC_GID_INDEX"] == "5"
    assert probe["MC_LOG_LEVEL"] == decode["MC_LOG_LEVEL"] == "INFO"
    assert probe["NCCL_IB_HCA"] == decode["NCCL_IB_HCA"]
