"""The gate in a rollout, against our router with test worker processes of two revisions: `--revision` pins every
question to the candidate (the router's metrics count them as pinned, none as client traffic), `--approve`
approves it after a clean pass, and a failed gate holds it (the control: the same run with a floor it cannot
reach). A client key cannot pin; --approve needs --revision."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest

from tests.deploy.router.conftest import FAST as ROUTER_FAST
from tests.deploy.router.conftest import Cluster, serve_router, wait_ready
from tests.support.router_worker_server import start_workers

from .conftest import CliResult

ADMIN_KEY = "sk-admin-gate"
CLIENT_KEY = "sk-client-gate"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
QUESTIONS = 6


def _traffic(url: str, revision: str, route: str) -> float:
    text = httpx.get(url + "/metrics").text
    labels = re.escape(f'{{revision="{revision}",route="{route}"}}')
    match = re.search(rf"^sglang_pd_router_revision_traffic_total{labels} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.fixture
def router() -> Iterator[str]:
    """A router with revision a (p0, d0) approved and revision b (p1, d1) healthy beside it."""
    prefills, decodes = start_workers(2, 2, no_log=True, health_tick_s=0.0)
    cluster = Cluster(prefills, decodes)
    (p0, p1), (d0, d1) = prefills, decodes
    config = replace(
        ROUTER_FAST,
        admin_key=ADMIN_KEY,
        api_keys=(CLIENT_KEY,),
        prefill_workers=((p0.url + "@rev-a", p0.bootstrap_port),),
        decode_workers=(d0.url + "@rev-a",),
    )
    try:
        with serve_router(config) as running:
            wait_ready(running.url)
            client = {"Authorization": f"Bearer {CLIENT_KEY}"}
            body = {"model": "test-model", "prompt": "hi", "max_tokens": 2}
            assert httpx.post(running.url + "/v1/completions", json=body, headers=client).status_code == 200
            for added in (
                {"url": p1.url, "role": "prefill", "bootstrap_port": p1.bootstrap_port, "revision": "rev-b"},
                {"url": d1.url, "role": "decode", "revision": "rev-b"},
            ):
                assert httpx.post(running.url + "/workers", json=added, headers=ADMIN, timeout=10).status_code == 201
            yield running.url
    finally:
        cluster.stop()


def _approved(url: str) -> str:
    return str(httpx.get(url + "/admin/revisions", headers=ADMIN).json()["approved"])


FLAGS = ("--num-questions", str(QUESTIONS), "--parallel", "2", "--max-truncation-rate", "1", "--wait-ready", "10")


def test_gate_scores_the_pinned_candidate_and_approves_it(router: str, eval_cli: Callable[..., CliResult]) -> None:
    result = eval_cli(router + "/v1", *FLAGS, "--api-key", ADMIN_KEY, "--revision", "rev-b", "--approve")
    assert result.code == 0, result.err
    assert "approved revision rev-b" in result.err
    assert result.report is not None and result.report["config"]["revision"] == "rev-b"
    assert _traffic(router, "rev-b", "pinned") == QUESTIONS and _traffic(router, "rev-b", "client") == 0
    assert _approved(router) == "rev-b"


def test_failed_gate_holds_the_candidate(router: str, eval_cli: Callable[..., CliResult]) -> None:
    # The control of the test above: the same run with a floor the test workers' answers cannot reach.
    result = eval_cli(
        router + "/v1", *FLAGS, "--api-key", ADMIN_KEY, "--revision", "rev-b", "--approve", "--min-accuracy", "0.5"
    )
    assert result.code == 1, result.err
    assert "held: revision rev-b is not approved (exit 1)" in result.err
    assert _traffic(router, "rev-b", "pinned") == QUESTIONS and _traffic(router, "rev-b", "client") == 0
    assert _approved(router) == "rev-a"


def test_pinning_needs_the_admin_key(router: str, eval_cli: Callable[..., CliResult]) -> None:
    result = eval_cli(router + "/v1", *FLAGS, "--api-key", CLIENT_KEY, "--revision", "rev-b", report=False)
    assert result.code == 2, result.err
    assert "--revision needs the router's admin key as --api-key" in result.err
    assert _traffic(router, "rev-b", "pinned") == 0


def test_unpaired_revision_is_not_scored(router: str, eval_cli: Callable[..., CliResult]) -> None:
    flags = [f if f != "10" else "1" for f in FLAGS]  # --wait-ready 1
    result = eval_cli(router + "/v1", *flags, "--api-key", ADMIN_KEY, "--revision", "rev-z", report=False)
    assert result.code == 4, result.err
    assert "revision rev-z has no healthy prefill and decode pair" in result.err and "rev-b (candidate)" in result.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--approve",), "--approve needs --revision REV"),
        (("--revision", "b b"), "--revision: revision 'b b' is not valid"),
    ],
)
def test_rollout_flags_misused(eval_cli: Callable[..., CliResult], flags: Any, message: str) -> None:
    result = eval_cli("http://127.0.0.1:9/v1", *flags, report=False)
    assert result.code == 2 and message in result.err, result.err
