"""A `--model` the endpoint does not serve is a usage error (exit 2) said before any question is asked, not an
endpoint failure (exit 4) after every question got the server's 404."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_pd.deploy.evals import Dataset
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

Serve = Callable[[ServerScript], Gsm8kTestServer]


def _server(dataset: Dataset, serve: Serve) -> Gsm8kTestServer:
    return serve(ServerScript(answers=scripted_answers(dataset.problems, correct=lambda p: True)))


def test_a_model_the_endpoint_does_not_serve_is_a_usage_error(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = _server(dataset, serve)
    result = eval_cli(server.base_url, "--num-questions", "5", "--model", "smollm2")
    assert result.code == 2, result.err
    assert result.err.startswith(
        f"error: --model 'smollm2' is not served at {server.base_url}: {server.base_url}/models lists 'gsm8k-test'. "
        "Pass one of them with --model, or leave --model out to use the first."
    ), result.err
    assert server.bodies == [] and not server.attempts, "no question was asked"


def test_the_model_the_endpoint_serves_runs(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    # The control: the same run with the served name finishes and passes.
    server = _server(dataset, serve)
    result = eval_cli(server.base_url, "--num-questions", "5", "--model", "gsm8k-test")
    assert result.code == 0, result.err
    assert result.report["metrics"]["accuracy"] == 1.0
