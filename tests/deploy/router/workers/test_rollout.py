"""Traffic during a rollout, through real worker processes and a router on loopback: client requests stay on the
approved revision while a candidate is healthy beside it; the candidate gets only requests pinned with the admin
key (and the canary share when one is set); approval moves client traffic, and the old revision drains with its
streams in flight finished. Each check has its control: the same request without the admin key, a share of 0."""

from __future__ import annotations

import argparse
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.cli import add_arguments, build_config
from sglang_pd.deploy.router.config import RouterConfig

from ..conftest import Cluster

ADMIN_KEY = "sk-admin-rollout"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PIN_B = {**ADMIN, "x-sglpd-revision": "rev-b"}
BODY = {"model": "test-model", "prompt": "hello", "max_tokens": 2}


def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _traffic(url: str, revision: str, route: str) -> float:
    text = httpx.get(url + "/metrics").text
    return _metric(text, "sglang_pd_router_revision_traffic_total", f'revision="{revision}",route="{route}"')


def _send(url: str, n: int, headers: dict[str, str] | None = None) -> list[int]:
    def one(_: int) -> int:
        return httpx.post(url + "/v1/completions", json=BODY, headers=headers, timeout=10).status_code

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def _served(cluster: Cluster) -> list[int]:
    """Requests each decode served: [d0 (rev-a), d1 (rev-b)]."""
    return [len(d.state()["requests"]) for d in cluster.decodes]


def _add_b(cluster: Cluster, url: str) -> None:
    p1, d1 = cluster.prefills[1], cluster.decodes[1]
    for body in (
        {"url": p1.url, "role": "prefill", "bootstrap_port": p1.bootstrap_port, "revision": "rev-b"},
        {"url": d1.url, "role": "decode", "revision": "rev-b"},
    ):
        added = httpx.post(url + "/workers", json=body, headers=ADMIN, timeout=10)
        assert added.status_code == 201 and added.json()["healthy"], added.text


def _revisions(url: str) -> dict[str, Any]:
    listed = httpx.get(url + "/admin/revisions", headers=ADMIN).json()
    return {"approved": listed["approved"], **{r["revision"]: r for r in listed["revisions"]}}


@pytest.fixture
def a_serving(cluster_factory: Callable[..., Cluster]) -> Callable[..., Any]:
    """`start(**config)`: revision a (p0, d0) serving through a router; p1 and d1 are up, not registered."""
    cluster = cluster_factory(2, 2, processes=True)

    def start(**changes: Any) -> Any:
        p0, d0 = cluster.prefills[0], cluster.decodes[0]
        config: RouterConfig = replace(
            cluster.config(admin_key=ADMIN_KEY, **changes),
            prefill_workers=((p0.url + "@rev-a", p0.bootstrap_port),),
            decode_workers=(d0.url + "@rev-a",),
        )
        return cluster.serve(config)

    start.cluster = cluster  # type: ignore[attr-defined]
    return start


def test_candidate_gets_only_pinned_requests_until_approved(a_serving: Any) -> None:
    cluster: Cluster = a_serving.cluster
    with a_serving() as running:
        url = running.url
        assert _send(url, 10) == [200] * 10  # revision a is approved: the first with a healthy pair
        _add_b(cluster, url)
        listed = _revisions(url)
        assert listed["approved"] == "rev-a" and listed["rev-b"]["state"] == "candidate" and listed["rev-b"]["paired"]

        assert _send(url, 40) == [200] * 40
        assert _served(cluster) == [50, 0]  # b is healthy, and no client request reached it
        assert _send(url, 12, PIN_B) == [200] * 12
        assert _served(cluster) == [50, 12]
        assert _traffic(url, "rev-b", "client") == 0 and _traffic(url, "rev-b", "pinned") == 12
        assert _traffic(url, "rev-a", "client") == 50

        # The header without the admin key is refused, not ignored (control: the admin key's request passed).
        refused = httpx.post(url + "/v1/completions", json=BODY, headers={"x-sglpd-revision": "rev-b"}, timeout=10)
        assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"], refused.text
        bad = httpx.post(url + "/v1/completions", json=BODY, headers={**ADMIN, "x-sglpd-revision": "b b"}, timeout=10)
        assert bad.status_code == 400 and "x-sglpd-revision" in bad.json()["error"]["message"], bad.text
        gone = httpx.post(url + "/v1/completions", json=BODY, headers={**ADMIN, "x-sglpd-revision": "rev-z"})
        assert gone.status_code == 503 and "rev-z" in gone.json()["error"]["message"], gone.text
        assert _served(cluster) == [50, 12]

        # Approval: refused without the admin key, for a revision without a pair, then done.
        body = {"revision": "rev-b"}
        assert httpx.post(url + "/admin/revisions/approve", json=body).status_code == 401
        unpaired = httpx.post(url + "/admin/revisions/approve", json={"revision": "rev-z"}, headers=ADMIN)
        assert unpaired.status_code == 409 and "no healthy prefill and decode pair" in unpaired.text
        approved = httpx.post(url + "/admin/revisions/approve", json=body, headers=ADMIN)
        assert approved.status_code == 200 and approved.json()["approved"] == "rev-b", approved.text

        assert _send(url, 30) == [200] * 30
        assert _served(cluster) == [50, 42]  # every client request now on b, none on a
        listed = _revisions(url)
        assert listed["rev-a"]["state"] == "drained" and listed["rev-b"]["state"] == "approved"
        metrics = httpx.get(url + "/metrics").text
        assert _metric(metrics, "sglang_pd_router_revision_approved", 'revision="rev-b"') == 1
        assert _metric(metrics, "sglang_pd_router_revision_approved", 'revision="rev-a"') == 0
        assert _metric(metrics, "sglang_pd_router_cross_revision_pairs_total") == 0


def test_old_revision_drains_its_streams_after_approval(a_serving: Any) -> None:
    cluster: Cluster = a_serving.cluster
    cluster.decodes[0].configure(token_delay=0.2, tokens=10)  # a's streams last about 2 s
    with a_serving() as running:
        url = running.url
        _add_b(cluster, url)
        results: list[tuple[int, str]] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
                results.append((r.status_code, r.read().decode()))

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while _revisions(url)["rev-a"]["in_flight"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.post(url + "/admin/revisions/approve", json={"revision": "rev-b"}, headers=ADMIN).is_success
        listed = _revisions(url)
        assert listed["rev-a"]["state"] == "draining" and listed["rev-a"]["in_flight"] > 0, listed
        assert _send(url, 8) == [200] * 8  # new requests: on b while a's streams go on
        assert _served(cluster)[1] == 8
        for t in threads:
            t.join(timeout=30)
        assert [status for status, _ in results] == [200] * 4
        assert all(text.rstrip().endswith("data: [DONE]") for _, text in results)
        assert _served(cluster)[0] == 4
        assert _revisions(url)["rev-a"]["state"] == "drained"
        # Drained, it is removed; b keeps serving.
        for worker, role in ((cluster.prefills[0], "prefill"), (cluster.decodes[0], "decode")):
            httpx.delete(url + "/workers", params={"url": worker.url, "role": role}, headers=ADMIN).raise_for_status()
        assert _send(url, 4) == [200] * 4 and _revisions(url)["approved"] == "rev-b"


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_canary_share_sends_that_share_to_the_candidate(a_serving: Any, share: float) -> None:
    cluster: Cluster = a_serving.cluster
    with a_serving(canary_share=share) as running:
        url = running.url
        assert _send(url, 4) == [200] * 4  # a approved first
        _add_b(cluster, url)
        assert _send(url, 200) == [200] * 200
        to_b = _traffic(url, "rev-b", "canary")
        assert _served(cluster)[1] == to_b and _traffic(url, "rev-b", "client") == 0
        if share:  # binomial(200, 0.25): mean 50, sd 6
            assert 20 <= to_b <= 80, to_b
        else:  # the control: no share, no canary
            assert to_b == 0


def test_canary_share_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'canary_share' has value 1\.5\. It must be between 0 and 1"):
        RouterConfig(canary_share=1.5)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config, _ = build_config(parser.parse_args(["--decode", "http://d:30001", "--canary-share", "0.1"]), {})
    assert config.canary_share == 0.1
    with pytest.raises(ValueError, match="canary_share"):
        build_config(parser.parse_args(["--decode", "http://d:30001", "--canary-share", "-0.1"]), {})


def test_approved_revision_flag_holds_traffic_from_the_start(cluster_factory: Callable[..., Cluster]) -> None:
    # Both revisions registered at start, b first: without the flag b would be approved (the control), with
    # --approved-revision rev-a every client request goes to a.
    cluster = cluster_factory(2, 2, processes=True)
    (p0, p1), (d0, d1) = cluster.prefills, cluster.decodes
    for approved, expected in (("", [0, 20]), ("rev-a", [20, 0])):
        config = replace(
            cluster.config(admin_key=ADMIN_KEY, approved_revision=approved),
            prefill_workers=((p1.url + "@rev-b", p1.bootstrap_port), (p0.url + "@rev-a", p0.bootstrap_port)),
            decode_workers=(d1.url + "@rev-b", d0.url + "@rev-a"),
        )
        before = _served(cluster)
        with cluster.serve(config) as running:
            deadline = time.monotonic() + 10
            while not all(
                r["paired"] for r in httpx.get(running.url + "/admin/revisions", headers=ADMIN).json()["revisions"]
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert _send(running.url, 20) == [200] * 20
        assert [n - b for n, b in zip(_served(cluster), before, strict=True)] == expected
    with pytest.raises(ValueError, match="'approved_revision': revision 'a b' is not valid"):
        RouterConfig(approved_revision="a b")
