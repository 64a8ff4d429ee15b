"""Every PromQL query of the chart's Grafana dashboard names only metrics that exist: the router's
(from its registry), sglang 0.5.23's (from its collector source, `srt/observability/
metrics_collector.py` and `http_request_metrics.py`), or the gsm8k canary's (from its writer).
Quantiles are real (`histogram_quantile` over `_bucket` series, grouped by `le`); sglang's are
split by the `role` label the PodMonitor adds; the TTFT breakdown row is there."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import sglang

from sglang_pd.deploy.evals.textfile import render_metrics
from sglang_pd.deploy.router.metrics import TTFT_PARTS, RouterMetrics

from .conftest import one

SGLANG_SOURCES = ("srt/observability/metrics_collector.py", "srt/observability/http_request_metrics.py")
# PromQL words that are no metric: keywords and aggregation modifiers (functions are followed by "(").
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
             "offset", "inf", "nan"}  # fmt: skip
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def _series(name: str, kind: str) -> set[str]:
    """The series names a prometheus_client metric of `kind` named `name` exports."""
    if kind == "counter":
        base = name.removesuffix("_total")
        return {base + "_total", base + "_created"}
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count", name + "_created"}
    if kind == "summary":
        return {name, name + "_sum", name + "_count", name + "_created"}
    return {name}


def router_series() -> set[str]:
    out: set[str] = set()
    for family in RouterMetrics().registry.collect():
        out |= _series(family.name + ("_total" if family.type == "counter" else ""), family.type)
    return out


def sglang_series() -> set[str]:
    """From the source of sglang's collectors: each Counter/Gauge/Histogram/Summary/GaugeHistogram
    call with a literal `name=`."""
    root = Path(sglang.__file__).parent
    kinds = {"Counter": "counter", "Gauge": "gauge", "Histogram": "histogram", "Summary": "summary",
             "GaugeHistogram": "gauge"}  # fmt: skip
    out: set[str] = set()
    for rel in SGLANG_SOURCES:
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id not in kinds:
                continue
            for kw in node.keywords:
                if kw.arg == "name" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    out |= _series(kw.value.value, kinds[node.func.id])
    return out


def canary_series() -> set[str]:
    report = {
        "metrics": {"n": 1, "accuracy": 1, "error_rate": 0, "retry_rate": 0, "invalid_response_rate": 0,
                    "truncation_rate": 0},
        "gate": {"rules": [{"rule": "baseline_paired", "numbers": {"drop": 0, "drop_upper": 0, "max_drop": 0}}]},
    }  # fmt: skip
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", render_metrics(report, 0, {"r": "x"}), re.M))


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads. Strings, label matchers, range and offset
    durations and label lists (`by (...)`, `on(...)`, ...) are dropped first; what remains that is
    an identifier, not a keyword and not called like a function, is a metric name. Unbalanced
    brackets fail the test: the query does not parse."""
    depth = {"(": 0, "{": 0, "[": 0}
    closing = {")": "(", "}": "{", "]": "["}
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', "", expr):
        if ch in depth:
            depth[ch] += 1
        elif ch in closing:
            depth[closing[ch]] -= 1
            assert depth[closing[ch]] >= 0, f"unbalanced {ch!r} in {expr}"
    assert not any(depth.values()), f"unbalanced brackets in {expr}"
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\[\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end() :].lstrip()
        if word.lower() in _KEYWORDS or rest.startswith("(") or re.fullmatch(r"\d.*", word):
            continue
        if text[: m.start()].rstrip().endswith(("$", "{{")):  # a dashboard variable or legend
            continue
        names.add(word)
    return names


@pytest.fixture(scope="module")
def known() -> set[str]:
    return router_series() | sglang_series() | canary_series()


@pytest.fixture
def dashboard(render) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    docs = render({"metrics": {"grafanaDashboard": {"enabled": True}}})
    return dict(json.loads(one(docs, "ConfigMap", "-dashboard")["data"]["sglang-pd.json"]))


def exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_panel_reads_metrics_that_exist(dashboard: dict[str, Any], known: set[str]) -> None:
    assert len(sglang_series()) > 100 and "sglang:num_decode_prealloc_queue_reqs" in sglang_series()
    unknown = {(title, name) for title, expr in exprs(dashboard) for name in metric_names(expr) - known}
    assert not unknown, f"panels read metrics nothing exports: {sorted(unknown)}"
    # The check can fail: names from before (a histogram read as a gauge, the old TTFB) are unknown.
    assert metric_names('avg by (pod) (sglang:kv_transfer_speed_gb_s{a="b"})') - known
    assert metric_names("rate(sglang_pd_router_time_to_first_byte_seconds_bucket[5m])") - known
    assert metric_names("sum by (role) (rate(x_total[5m])) and on(pod) y") == {"x_total", "y"}


def test_quantiles_are_real_and_split_by_role(dashboard: dict[str, Any], render) -> None:  # type: ignore[no-untyped-def]
    quantiles = [(t, e) for t, e in exprs(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) >= 15
    for title, expr in quantiles:
        assert re.search(r"sum by \(le\b", expr) and "_bucket{" in expr, (title, expr)
    sglang_quantiles = [e for _, e in quantiles if "sglang:" in e]
    assert sglang_quantiles and all("role" in e.split("(rate(")[0] for e in sglang_quantiles)
    monitor = one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"], "targetLabel": "role",
            "action": "replace"} in endpoint["relabelings"]  # fmt: skip


def test_ttft_breakdown_and_pd_queues_are_shown(dashboard: dict[str, Any]) -> None:
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert "TTFT breakdown" in rows
    text = " ".join(e for _, e in exprs(dashboard))
    assert "sglang_pd_router_time_to_first_token_part_seconds" in text and len(TTFT_PARTS) == 6
    pd = ("num_decode_prealloc_queue_reqs", "num_decode_transfer_queue_reqs", "num_prefill_bootstrap_queue_reqs",
          "kv_transfer_bootstrap_ms_bucket", "kv_transfer_alloc_ms_bucket",
          "per_stage_req_latency_seconds")  # fmt: skip
    for name in pd:
        assert "sglang:" + name in text, name
