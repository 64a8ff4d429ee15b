"""Host-network engine ports and Kubernetes' NodePort range: the GPU presets listen outside 30000-32767 and clear
of each other's and their neighbours' ports, and the chart refuses a port in the range unless told."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.kv.listeners import MOONCAKE_PORT_RANGE
from sglang_pd.deploy.sglang.render import DIST_INIT_PORT

from .conftest import helm_python, one, preset_topology

NODE_PORTS = range(30000, 32768)  # Kubernetes' default --service-node-port-range
GPU_PRESETS = ["deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d"]


def _sglang_source(module: str) -> str:
    """An installed sglang module's text, read without importing it (sglang pulls in torch)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (the `validate` extra)")
    return (Path(next(iter(spec.submodule_search_locations))) / module).read_text()


def _delta(name: str) -> int:
    found = re.search(rf"^{name} = (\d+)$", _sglang_source("srt/server_args.py"), re.M)
    assert found, f"{name} is gone from sglang's server_args.py: recheck the ports the chart derives"
    return int(found.group(1))


def listening_ports(role: str, spec: dict[str, Any]) -> dict[int, str]:
    """Every TCP port a role's leader listens on with sglang 0.5.23, by what it is."""
    port = int(spec["port"])
    out = {port: f"{role}.port"}
    if role == "prefill":
        out[int(spec["bootstrap_port"])] = "prefill.bootstrap_port"
    if spec.get("attn_dp_size", 1) > 1:
        zmq, handshake = _delta("ZMQ_TCP_PORT_DELTA"), _delta("DP_ATTENTION_HANDSHAKE_PORT_DELTA")
        # PortArgs.init_new: one node takes its dist-init port from the HTTP port, several nodes from
        # --dist-init-addr; six ZMQ ports follow it, and the worker-port handshake sits 13 above the HTTP port
        # (one node) or the dist-init port (several).
        base = port + zmq if spec["nodes"] == 1 else DIST_INIT_PORT
        out |= {p: f"{role} attention DP" for p in range(base, base + 7)}
        out[(port if spec["nodes"] == 1 else DIST_INIT_PORT) + handshake] = f"{role} DP handshake"
    return out


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_presets_listen_outside_the_node_port_range_and_clear_of_each_other(preset: str) -> None:
    t = preset_topology(preset)
    prefill, decode = listening_ports("prefill", t["prefill"]), listening_ports("decode", t["decode"])
    assert (t["prefill"]["port"], t["prefill"]["bootstrap_port"], t["decode"]["port"]) == (8100, 8998, 8200)
    assert not set(prefill) & set(decode)
    taken = set(prefill) | set(decode)
    assert not taken & set(NODE_PORTS), sorted(taken & set(NODE_PORTS))
    # Nor the router's port, Mooncake's RPC range, or where sglang draws its NCCL port (22000-29999, below the
    # ephemeral range: srt/utils/network.py get_free_port_below_ephemeral).
    assert t["router"]["port"] not in taken
    low, high = MOONCAKE_PORT_RANGE
    assert not taken & set(range(low, high + 1))
    assert "def get_free_port_below_ephemeral(low=22000, high=29999" in _sglang_source("srt/utils/network.py")
    assert not taken & set(range(22000, 30000))


def test_the_listening_ports_model_is_the_charts(chart) -> None:
    # Control for the model above: a one-node attention-DP prefill at 29800 derives ports 30033-30039, and the
    # chart's refusal names exactly those.
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["prefill"]["port"] = 29800
    derived = sorted(p for p in listening_ports("prefill", t["prefill"]) if p in NODE_PORTS)
    assert derived == list(range(30033, 30040))
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"topology": t}, name="demo", namespace="llm")
    assert f"{', '.join(map(str, derived))} lie in Kubernetes' NodePort range 30000-32767" in str(info.value)
    assert "prefill.port: 29800 makes sglang also listen on 29813 and 30033-30039" in str(info.value)


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_rendered_pods_use_the_presets_ports(render, preset: str) -> None:
    docs = render({"preset": preset})
    prefill = one(docs, "LeaderWorkerSet", "-prefill")["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert prefill["spec"]["hostNetwork"] is True
    ports = {p["name"]: p["containerPort"] for p in prefill["spec"]["containers"][0]["ports"]}
    assert ports == {"http": 8100, "bootstrap": 8998}
    decode = one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert decode["metadata"]["annotations"]["sglang-pd/port"] == "8200"


@pytest.mark.parametrize(
    ("change", "key", "port"),
    [
        (lambda t: t["prefill"].update(port=30000), "prefill.port", 30000),
        (lambda t: t["prefill"].update(bootstrap_port=32767), "prefill.bootstrap_port", 32767),
        (lambda t: t["decode"].update(port=31000), "decode.port", 31000),
        # A topology that leaves the port out gets the model's default, sglang's 30000/30001.
        (lambda t: t["decode"].pop("port"), "decode.port", 30001),
    ],
    ids=["prefill", "bootstrap", "decode", "decode-default"],
)
def test_a_host_network_port_in_the_node_port_range_is_refused_naming_the_value(chart, change, key, port) -> None:
    t = preset_topology("deepseek-r1-h200-1p1d")
    change(t)
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"topology": t}, name="demo", namespace="llm")
    message = str(info.value)
    assert f"{key}: {port} lies in Kubernetes' NodePort range 30000-32767" in message
    assert "or set allowNodePortRange=true" in message
    assert message.count("NodePort range") == 1  # only the port that is in it


def test_the_refusal_is_lifted_only_where_it_does_not_apply_or_when_asked(render) -> None:
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["prefill"]["port"], t["decode"]["port"] = 30000, 30001
    # Asked explicitly: the ports render as given.
    docs = render({"topology": t, "allowNodePortRange": True})
    decode = one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert decode["metadata"]["annotations"]["sglang-pd/port"] == "30001"
    # Pods on the pod network (a device plugin's RDMA) own their ports: a NodePort does not reach them.
    assert render({"topology": t, "rdma": {"mode": "devicePlugin"}})
    # The CPU presets' reference engines run on the pod network too, on sglang's default ports.
    assert preset_topology("local-cpu")["prefill"]["port"] == 30000
    assert render({"preset": "local-cpu", "rdma": {"mode": "none"}})
