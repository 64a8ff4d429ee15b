"""`--publish-baseline`: a clean pass is stored in a ConfigMap through the Kubernetes API (a loopback
stand-in that records the PATCH), and the stored report is the next run's baseline."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals import Dataset, InCluster, PublishError, publish_baseline
from sglang_pd.deploy.evals import cli as eval_cli_module
from sglang_pd.deploy.evals.publish import BASELINE_KEY, in_cluster
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

Serve = Callable[[ServerScript], Gsm8kTestServer]


class _KubeApi:
    """Answers PATCH /api/v1/namespaces/NS/configmaps/NAME with `status`, keeping what was sent."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.requests: list[dict[str, Any]] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                api.requests.append({"path": self.path, "headers": dict(self.headers), "body": json.loads(body)})
                self.send_response(api.status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.cluster = InCluster(f"http://127.0.0.1:{self.server.server_port}", "llm", "tok3n", None)

    def stored(self) -> str:
        return str(self.requests[-1]["body"]["data"][BASELINE_KEY])


@pytest.fixture
def kube_api() -> Iterator[Callable[[int], _KubeApi]]:
    apis: list[_KubeApi] = []

    def start(status: int = 200) -> _KubeApi:
        api = _KubeApi(status)
        api.thread.start()
        apis.append(api)
        return api

    yield start
    for api in apis:
        api.server.shutdown()
        api.server.server_close()
        api.thread.join(timeout=10)


@pytest.fixture
def cluster_api(kube_api: Callable[[int], _KubeApi], monkeypatch: pytest.MonkeyPatch) -> Callable[[int], _KubeApi]:
    """A Kubernetes API stand-in answering `status`, which the gate's CLI takes for its cluster's."""

    def start(status: int) -> _KubeApi:
        api = kube_api(status)
        monkeypatch.setattr(eval_cli_module, "in_cluster", lambda: api.cluster)
        return api

    return start


def test_publish_patches_the_configmap_data_only(kube_api: Callable[[int], _KubeApi]) -> None:
    api = kube_api(200)
    publish_baseline("demo-gate-baseline", '{"a": 1}', api.cluster)
    (request,) = api.requests
    assert request["path"] == "/api/v1/namespaces/llm/configmaps/demo-gate-baseline"
    assert request["headers"]["Authorization"] == "Bearer tok3n"
    assert request["headers"]["Content-Type"] == "application/merge-patch+json"
    assert request["body"] == {"data": {"report.json": '{"a": 1}'}}


@pytest.mark.parametrize(
    ("status", "message"),
    [(403, "needs get/patch on it"), (404, "does not exist; the chart creates it"), (500, "HTTP 500")],
)
def test_publish_failures_say_what_to_fix(kube_api: Callable[[int], _KubeApi], status: int, message: str) -> None:
    with pytest.raises(PublishError, match=message):
        publish_baseline("cm", "{}", kube_api(status).cluster)


def test_publish_refuses_a_report_larger_than_a_configmap() -> None:
    with pytest.raises(PublishError, match="more than a ConfigMap holds"):
        publish_baseline("cm", "x" * 1_100_000, InCluster("http://127.0.0.1:1", "llm", "t"))


def test_in_cluster_reads_the_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(PublishError, match="only inside a Kubernetes pod"):
        in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    with pytest.raises(PublishError, match="automountServiceAccountToken"):
        in_cluster(tmp_path)
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("llm")
    cluster = in_cluster(tmp_path)
    assert (cluster.api_url, cluster.namespace, cluster.token) == ("https://10.0.0.1:6443", "llm", "tok")
    assert cluster.ca_path == tmp_path / "ca.crt" and "tok" not in repr(cluster)


def test_a_clean_pass_becomes_the_next_baseline(
    dataset: Dataset,
    serve: Serve,
    eval_cli: Any,
    cluster_api: Callable[[int], _KubeApi],
    tmp_path: Path,
) -> None:
    api = cluster_api(200)
    answers = scripted_answers(dataset.problems, correct=lambda p: p.index % 10 != 0)
    server = serve(ServerScript(answers=answers))

    first = eval_cli(server.base_url, "--num-questions", "300", "--publish-baseline", "demo-gate-baseline")
    assert first.code == 0 and "stored this report in ConfigMap demo-gate-baseline" in first.err
    stored = json.loads(api.stored())
    assert stored["status"] == "pass" and "output" not in stored["records"][0]
    assert len(api.stored()) < len(json.dumps(first.report))

    baseline = tmp_path / "from-configmap.json"
    baseline.write_text(api.stored())
    second = eval_cli(server.base_url, "--num-questions", "300", "--baseline", str(baseline), "--max-drop", "0.05")
    assert second.code == 0, second.err
    assert second.report["gate"]["rules"][0]["numbers"]["b10"] == 0


def test_a_failed_gate_is_not_stored(
    dataset: Dataset, serve: Serve, eval_cli: Any, cluster_api: Callable[[int], _KubeApi]
) -> None:
    api = cluster_api(200)
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: False)))
    result = eval_cli(
        server.base_url, "--num-questions", "10", "--min-accuracy", "0.5", "--publish-baseline", "demo-gate-baseline"
    )
    assert result.code == 1 and api.requests == []
    assert "not stored in ConfigMap demo-gate-baseline (only a clean pass is)" in result.err


def test_a_refused_publish_is_a_warning(
    dataset: Dataset, serve: Serve, eval_cli: Any, cluster_api: Callable[[int], _KubeApi]
) -> None:
    cluster_api(403)
    server = serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))
    result = eval_cli(server.base_url, "--num-questions", "10", "--publish-baseline", "cm")
    assert result.code == 0 and "warning: the passing report was not stored as the next baseline" in result.err
