"""The router forwards only what the protocol needs: no client credentials, cookies or hop-by-hop
headers reach workers, and workers' headers do not leak back; logs are JSON with the request id."""

from __future__ import annotations

import io
import json
import logging
import re

import httpx

from sglang_pd.deploy.router.log import JsonFormatter, logger, request_id_var

from .conftest import Cluster, RunningRouter

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_client_headers_are_not_forwarded(cluster_1p1d: Cluster, router_1p1d: RunningRouter) -> None:
    headers = {
        "Authorization": "Bearer client-secret-key",
        "Cookie": "session=abc",
        "X-Client-Secret": "s3cr3t",
        "Connection": "keep-alive, X-Client-Secret",
        "TE": "trailers",
        "X-Request-ID": "hdr-check-1",
    }
    routed = []
    for stream in (False, True):
        resp = httpx.post(router_1p1d.url + CHAT, json={**BODY, "stream": stream}, headers=headers)
        assert resp.status_code == 200
        assert "server" not in resp.headers or resp.headers["server"] == "uvicorn"
        assert resp.headers["x-request-id"] == "hdr-check-1"
        routed.append(resp.headers["x-router-request-id"])
    for worker in (cluster_1p1d.prefills[0], cluster_1p1d.decodes[0]):
        seen = [r for r in worker.state()["requests"] if r["rid"] in routed]
        assert len(seen) == 2
        for r in seen:  # workers see the router's id, never the client's
            assert r["headers"] == {"x-request-id": r["rid"]}


def test_worker_api_key_is_sent_to_workers(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(), worker_api_key="worker-key") as running:
        resp = httpx.post(running.url + CHAT, json=BODY, headers={"Authorization": "Bearer client"})
        assert resp.status_code == 200
        (seen,) = cluster.decodes[0].state()["requests"]
        assert seen["headers"]["authorization"] == "Bearer worker-key"


def test_log_lines_are_json_with_request_id() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    token = request_id_var.set("rid-42")
    try:
        logger.info("request finished", extra={"status": 200, "endpoint": CHAT})
    finally:
        request_id_var.reset(token)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    entry = json.loads(stream.getvalue())
    assert entry["request_id"] == "rid-42" and entry["status"] == 200 and entry["msg"] == "request finished"
    assert entry["level"] == "info" and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", entry["ts"]), entry
