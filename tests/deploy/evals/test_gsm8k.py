"""`sglang-pd eval gsm8k` end to end against a scripted OpenAI-compatible server over real HTTP."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals import Dataset
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

Serve = Callable[[ServerScript], Gsm8kTestServer]
N = 200  # questions 5..204 (after the 5 shots)


def _script(dataset: Dataset, correct: Callable[[int], bool], **kwargs: Any) -> ServerScript:
    answers = scripted_answers(
        dataset.problems,
        correct=lambda p: correct(p.index),
        invalid=kwargs.pop("invalid", lambda p: False),
    )
    return ServerScript(answers=answers, **kwargs)


def _asked(dataset: Dataset, n: int = N) -> range:
    return range(5, 5 + n)


def test_accuracy_equals_the_known_fraction(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    def correct(i: int) -> bool:
        return i % 7 != 0 and i % 3 != 1

    server = serve(_script(dataset, correct, invalid=lambda p: p.index % 11 == 0))
    invalid_ids = {i for i in _asked(dataset) if i % 11 == 0}
    right = {i for i in _asked(dataset) if correct(i)} - invalid_ids
    result = eval_cli(server.base_url, "--num-questions", str(N))
    assert result.code == 0, result.err
    m = result.report["metrics"]
    assert Fraction(m["correct"], m["n"]) == Fraction(len(right), N)
    assert m["accuracy"] == len(right) / N and m["invalid"] == len(invalid_ids) and m["errors"] == 0
    records = result.report["records"]
    assert [r["id"] for r in records] == list(_asked(dataset))
    assert {r["id"] for r in records if r["correct"]} == right
    assert all(r["extracted"] is None for r in records if r["invalid"])
    assert all(r["extracted"] == r["label"] for r in records if r["correct"])
    # What was sent: the few-shot prompt, temperature 0, SGLang's stops, the listed model.
    body = server.bodies[0]
    assert body["temperature"] == 0 and body["stop"] == ["Question", "Assistant:", "<|separator|>"]
    assert body["model"] == "gsm8k-test" and body["prompt"].count("Question: ") == 6
    assert f"{len(right) / N:.4f}" in result.out and "accuracy" in result.out


def test_report_fields(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: True))
    r = eval_cli(server.base_url, "--num-questions", "20", "--min-accuracy", "0.9").report
    assert r["schema"] == "sglang-pd/eval-gsm8k/v2" and r["status"] == "pass" and r["error"] is None
    assert r["tool"]["name"] == "sglang-pd" and r["tool"]["version"] not in ("", "unknown")
    assert r["endpoint"] == server.base_url and r["model"] == "gsm8k-test" and r["api"] == "completions"
    assert r["time"]["started"].endswith("+00:00")
    assert r["config"]["data_canonical"] and r["config"]["num_shots"] == 5 and r["config"]["num_questions"] == 20
    m = r["metrics"]
    assert m["accuracy"] == 1.0 and m["n"] == 20 and m["output_tokens"] > 0 and m["output_tokens_per_s"] > 0
    assert 0 < m["latency_s"]["p50"] <= m["latency_s"]["p90"] <= m["latency_s"]["p99"] <= m["latency_s"]["max"]
    assert r["gate"]["passed"] and r["gate"]["rules"][0]["rule"] == "min_accuracy"
    assert set(r["records"][0]) >= {"id", "label", "output", "extracted", "correct", "invalid", "error", "retries"}
    assert set(r["records"][0]) >= {"strict_correct", "explicit_correct", "first_attempt_failed", "truncated"}
    assert m["scores"] == {"run_eval": 1.0, "lm_eval_strict": 1.0, "last_explicit": 1.0}
    assert r["warnings"] == [] and m["retry_rate"] == m["invalid_response_rate"] == m["truncation_rate"] == 0


def test_chat_api(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: i % 2 == 0, model="mine"))  # --model must be one it serves
    result = eval_cli(server.base_url, "--api", "chat", "--num-questions", "10", "--model", "mine")
    assert result.code == 0 and result.report["metrics"]["correct"] == 5
    body = server.bodies[0]
    assert body["model"] == "mine" and "stop" not in body and body["messages"][0]["role"] == "user"


def test_sample_is_reproducible(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: True))
    a = eval_cli(server.base_url, "--num-questions", "15", "--sample", "--seed", "3").report
    b = eval_cli(server.base_url, "--num-questions", "15", "--sample", "--seed", "3").report
    ids = [r["id"] for r in a["records"]]
    assert ids == [r["id"] for r in b["records"]] and ids != list(range(5, 20)) and min(ids) >= 5
    assert a["config"]["questions_fingerprint"] == b["config"]["questions_fingerprint"]


@pytest.mark.parametrize(("floor", "code"), [("0.75", 0), ("0.76", 1)])
def test_floor_through_the_cli(dataset: Dataset, serve: Serve, eval_cli: Any, floor: str, code: int) -> None:
    server = serve(_script(dataset, lambda i: i % 4 != 0))  # 5..104: 75 of 100 right
    result = eval_cli(server.base_url, "--num-questions", "100", "--min-accuracy", floor)
    assert result.code == code
    assert result.report["metrics"]["accuracy"] == 0.75
    if code:
        assert f"gate failed (min_accuracy): accuracy 0.7500 (75/100) is below the floor --min-accuracy {floor}" in (
            result.err
        )
        assert result.report["status"] == "gate_failed" and "is below the floor" in result.report["error"]
        assert result.report["gate"]["rules"][0]["numbers"]["min_accuracy"] == float(floor)
    else:
        assert result.report["status"] == "pass"


def test_transient_errors_are_retried_and_counted(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    flaky = {dataset.problems[i].question: 2 for i in range(5, 15)}  # ten questions: 503, 503, then the answer
    server = serve(_script(dataset, lambda i: True, flaky=flaky))
    result = eval_cli(server.base_url, "--num-questions", "30", "--max-retry-rate", "0.5")
    assert result.code == 0, result.err
    m = result.report["metrics"]
    assert m["retries"] == 20 and m["errors"] == 0 and m["accuracy"] == 1.0
    assert m["first_attempt_failures"] == 10 and m["retry_rate"] == pytest.approx(1 / 3)
    assert [r["retries"] for r in result.report["records"][:11]] == [2] * 10 + [0]
    assert "0 / 20" in result.out


def test_failed_questions_count_as_errors_and_wrong(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    broken = frozenset(dataset.problems[i].question for i in (5, 6))
    server = serve(_script(dataset, lambda i: True, broken=broken))
    result = eval_cli(server.base_url, "--num-questions", "40", "--retries", "1", "--max-retry-rate", "0.05")
    assert result.code == 0, result.err  # 2 of 40 = 5 %: within the default --max-error-rate 0.05
    m = result.report["metrics"]
    assert (m["errors"], m["retries"], m["correct"], m["n"]) == (2, 2, 38, 40)
    record = result.report["records"][0]
    assert (
        record["error"].startswith("HTTP 500 from http://127.0.0.1:") and "gave up after 1 retries" in record["error"]
    )
    assert server.attempts[dataset.problems[5].question] == 2


def test_too_many_errors_exits_4_with_a_report(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    broken = frozenset(p.question for p in dataset.problems)
    server = serve(_script(dataset, lambda i: True, broken=broken))
    result = eval_cli(server.base_url, "--num-questions", "100", "--retries", "0", "--parallel", "4")
    assert result.code == 4
    assert "questions failed after retries, more than --max-error-rate 0.05 allows (5)" in result.err
    assert "allows (5); first error: HTTP 500 from http://127.0.0.1:" in result.err  # not an unanswered question
    assert result.report["status"] == "error" and result.report["stopped_early"] == "errors"
    # The run stopped as soon as the gate could no longer pass, not after all 100 questions.
    assert len(server.bodies) < 20
    assert result.report["metrics"]["errors"] == 100


def test_unreachable_endpoint_exits_4(eval_cli: Any, closed_port: int) -> None:
    result = eval_cli(f"http://127.0.0.1:{closed_port}/v1", "--retries", "1", report=True)
    assert result.code == 4 and result.report is None
    assert f"error: Cannot reach http://127.0.0.1:{closed_port}/v1/models (ClientConnectorError" in result.err
    assert "Check --base-url" in result.err and "--wait-ready SECONDS waits longer" in result.err


def test_waits_for_a_router_to_list_its_model(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: True, empty_model_lists=2))
    assert eval_cli(server.base_url, "--num-questions", "3").code == 0
    assert server.model_lists == 3
    never = serve(_script(dataset, lambda i: True, empty_model_lists=10**6))
    result = eval_cli(never.base_url, "--num-questions", "3", "--retries", "1", "--wait-ready", "0.3")
    assert result.code == 4 and "lists no model yet" in result.err and "--wait-ready SECONDS" in result.err
    assert never.model_lists >= 3  # kept asking for the whole --wait-ready, not just the retries


def test_base_url_without_v1_says_so(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: True))
    result = eval_cli(server.base_url.removesuffix("/v1"), "--retries", "0")
    assert result.code == 4 and "HTTP 404" in result.err and "ending in /v1" in result.err


def test_run_timeout_exits_4(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    # Every answer needs 1000 retries of ~10 ms: the 0.5 s limit ends the run first.
    flaky = {p.question: 1000 for p in dataset.problems}
    server = serve(_script(dataset, lambda i: True, flaky=flaky))
    result = eval_cli(server.base_url, "--num-questions", "5", "--retries", "1000", "--timeout", "0.5")
    assert result.code == 4 and "did not finish within --timeout 0.5 s" in result.err
    assert result.report["stopped_early"] == "timeout"
    assert all("not answered within --timeout 0.5 s" in r["error"] for r in result.report["records"])


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--num-questions", "5000"], 2, "is more than the 1314 questions after the 5 shots"),
        (["--baseline", "/nonexistent/old.json"], 2, "Cannot read the --baseline report"),
        (["--parallel", "0"], 2, "--parallel must be at least 1"),
        (["--data", "/nonexistent/test.jsonl"], 3, "Cannot read the gsm8k data file"),
    ],
)
def test_usage_and_data_errors(
    dataset: Dataset, serve: Serve, eval_cli: Any, flags: list[str], code: int, message: str
) -> None:
    server = serve(_script(dataset, lambda i: True))
    result = eval_cli(server.base_url, *flags)
    assert result.code == code and message in result.err


def test_no_threads_left_behind(dataset: Dataset, eval_cli: Any) -> None:
    before = set(threading.enumerate())
    with Gsm8kTestServer(_script(dataset, lambda i: True)) as server:
        assert eval_cli(server.base_url, "--num-questions", "5").code == 0
    assert set(threading.enumerate()) <= before


def test_sigterm_ends_the_run_with_a_report(dataset: Dataset, serve: Serve, gsm8k_path: Path, tmp_path: Path) -> None:
    # No answer ever comes (endless 503s): only SIGTERM ends this run, as when a Job hits its deadline.
    server = serve(_script(dataset, lambda i: True, flaky={p.question: 10**6 for p in dataset.problems}))
    report_path = tmp_path / "report.json"
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "eval", "gsm8k", "--base-url", server.base_url]
    argv += ["--data", str(gsm8k_path), "--num-questions", "5", "--retries", "1000000", "--retry-backoff", "0.01"]
    proc = subprocess.Popen([*argv, "--quiet", "--output", str(report_path)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while sum(server.attempts.values()) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 4 and "interrupted by SIGTERM" in err
    report = json.loads(report_path.read_text())
    assert report["status"] == "error" and report["stopped_early"] == "interrupted"
    assert report["metrics"]["errors"] == 5
    # The retries of the cancelled requests are counted too (the server saw them all).
    assert report["metrics"]["retries"] >= 10


def test_api_key(dataset: Dataset, serve: Serve, eval_cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve(_script(dataset, lambda i: True, api_key="s3cret"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    denied = eval_cli(server.base_url, "--num-questions", "3")
    assert denied.code == 4 and "HTTP 401" in denied.err and "--api-key or OPENAI_API_KEY" in denied.err
    assert eval_cli(server.base_url, "--num-questions", "3", "--api-key", "s3cret").code == 0
    monkeypatch.setenv("OPENAI_API_KEY", "s3cret")
    assert eval_cli(server.base_url, "--num-questions", "3").code == 0
