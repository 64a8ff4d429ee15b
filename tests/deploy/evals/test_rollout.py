"""`--wait-rollout`: the gate reads LeaderWorkerSets from a loopback stand-in of the Kubernetes API, with
status objects shaped as leaderworkerset.x-k8s.io/v1 defines them, and scores only once every group is
updated and ready; a partial rollout is not scored (exit 4, no question asked)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sglang_pd.deploy.evals import Dataset, InCluster
from sglang_pd.deploy.evals import cli as eval_cli_module
from sglang_pd.deploy.evals.rollout import LWS_API, rollout_problem
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

Serve = Callable[[ServerScript], Gsm8kTestServer]


def lws(
    name: str,
    *,
    replicas: int = 2,
    created: int | None = 2,
    updated: int | None = 2,
    ready: int | None = 2,
    generation: int = 3,
    observed: int | None = 3,
    updating: bool = False,
) -> dict[str, Any]:
    """A LeaderWorkerSet as the API server returns it; a count given as None is left out, as the API's
    `omitempty` leaves out a 0."""
    status: dict[str, Any] = {"hpaPodSelector": f"leaderworkerset.sigs.k8s.io/name={name},worker-index=0"}
    for key, value in (("replicas", created), ("updatedReplicas", updated), ("readyReplicas", ready)):
        if value:
            status[key] = value
    condition = {"lastTransitionTime": "2026-11-30T10:00:00Z", "reason": "x", "message": ""}
    if observed is not None:
        condition["observedGeneration"] = observed
    status["conditions"] = [
        {**condition, "type": "Available", "status": "True"},
        {**condition, "type": "UpdateInProgress", "status": "True" if updating else "False"},
    ]
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": "llm", "generation": generation},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": {"size": 2}},
        "status": status,
    }


@pytest.mark.parametrize(
    ("obj", "waits_for"),
    [
        (lws("p"), None),
        (lws("p", updated=1, updating=True), "1 of 2 groups updated"),
        (lws("p", ready=1), "1 of 2 groups ready"),
        (lws("p", updated=None, ready=None), "0 of 2 groups updated"),  # omitempty: absent is 0
        (lws("p", created=3), "3 of 2 groups created"),  # a surge group still there
        (lws("p", observed=2), "has not yet seen generation 3"),  # the status predates the new template
        (lws("p", updating=True), "rolling update in progress"),
        (lws("p", replicas=0, created=None, updated=None, ready=None), None),  # scaled to zero
    ],
)
def test_rollout_problem(obj: dict[str, Any], waits_for: str | None) -> None:
    problem = rollout_problem(obj)
    assert problem == waits_for if waits_for is None else waits_for in (problem or "")


class _LwsApi:
    """GET .../leaderworkersets/NAME answers the next object of NAME's script (the last one stays)."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]], status: int = 200) -> None:
        self.reads: list[str] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                prefix = f"/{LWS_API}/namespaces/llm/leaderworkersets/"
                name = self.path.removeprefix(prefix)
                api.reads.append(name)
                script = scripts.get(name) if self.path.startswith(prefix) else None
                if status != 200 or script is None:
                    self.send_response(status if status != 200 else 404)
                    self.end_headers()
                    return
                body = json.dumps(script.pop(0) if len(script) > 1 else script[0]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.cluster = InCluster(f"http://127.0.0.1:{self.server.server_port}", "llm", "tok3n", None)


@pytest.fixture
def lws_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _LwsApi]]:
    apis: list[_LwsApi] = []
    monkeypatch.setattr(eval_cli_module, "ROLLOUT_POLL_S", 0.05)

    def start(scripts: dict[str, list[dict[str, Any]]], status: int = 200) -> _LwsApi:
        api = _LwsApi(scripts, status)
        api.thread.start()
        apis.append(api)
        monkeypatch.setattr(eval_cli_module, "in_cluster", lambda: api.cluster)
        return api

    yield start
    for api in apis:
        api.server.shutdown()
        api.server.server_close()
        api.thread.join(timeout=10)


WAIT = ("--wait-rollout", "demo-prefill", "--wait-rollout", "demo-decode")


def test_a_partial_rollout_is_not_scored(dataset: Dataset, serve: Serve, eval_cli: Any, lws_api: Any) -> None:
    api = lws_api(
        {"demo-prefill": [lws("demo-prefill")], "demo-decode": [lws("demo-decode", updated=1, updating=True)]}
    )
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    result = eval_cli(server.base_url, "--num-questions", "20", *WAIT, "--rollout-timeout", "0.5")
    assert result.code == 4, result.err
    assert "demo-decode: 1 of 2 groups updated" in result.err and "not scored" in result.err
    assert server.bodies == [] and server.model_lists == 0  # no question asked, the router not even read
    assert result.report is not None and result.report["status"] == "error"
    assert api.reads.count("demo-decode") >= 2  # it waited, reading again


def test_the_gate_scores_once_the_rollout_is_done(dataset: Dataset, serve: Serve, eval_cli: Any, lws_api: Any) -> None:
    rolling = [lws("demo-decode", updated=1, ready=1), lws("demo-decode", ready=1), lws("demo-decode", observed=2)]
    api = lws_api({"demo-prefill": [lws("demo-prefill")], "demo-decode": [*rolling, lws("demo-decode")]})
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    result = eval_cli(server.base_url, "--num-questions", "20", *WAIT, "--rollout-timeout", "30")
    assert result.code == 0, result.err
    assert api.reads.count("demo-decode") == 4  # three partial states waited out, then the rolled-out one
    assert len(server.bodies) == 20 and "rollout finished" in result.err


@pytest.mark.parametrize(("status", "message"), [(403, "needs get on it"), (404, "does not exist")])
def test_the_api_refusing_ends_at_once(
    dataset: Dataset, serve: Serve, eval_cli: Any, lws_api: Any, status: int, message: str
) -> None:
    lws_api({}, status)
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    result = eval_cli(server.base_url, "--num-questions", "5", *WAIT, "--rollout-timeout", "60")
    assert result.code == 4 and message in result.err and server.bodies == []


def test_wait_rollout_needs_its_budget(eval_cli: Any) -> None:
    result = eval_cli("http://127.0.0.1:1/v1", "--wait-rollout", "demo-decode", report=False)
    assert result.code == 2 and "--rollout-timeout" in result.err
