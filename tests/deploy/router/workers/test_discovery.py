"""Kubernetes discovery, driven by recorded watch events: the JSON lines a kube-apiserver streams
for `GET /api/v1/namespaces/NS/pods?watch=true&labelSelector=...`, decoded by the kubernetes
client's own `Watch` (so the event dicts are exactly what the router sees in a cluster)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes import watch

from sglang_pd.deploy.common.contract import LABEL_LWS_WORKER_INDEX, worker_selector
from sglang_pd.deploy.router.config import KubernetesDiscoveryConfig
from sglang_pd.deploy.router.policies import CacheAware, RoundRobin, RoutingRequest
from sglang_pd.deploy.router.workers.discovery import KubernetesDiscovery, pod_endpoint
from sglang_pd.deploy.router.workers.pairs import PairPicker
from sglang_pd.deploy.router.workers.registry import WorkerRegistry
from tests.support.paths import REPO

CONFIG = KubernetesDiscoveryConfig(namespace="llm", port=30000)
CHART = REPO / "helm" / "sglang-pd"


def _chart_labels(role: str) -> dict[str, str]:
    """The labels a leader pod of `role` carries in a cluster: the chart's pod template labels
    (release `dsv3`), plus the rank LeaderWorkerSet adds."""
    return {
        "app.kubernetes.io/name": "sglang-pd",
        "app.kubernetes.io/instance": "dsv3",
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/part-of": "sglang-pd",
        "app.kubernetes.io/version": "0.1.0",
        LABEL_LWS_WORKER_INDEX: "0",
    }


def _matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selector matching, as the API server does it."""
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",")))


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
        "labels": _chart_labels(role),
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
P0 = "dsv3-prefill-0"
BOOT = {"sglang-pd/bootstrap-port": "8998"}
PORTS = {"sglang-pd/bootstrap-port": "9100", "sglang-pd/port": "31000"}
PREFILL_EVENTS = [
    _line("ADDED", _pod(P0, "prefill", None, ready=False, phase="Pending", rv="10")),
    _line("MODIFIED", _pod(P0, "prefill", "10.1.0.5", ready=False, rv="11", annotations=BOOT)),
    _line("MODIFIED", _pod(P0, "prefill", "10.1.0.5", ready=True, rv="12", annotations=PORTS)),
    _line("ADDED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=True, rv="13")),
    _line("MODIFIED", _pod(P0, "prefill", "10.1.0.9", ready=True, rv="14", annotations=PORTS)),
    _line("MODIFIED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=True, rv="15", deleting=True)),
    _line("DELETED", _pod("dsv3-prefill-1", "prefill", "10.1.0.6", ready=False, rv="16")),
]  # fmt: skip
DECODE_EVENTS = [
    _line("ADDED", _pod("dsv3-decode-0", "decode", "10.2.0.7", ready=True, rv="20")),
    _line("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "21"}}),
]


def _labels_of(line: str) -> dict[str, str]:
    return dict(json.loads(line)["object"]["metadata"].get("labels") or {})


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
        # The API server sends only the pods the selector matches.
        selector = kwargs["label_selector"]
        lines = [ln for ln in PREFILL_EVENTS + DECODE_EVENTS if _matches(selector, _labels_of(ln))]
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
    assert first[worker_selector("prefill")]["watch"] is True
    assert first[worker_selector("decode")]["namespace"] == "llm"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_default_selectors_find_the_pods_the_chart_labels(role: str) -> None:
    helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (the `dev` extra)")
    import yaml

    chart = helm_python.Chart.load(str(CHART))
    try:
        rendered = chart.render({}, name="dsv3", namespace="llm")  # the default values
    finally:
        chart.close()
    manifests = [text for path, text in rendered.items() if not path.endswith("NOTES.txt")]
    docs = [d for text in manifests for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"].endswith(role)]
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = template.get("leaderTemplate", template["workerTemplate"])["metadata"]["labels"]
    with_rank = lambda rank: {**leader, LABEL_LWS_WORKER_INDEX: rank}  # noqa: E731  LWS adds the rank
    for selector in (worker_selector(role), worker_selector(role, "dsv3")):  # type: ignore[arg-type]
        assert _matches(selector, with_rank("0")), (selector, leader)
        assert not _matches(selector, with_rank("1")), "only leaders serve HTTP"
    other = "decode" if role == "prefill" else "prefill"
    assert not _matches(worker_selector(other), with_rank("0"))  # type: ignore[arg-type]
    assert not _matches(worker_selector(role, "other-release"), with_rank("0"))  # type: ignore[arg-type]
    # The chart's router watches with the same selector the CLI builds for its release.
    (router,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")]
    args = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[args.index(f"--k8s-{role}-selector") + 1] == worker_selector(role, "dsv3")  # type: ignore[arg-type]


def test_a_pod_removed_by_discovery_leaves_no_policy_state() -> None:
    registry = WorkerRegistry()
    policy = CacheAware(block_chars=8)
    pairs = PairPicker(registry, policy, RoundRobin())
    discovery = KubernetesDiscovery(registry, CONFIG)
    for event in _decoded(PREFILL_EVENTS[:4]):
        discovery.apply_event("prefill", event)
    workers = list(registry.prefill)
    assert len(workers) == 2
    for w in workers:
        w.healthy = True
    text = "the same long system prompt, shared " * 4
    chosen = policy.select(workers, RoutingRequest(text=text))
    assert policy.remembers(chosen)
    # dsv3-prefill-0 moves to a new IP and dsv3-prefill-1 is deleted: both old addresses leave.
    for event in _decoded(PREFILL_EVENTS[4:]):
        discovery.apply_event("prefill", event)
    assert [w.url for w in registry.prefill] == ["http://10.1.0.9:31000"]
    assert not any(policy.remembers(w) for w in workers), "departed pods keep no prefix tree"
    assert pairs.policies["prefill"] is policy  # the picker that subscribed to the registry
