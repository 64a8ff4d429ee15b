"""Each way the gate used to mislead or crash, through the real CLI against a scripted server over HTTP:
the failing input, the exit code, the report and the message."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.evals import Dataset, load_baseline
from tests.support.gsm8k_server import Gsm8kTestServer, ServerScript, scripted_answers

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

Serve = Callable[[ServerScript], Gsm8kTestServer]
ALL = 1314  # questions after the 5 shots


def _script(dataset: Dataset, correct: Callable[[int], bool], **kwargs: Any) -> ServerScript:
    answers = scripted_answers(dataset.problems, correct=lambda p: correct(p.index))
    answers.update(kwargs.pop("outputs", {}))
    return ServerScript(answers=answers, **kwargs)


def _questions(dataset: Dataset, ids: Any) -> dict[str, int]:
    return {dataset.problems[i].question: 1 for i in ids}


def _stored(result: Any, tmp_path: Path, name: str = "baseline.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(result.report))
    return path


# --- 1. the baseline rule is paired non-inferiority ----------------------------------------------


def test_paired_rule_passes_the_same_model_and_fails_a_three_point_drop(
    dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path
) -> None:
    def good(i: int) -> bool:
        return i % 20 != 0  # 95 %

    base = eval_cli(serve(_script(dataset, good)).base_url)
    assert base.code == 0 and base.report["metrics"]["n"] == ALL  # all questions by default
    baseline = _stored(base, tmp_path)

    same = eval_cli(serve(_script(dataset, good)).base_url, "--baseline", str(baseline))
    assert same.code == 0, same.err
    rule = same.report["gate"]["rules"][0]
    assert rule["rule"] == "baseline_paired" and rule["passed"]
    assert rule["numbers"]["b10"] == rule["numbers"]["b01"] == 0 and rule["numbers"]["n"] == ALL
    assert "PASS: paired on 1314 questions" in same.out and "power at this n" in same.out

    def dropped(i: int) -> bool:
        return good(i) and i % 33 != 1  # about 3 points fewer

    worse = eval_cli(serve(_script(dataset, dropped)).base_url, "--baseline", str(baseline))
    assert worse.code == 1
    numbers = worse.report["gate"]["rules"][0]["numbers"]
    assert numbers["b01"] == 0 and numbers["b10"] == 37 and numbers["drop_upper"] > 0.02
    assert "gate failed (baseline_paired): paired on 1314 questions" in worse.err
    assert "not below --max-drop 0.02" in worse.err and worse.report["status"] == "gate_failed"


# --- 2. a broken or foreign baseline is refused (exit 2, with the reason) ------------------------


def test_an_errored_baseline_cannot_let_a_broken_model_pass(
    dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path
) -> None:
    broken = frozenset(p.question for p in dataset.problems)
    base = eval_cli(serve(_script(dataset, lambda i: True, broken=broken)).base_url, "--num-questions", "200")
    assert base.code == 4 and base.report["status"] == "error" and base.report["metrics"]["correct"] == 0
    baseline = _stored(base, tmp_path)

    one_right = eval_cli(
        serve(_script(dataset, lambda i: i == 5)).base_url, "--num-questions", "200", "--baseline", str(baseline)
    )
    assert one_right.code == 2 and one_right.report is None
    assert f"--baseline {baseline} cannot be used: its run did not pass (status 'error'" in one_right.err


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (["--api", "chat"], "another API ('completions'; this run: 'chat')"),
        (["--num-shots", "4"], "another shot count (5; this run: 4)"),
        (["--max-tokens", "256"], "another max_tokens (512; this run: 256)"),
        (["--num-questions", "40"], "20 of this run's 40 questions are not in it (ids 25, 26, 27, 28, 29, ..."),
    ],
)
def test_a_baseline_asked_another_way_is_refused(
    dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path, flags: list[str], reason: str
) -> None:
    server = serve(_script(dataset, lambda i: True))
    baseline = _stored(eval_cli(server.base_url, "--num-questions", "20"), tmp_path)
    result = eval_cli(server.base_url, "--num-questions", "20", *flags, "--baseline", str(baseline))
    assert result.code == 2 and reason in result.err


def test_another_data_file_is_refused(
    dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path, gsm8k_path: Path
) -> None:
    server = serve(_script(dataset, lambda i: True))
    baseline = _stored(eval_cli(server.base_url, "--num-questions", "20"), tmp_path)
    other = tmp_path / "test.jsonl"
    other.write_text(gsm8k_path.read_text() + "\n")  # one blank line more: another sha256
    result = eval_cli(server.base_url, "--num-questions", "20", "--data", str(other), "--baseline", str(baseline))
    assert result.code == 2 and "it was run with another data file" in result.err


def test_a_canary_sample_of_the_baseline_questions_is_paired(
    dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path
) -> None:
    server = serve(_script(dataset, lambda i: i % 20 != 0))
    baseline = _stored(eval_cli(server.base_url), tmp_path)
    canary = eval_cli(
        server.base_url, "--num-questions", "200", "--sample", "--seed", "9", "--max-drop", "0.06", "--baseline",
        str(baseline),
    )  # fmt: skip
    assert canary.code == 0, canary.err
    assert canary.report["gate"]["rules"][0]["numbers"]["n"] == 200


def test_a_missing_optional_baseline_is_a_first_release(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    server = serve(_script(dataset, lambda i: True))
    result = eval_cli(
        server.base_url, "--num-questions", "10", "--baseline", "/nonexistent/report.json", "--baseline-optional"
    )
    assert result.code == 0 and result.report["gate"] is None
    assert "warning: no baseline at /nonexistent/report.json yet: the paired rule was skipped" in result.err


# --- 3. never a crash: every problem becomes a recorded error, and a report is written -----------


def test_an_overlong_number_is_kept_exact_and_the_report_written(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    huge = " The total is " + "9" * 400 + ". dollars"
    server = serve(_script(dataset, lambda i: True, outputs={dataset.problems[5].question: huge}))
    result = eval_cli(server.base_url, "--num-questions", "200", "--min-accuracy", "0.99")
    assert result.code == 0, result.err
    record = result.report["records"][0]
    assert record["extracted"] == "9" * 400 + "." and record["correct"] is False and record["error"] is None
    assert result.report["metrics"]["correct"] == 199


def test_malformed_responses_are_retried_once_then_recorded(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    q = dataset.problems
    script = _script(
        dataset,
        lambda i: True,
        bad_gzip=frozenset({q[5].question}),
        number_text=frozenset({q[6].question}),
        malformed={q[7].question: 1},  # malformed once, then a good answer
    )
    server = serve(script)
    result = eval_cli(server.base_url, "--num-questions", "300")
    assert result.code == 0, result.err  # 3 of 300 = 1 %: at the default --max-invalid-rate 0.01, not above
    r5, r6, r7 = result.report["records"][:3]
    assert r5["error_kind"] == r6["error_kind"] == "invalid_response" and r5["invalid_responses"] == 2
    assert "does not decode" in r5["error"] and "the answer text is a int, not a string" in r6["error"]
    assert r7["error"] is None and r7["correct"] and r7["invalid_responses"] == 1
    assert server.attempts[q[5].question] == server.attempts[q[6].question] == 2
    m = result.report["metrics"]
    assert (m["invalid_responses"], m["errors"], m["correct"]) == (3, 2, 298)


def test_too_many_malformed_responses_exit_4(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    malformed = _questions(dataset, range(5, 15))
    result = eval_cli(serve(_script(dataset, lambda i: True, malformed=malformed)).base_url, "--num-questions", "100")
    assert result.code == 4 and result.report["status"] == "error"
    assert "10 of 100 questions got a malformed response" in result.err
    assert "0.1000 is above --max-invalid-rate 0.01" in result.err
    assert result.report["metrics"]["accuracy"] == 1.0  # answered on the retry: accuracy is not the problem


def test_a_failing_question_costs_one_record_not_the_run(
    dataset: Dataset, serve: Serve, eval_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_pd.deploy.evals import runner

    real = runner.score

    def score(item: Any, completion: Any) -> Any:
        if item.problem.index == 6:
            raise ZeroDivisionError("scripted bug")
        return real(item, completion)

    monkeypatch.setattr(runner, "score", score)
    result = eval_cli(serve(_script(dataset, lambda i: True)).base_url, "--num-questions", "50")
    assert result.code == 0
    record = result.report["records"][1]
    assert record["error_kind"] == "internal" and record["error"] == "internal error: ZeroDivisionError: scripted bug"


def test_an_unexpected_error_after_the_run_still_writes_the_records(
    dataset: Dataset, serve: Serve, eval_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_pd.deploy.evals import gsm8k

    def judge(*args: Any) -> Any:
        raise KeyError("scripted bug")

    monkeypatch.setattr(gsm8k, "_judge", judge)
    result = eval_cli(serve(_script(dataset, lambda i: True)).base_url, "--num-questions", "20")
    assert result.code == 4
    assert "internal error while judging the run: KeyError: 'scripted bug'" in result.err
    assert result.report["status"] == "error" and len(result.report["records"]) == 20


def test_an_unexpected_error_anywhere_is_exit_4_with_a_report(
    dataset: Dataset, serve: Serve, eval_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_pd.deploy.evals import cli

    async def evaluate(options: Any) -> Any:
        raise RuntimeError("scripted bug")

    monkeypatch.setattr(cli, "evaluate", evaluate)
    result = eval_cli(serve(_script(dataset, lambda i: True)).base_url)
    assert result.code == 4 and "error: internal error: RuntimeError: scripted bug" in result.err
    assert result.report["status"] == "error" and result.report["error"] == "internal error: RuntimeError: scripted bug"


# --- 4. infrastructure is kept apart from accuracy (exit 4, each with its own message) ----------


@pytest.mark.parametrize("how", ["flaky", "dropped"])
def test_ten_percent_failed_first_attempts_exit_4(dataset: Dataset, serve: Serve, eval_cli: Any, how: str) -> None:
    # 10 % of questions get a 503, or a closed connection, on their first attempt; all are answered on retry.
    script = _script(dataset, lambda i: True, **{how: _questions(dataset, range(5, 205, 10))})
    result = eval_cli(serve(script).base_url, "--num-questions", "200")
    assert result.code == 4
    m = result.report["metrics"]
    assert (m["accuracy"], m["errors"], m["first_attempt_failures"]) == (1.0, 0, 20)
    assert "20 of 200 questions failed on their first attempt" in result.err
    assert "0.1000 is above --max-retry-rate 0.05" in result.err


def test_truncated_answers_are_counted_and_exit_4(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    truncated = frozenset(p.question for p in dataset.problems[5:205:10])
    result = eval_cli(serve(_script(dataset, lambda i: True, truncated=truncated)).base_url, "--num-questions", "200")
    assert result.code == 4 and result.report["metrics"]["truncated"] == 20
    assert "20 of 200 answers were cut at --max-tokens 512 (finish_reason 'length'): 0.1000 is above" in result.err
    assert "--max-truncation-rate 0.05" in result.err
    assert result.report["records"][0]["truncated"] is True


# --- 5. three scores, and a warning when they disagree -------------------------------------------


def test_the_three_scores_and_their_disagreement(dataset: Dataset, serve: Serve, eval_cli: Any) -> None:
    outputs = {
        p.question: f" So that is it.\n#### {p.label} dollars (1,{p.label}00 cents)" for p in dataset.problems[5:25]
    }
    result = eval_cli(serve(_script(dataset, lambda i: True, outputs=outputs)).base_url, "--num-questions", "200")
    assert result.code == 0
    m = result.report["metrics"]
    assert m["scores"] == {"run_eval": 0.9, "lm_eval_strict": 1.0, "last_explicit": 1.0}
    assert m["disagreement"] == {
        "run_eval/lm_eval_strict": 0.1,
        "run_eval/last_explicit": 0.1,
        "lm_eval_strict/last_explicit": 0.0,
    }
    assert "warning: the scores run_eval (0.9000) and lm_eval_strict (1.0000) disagree on 10.0% of questions" in (
        result.err
    )
    assert len(result.report["warnings"]) == 2


# --- publishing: the Prometheus textfile and the baseline ConfigMap -------------------------------


def test_metrics_textfile_for_node_exporter(dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    server = serve(_script(dataset, lambda i: i % 20 != 0))
    baseline = _stored(eval_cli(server.base_url, "--num-questions", "200"), tmp_path)
    prom = tmp_path / "textfile" / "sglang_pd_gsm8k.prom"
    labels = ["--metrics-label", "release=r1", "--metrics-label", "release_namespace=llm"]
    result = eval_cli(
        server.base_url, "--num-questions", "200", "--baseline", str(baseline), "--max-drop", "0.06",
        "--metrics-textfile", str(prom), *labels,
    )  # fmt: skip
    assert result.code == 0
    samples = {s.name: s for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    assert samples["sglang_pd_gsm8k_gate_passed"].value == 1.0
    assert samples["sglang_pd_gsm8k_gate_passed"].labels == {"release": "r1", "release_namespace": "llm"}
    assert samples["sglang_pd_gsm8k_accuracy"].value == result.report["metrics"]["accuracy"]
    assert samples["sglang_pd_gsm8k_drop_upper_bound"].value == pytest.approx(
        result.report["gate"]["rules"][0]["numbers"]["drop_upper"]
    )
    assert [p.name for p in prom.parent.iterdir()] == ["sglang_pd_gsm8k.prom"]  # no temporary file left


def test_metrics_textfile_when_the_endpoint_is_down(eval_cli: Any, closed_port: int, tmp_path: Path) -> None:
    prom = tmp_path / "gate.prom"
    result = eval_cli(f"http://127.0.0.1:{closed_port}/v1", "--retries", "0", "--metrics-textfile", str(prom))
    assert result.code == 4
    text = prom.read_text()
    assert "sglang_pd_gsm8k_gate_passed 0.0" in text and "sglang_pd_gsm8k_gate_exit_code 4.0" in text
    assert "sglang_pd_gsm8k_accuracy" not in text


def test_bad_metrics_label_is_a_usage_error(eval_cli: Any, closed_port: int) -> None:
    result = eval_cli(f"http://127.0.0.1:{closed_port}/v1", "--metrics-label", "bad-name=x")
    assert result.code == 2 and "--metrics-label 'bad-name=x' is not KEY=VALUE" in result.err


def test_loaded_baseline_round_trip(dataset: Dataset, serve: Serve, eval_cli: Any, tmp_path: Path) -> None:
    result = eval_cli(serve(_script(dataset, lambda i: i % 3 != 0)).base_url, "--num-questions", "30")
    base = load_baseline(_stored(result, tmp_path))
    assert base.n == 30 and base.correct == result.report["metrics"]["correct"]


# --- 6. one connection pool sized to --parallel --------------------------------------------------


def test_one_pool_sized_to_parallel(dataset: Dataset, serve: Serve) -> None:
    import asyncio

    from sglang_pd.deploy.evals import ClientConfig, EndpointClient, build_items, run_items

    server = serve(_script(dataset, lambda i: True))
    items = build_items(dataset.problems, num_questions=100)

    async def main() -> tuple[int, int, float]:
        async with EndpointClient(ClientConfig(base_url=server.base_url, parallel=8)) as client:
            await client.resolve_model()
            run = await run_items(client, items, parallel=8, progress=False)
            connector = client.session.connector
            assert connector is not None
            return connector.limit, connector.limit_per_host, sum(r.correct for r in run.records) / len(items)

    limit, per_host, accuracy = asyncio.run(main())
    assert (limit, per_host, accuracy) == (8, 8, 1.0)
    assert 1 <= len(server.peers) <= 8  # every request went over at most --parallel connections
