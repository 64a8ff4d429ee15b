"""Pairs within one revision: through real worker processes and a router on loopback, every decode reads KV
only from prefills of its revision, whichever way the revision was given (`URL@REVISION`, `POST /workers`,
a pod's label); the metrics count requests per revision and no cross pair. The routers here send half the
client requests to the revision that is not approved (--canary-share 0.5), so that both serve. The controls
take the filter out and see the checks catch the cross pairs it lets through."""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.cli import add_arguments, build_config
from sglang_pd.deploy.router.config import KubernetesDiscoveryConfig
from sglang_pd.deploy.router.metrics import RouterMetrics
from sglang_pd.deploy.router.types import Role
from sglang_pd.deploy.router.workers import pairs
from sglang_pd.deploy.router.workers.discovery import KubernetesDiscovery
from sglang_pd.deploy.router.workers.registry import Worker, WorkerRegistry
from sglang_pd.deploy.router.workers.revisions import record_pair
from sglang_pd.deploy.router.workers.rollout import Rollout
from sglang_pd.deploy.spec.revision import REVISION_LABEL, split_revision

from ..conftest import Cluster

ADMIN_KEY = "sk-admin-revisions"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REQUESTS = 120
BODY = {"model": "test-model", "prompt": "hello", "max_tokens": 2}


def _metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample of the router's /metrics (0 when absent)."""
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def two_revisions(cluster_factory: Callable[..., Cluster]) -> Iterator[Any]:
    """Two prefills and two decodes as processes: p0, d0 and p1 given as URL@REVISION, d1 through POST /workers."""
    cluster = cluster_factory(2, 2, processes=True)
    p0, p1 = cluster.prefills
    d0, _ = cluster.decodes
    config = replace(
        # random: round robin on both roles would walk p0-d0, p1-d1 in step and never cross, filter or not
        cluster.config(admin_key=ADMIN_KEY, prefill_policy="random", decode_policy="random", canary_share=0.5),
        prefill_workers=((p0.url + "@rev-a", p0.bootstrap_port), (p1.url + "@rev-b", p1.bootstrap_port)),
        decode_workers=(d0.url + "@rev-a",),
    )
    with cluster.serve(config) as running:
        yield cluster, running


def _send_many(url: str) -> None:
    def one(_: int) -> int:
        return httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(REQUESTS)))
    assert statuses == [200] * REQUESTS


def _kv_sources(cluster: Cluster) -> dict[str, set[int]]:
    """The bootstrap ports each decode was told to read KV from, by the decode's URL."""
    return {d.url: {r["port"] for r in d.state()["requests"]} for d in cluster.decodes}


def _register_d1(cluster: Cluster, url: str) -> None:
    d1 = cluster.decodes[1]
    added = httpx.post(url + "/workers", json={"url": d1.url, "role": "decode", "revision": "rev-b"}, headers=ADMIN)
    assert added.status_code == 201, added.text
    assert added.json()["revision"] == "rev-b"


def test_every_pair_is_of_one_revision(two_revisions: Any) -> None:
    cluster, running = two_revisions
    _register_d1(cluster, running.url)
    listed = httpx.get(running.url + "/workers", headers=ADMIN).json()
    assert {w["url"]: w["revision"] for w in listed["prefill"] + listed["decode"]} == {
        cluster.prefills[0].url: "rev-a",
        cluster.prefills[1].url: "rev-b",
        cluster.decodes[0].url: "rev-a",
        cluster.decodes[1].url: "rev-b",
    }
    _send_many(running.url)
    p0, p1 = cluster.prefills
    d0, d1 = cluster.decodes
    sources = _kv_sources(cluster)
    assert sources == {d0.url: {p0.bootstrap_port}, d1.url: {p1.bootstrap_port}}  # both served, each in its own
    metrics = httpx.get(running.url + "/metrics").text
    assert _metric(metrics, "sglang_pd_router_cross_revision_pairs_total") == 0
    per_revision = [
        _metric(metrics, "sglang_pd_router_revision_requests_total", f'revision="rev-{r}"') for r in ("a", "b")
    ]
    assert sum(per_revision) == REQUESTS and min(per_revision) > 0, per_revision


def test_control_without_the_filter_the_checks_see_cross_pairs(
    two_revisions: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The picker as it was: any prefill with any decode. The same checks must fail.
    monkeypatch.setattr(pairs, "paired_prefills", lambda prefills, decodes, registry, exclude: prefills)
    monkeypatch.setattr(pairs, "same_revision", lambda decodes, prefill: decodes)
    monkeypatch.setattr(Rollout, "narrow", lambda self, prefills, decodes, exclude: (prefills, decodes, "", "client"))
    cluster, running = two_revisions
    _register_d1(cluster, running.url)
    _send_many(running.url)
    p0, p1 = cluster.prefills
    sources = _kv_sources(cluster)
    assert sources[cluster.decodes[0].url] == {p0.bootstrap_port, p1.bootstrap_port}  # rev-a decode read rev-b KV
    metrics = httpx.get(running.url + "/metrics").text
    assert _metric(metrics, "sglang_pd_router_cross_revision_pairs_total") > 0


def test_no_revision_with_both_roles_is_a_503_naming_them(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    (p,), (d,) = cluster.prefills, cluster.decodes
    config = replace(
        cluster.config(), prefill_workers=((p.url + "@new", p.bootstrap_port),), decode_workers=(d.url + "@old",)
    )
    with cluster.serve(config, ready=False) as running:
        resp = httpx.post(running.url + "/v1/completions", json=BODY, timeout=10)
        for _ in range(50):  # until the health checks admitted both
            if "revision" in resp.text:
                break
            time.sleep(0.1)
            resp = httpx.post(running.url + "/v1/completions", json=BODY, timeout=10)
        assert resp.status_code == 503
        message = resp.json()["error"]["message"]
        assert "prefill revisions new" in message and "decode revisions old" in message
        assert d.state()["requests"] == []


def _worker(role: Role, revision: str) -> Worker:
    return WorkerRegistry().add(f"http://{role}-{revision}:30000", role, revision=revision)


def test_record_pair_counts_a_cross_pair() -> None:
    metrics = RouterMetrics()
    record_pair(metrics, _worker("prefill", "a"), _worker("decode", "a"))
    assert metrics.cross_revision_pairs._value.get() == 0
    record_pair(metrics, _worker("prefill", "a"), _worker("decode", "b"))  # forced across revisions
    assert metrics.cross_revision_pairs._value.get() == 1
    assert metrics.revision_requests.labels("a")._value.get() == 2


def test_discovery_reads_the_revision_label() -> None:
    registry = WorkerRegistry()
    discovery = KubernetesDiscovery(registry, KubernetesDiscoveryConfig(namespace="llm", port=30000))

    def pod(revision: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "p-0", "labels": {REVISION_LABEL: revision}, "annotations": {}},
            "status": {"phase": "Running", "podIP": "10.0.0.4", "conditions": [{"type": "Ready", "status": "True"}]},
        }

    discovery.apply_event("decode", {"type": "ADDED", "raw_object": pod("3f2a9c01")})
    assert [w.revision for w in registry.decode] == ["3f2a9c01"]
    # The same address, another pod revision (a recreated pod): the worker takes the new revision.
    discovery.apply_event("decode", {"type": "MODIFIED", "raw_object": pod("77aa0b12")})
    assert [w.revision for w in registry.decode] == ["77aa0b12"]


def test_group_state_carries_the_revision() -> None:
    source = WorkerRegistry()
    source.add("http://10.0.0.1:30000", "prefill", revision="r1")
    mirror = WorkerRegistry()
    mirror.sync([w.state() for w in source.all()])
    assert [w.revision for w in mirror.prefill] == ["r1"]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_takes_url_at_revision_and_refuses_a_bad_one() -> None:
    config, _ = build_config(_parse(["--prefill", "http://p:30000@r1", "9000", "--decode", "http://d:30001@r1"]), {})
    assert config.prefill_workers == (("http://p:30000@r1", 9000),)
    assert split_revision(config.decode_workers[0]) == ("http://d:30001", "r1")
    with pytest.raises(ValueError, match="revision 'r 1!' is not valid"):
        build_config(_parse(["--decode", "http://d:30001@r 1!"]), {})
    with pytest.raises(ValueError, match="no URL before '@'"):
        build_config(_parse(["--decode", "@r1"]), {})


def test_post_workers_refuses_a_bad_revision(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(admin_key=ADMIN_KEY)) as running:
        for bad in ("not valid!", 7):
            body = {"url": "http://10.9.9.9:30000", "role": "decode", "revision": bad}
            resp = httpx.post(running.url + "/workers", json=body, headers=ADMIN)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "revision", resp.text
        assert len(httpx.get(running.url + "/workers", headers=ADMIN).json()["decode"]) == 1
