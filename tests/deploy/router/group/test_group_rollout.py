"""Approval in a router process group: the control process holds the approved revision and every serving
process follows it. Client requests over fresh connections (the kernel spreads them over both processes) stay
on revision a while b is healthy beside it; one approval through one process moves every process's client
requests to b. The control: before the approval, b gets none."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.polling import free_port, wait_until
from tests.support.router_group import RouterGroup
from tests.support.router_worker_server import WorkerProcess, start_workers

pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer admin-key"}
BODY = {"model": "test-model", "prompt": "hi", "max_tokens": 2}


@pytest.fixture
def workers() -> Iterator[tuple[list[WorkerProcess], list[WorkerProcess]]]:
    prefills, decodes = start_workers(2, 2, health_tick_s=0.0)
    yield prefills, decodes
    for w in prefills + decodes:
        w.stop()


def _served(decodes: list[WorkerProcess]) -> list[int]:
    return [len(d.state()["requests"]) for d in decodes]


def _send(group: RouterGroup, n: int) -> None:
    statuses = [group.fresh("POST", "/v1/completions", json=BODY).status_code for _ in range(n)]
    assert statuses == [200] * n


def test_one_approval_moves_every_serving_process(
    workers: tuple[list[WorkerProcess], list[WorkerProcess]], tmp_path: Path
) -> None:
    (p0, p1), (d0, d1) = workers
    flags = ["--admin-key", "admin-key", "--health-interval", "0.5", "--decode", f"{d0.url}@rev-a"]
    flags += ["--prefill", f"{p0.url}@rev-a", str(p0.bootstrap_port)]
    group = RouterGroup(tmp_path / "router.log", free_port(), *flags)
    try:
        wait_until(lambda: group.started() == 2, 30)
        wait_until(lambda: group.fresh("GET", "/readiness").json().get("decode") == 1, 10)
        _send(group, 10)
        for body in (
            {"url": p1.url, "role": "prefill", "bootstrap_port": p1.bootstrap_port, "revision": "rev-b"},
            {"url": d1.url, "role": "decode", "revision": "rev-b"},
        ):
            assert group.fresh("POST", "/workers", json=body, headers=ADMIN).status_code == 201
        wait_until(lambda: all(group.fresh("GET", "/readiness").json()["decode"] == 2 for _ in range(6)), 10)
        _send(group, 30)
        assert _served([d0, d1]) == [40, 0]
        served_by = {x.get("router_process") for x in group.lines() if x.get("msg") == "request finished"}
        assert served_by == {0, 1}  # both processes held client requests on a

        approved = group.fresh("POST", "/admin/revisions/approve", json={"revision": "rev-b"}, headers=ADMIN)
        assert approved.status_code == 200 and approved.json()["approved"] == "rev-b", approved.text
        for _ in range(6):  # whichever process answers
            assert group.fresh("GET", "/admin/revisions", headers=ADMIN).json()["approved"] == "rev-b"
        _send(group, 30)
        assert _served([d0, d1]) == [40, 30]
        unpaired = group.fresh("POST", "/admin/revisions/approve", json={"revision": "rev-z"}, headers=ADMIN)
        assert unpaired.status_code == 409 and "no healthy prefill and decode pair" in unpaired.text
    finally:
        group.stop(grace_s=10)
