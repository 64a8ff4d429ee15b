"""Kubernetes discovery, driven by recorded watch events: the JSON lines a kube-apiserver streams
for `GET /api/v1/namespaces/NS/pods?watch=true&labelSelector=...`, decoded by the kubernetes
client's own `Watch` (so the event dicts are exactly what the router sees in a cluster)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kubernetes import watch

from sglang_pd.deploy.router.config import KubernetesDiscoveryConfig
from sglang_pd.deploy.router.discovery import KubernetesDiscovery, pod_endpoint
from sglang_pd.deploy.router.workers import WorkerRegistry

CONFIG = KubernetesDiscoveryConfig(
    namespace="llm", prefill_selector="sglang-pd/role=prefill", decode_selector="sglang-pd/role=decode", port=30000
)


def _pod(
    name: str,
    role: str,
    ip: str | None,
    *,
    ready: bool,
    phase: str = "Running",
    rv: str = "1",
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "llm",
        "uid": f"uid-{name}",
        "resourceVersion": rv,
        "labels": {"sglang-pd/role": role, "sglang-pd/topology": "dsv3"},
        "annotations": annotations or {},
        "creationTimestamp": "2026-11-30T10:00:00Z",
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T10:05:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "engine", "image": "sglang-pd:0.1.0"}]},
        "status": status,
    }


def _line(kind: str, pod: dict[str, Any]) -> str:
    return json.dumps({"type": kind, "object": pod})


# A prefill pod going Pending → Running (not ready) → Ready → rescheduled with a new IP → deleted.
PREFILL_EVENTS = [
    _line("ADDED", _pod("dsv3-prefill-0", "prefill", None, ready=False, phase="Pending", rv="10")),
    _line(
        "MODIFIED",
        _pod(
            "dsv3-prefill-0",
            "prefill",
            "10.1.0.5",
            ready=False,
            rv="11",
            annotations={"sglang-pd/bootstrap-port": "8998"},
        ),
    ),
    _line(
        "MODIFIED",
        _pod(
            "dsv3-prefill-0",
            "prefill",
            "10.1.0.5",
            ready=True,
            rv="12",
            annotations={"sglang-pd/bootstrap-port": "9100", "sglang-pd/port": "31000"},
        ),
    ),
    _line("ADDED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=True, rv="13")),
    _line(
        "MODIFIED",
        _pod(
            "dsv3-prefill-0",
            "prefill",
            "10.1.0.9",
            ready=True,
            rv="14",
            annotations={"sglang-pd/bootstrap-port": "9100", "sglang-pd/port": "31000"},
        ),
    ),
    _line("MODIFIED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=True, rv="15", deleting=True)),
    _line("DELETED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=False, rv="16")),
]
DECODE_EVENTS = [
    _line("ADDED", _pod("dsv3-decode-0", "decode", "10.2.0.7", ready=True, rv="20")),
    _line("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "21"}}),
]


def _decoded(lines: list[str]) -> list[dict[str, Any]]:
    w = watch.Watch()
    return [w.unmarshal_event(line, "V1Pod") for line in lines]


def test_pod_endpoint_reads_ip_ports_and_readiness() -> None:
    pod = _pod("p", "prefill", "10.0.0.1", ready=True, annotations={"sglang-pd/bootstrap-port": "9000"})
    assert pod_endpoint(pod, "prefill", CONFIG) == ("http://10.0.0.1:30000", 9000)
    assert pod_endpoint(pod, "decode", CONFIG) == ("http://10.0.0.1:30000", None)
    assert pod_endpoint(_pod("p", "prefill", "10.0.0.1", ready=False), "prefill", CONFIG) is None
    assert pod_endpoint(_pod("p", "prefill", "fd00::3", ready=True), "prefill", CONFIG) == (
        "http://[fd00::3]:30000",
        8998,
    )


def test_recorded_events_drive_the_registry() -> None:
    registry = WorkerRegistry()
    discovery = KubernetesDiscovery(registry, CONFIG)
    seen: list[list[str]] = []
    for event in _decoded(PREFILL_EVENTS):
        assert "raw_object" in event and event["object"].metadata.name.startswith("dsv3-prefill")
        discovery.apply_event("prefill", event)
        seen.append(sorted(f"{w.url}|{w.bootstrap_port}" for w in registry.prefill))
    assert seen == [
        [],
        [],
        ["http://10.1.0.5:31000|9100"],
        ["http://10.1.0.5:31000|9100", "http://10.1.0.6:30000|8998"],
        ["http://10.1.0.6:30000|8998", "http://10.1.0.9:31000|9100"],
        ["http://10.1.0.9:31000|9100"],
        ["http://10.1.0.9:31000|9100"],
    ]
    for event in _decoded(DECODE_EVENTS):
        discovery.apply_event("decode", event)
    assert [w.url for w in registry.decode] == ["http://10.2.0.7:30000"]
    assert all(w.source == "kubernetes" for w in registry.all())


class _RecordedResponse:
    """Stands in for the urllib3 response the watch reads: the recorded lines, then EOF."""

    def __init__(self, lines: list[str]) -> None:
        self._data = ("\n".join(lines) + "\n").encode()
        self.status = 200

    def stream(self, amt: Any = None, decode_content: bool = False) -> Any:
        # Split mid-line, as network chunks do.
        for i in range(0, len(self._data), 97):
            yield self._data[i : i + 97]

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def test_watch_loop_with_recorded_stream() -> None:
    calls: list[dict[str, Any]] = []

    def list_namespaced_pod(namespace: str, **kwargs: Any) -> _RecordedResponse:
        """:return: V1PodList"""
        calls.append({"namespace": namespace, **kwargs})
        lines = PREFILL_EVENTS if "prefill" in kwargs["label_selector"] else DECODE_EVENTS
        return _RecordedResponse(lines)

    async def scenario() -> WorkerRegistry:
        registry = WorkerRegistry()
        discovery = KubernetesDiscovery(registry, CONFIG, list_pods=list_namespaced_pod)
        discovery.start(asyncio.get_running_loop())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if registry.decode and [w.url for w in registry.prefill] == ["http://10.1.0.9:31000"]:
                break
        await asyncio.to_thread(discovery.stop)
        return registry

    registry = asyncio.run(scenario())
    assert [w.url for w in registry.prefill] == ["http://10.1.0.9:31000"]
    assert [w.url for w in registry.decode] == ["http://10.2.0.7:30000"]
    first = {c["label_selector"]: c for c in calls}
    assert first["sglang-pd/role=prefill"]["watch"] is True
    assert first["sglang-pd/role=decode"]["namespace"] == "llm"
