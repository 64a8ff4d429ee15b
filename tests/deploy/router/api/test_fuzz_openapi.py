"""The router publishes its OpenAI routes at /openapi.json, and a CI-sized schema-driven fuzz run
against it (scripts/fuzz_router.py; the script's default is 2000 cases) gets no 5xx."""

from __future__ import annotations

import httpx

from scripts.fuzz_router import fuzz

from ..conftest import RunningRouter


def test_openapi_describes_the_openai_routes(router_1p1d: RunningRouter) -> None:
    document = httpx.get(router_1p1d.url + "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(document["paths"])
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["temperature"] == {"type": "number", "minimum": 0, "maximum": 2}
    assert chat["top_logprobs"]["maximum"] == 20


def test_schema_fuzz_gets_no_5xx(router_1p1d: RunningRouter) -> None:
    report = fuzz(router_1p1d.url, cases=300)
    assert report.cases >= 300
    assert all(status < 500 for status in report.statuses)
    assert report.statuses[200] > 30, report.line()  # valid cases do get served
