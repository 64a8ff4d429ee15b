"""Fuzz the router from its own `/openapi.json`: every case must get a non-5xx answer, and every
4xx must be an OpenAI-shaped error.

Cases are drawn with hypothesis from the request schemas the router publishes: bodies valid by the
schema, the same with one field swapped for arbitrary JSON or an extreme number (1e-300, 5e-324,
2**70, ...), arbitrary JSON, and raw bytes (broken and deeply nested JSON). The router runs on
loopback in front of protocol-faithful in-process test workers (tests/support), so a 5xx can only
come from the router itself. On the first 5xx hypothesis shrinks the case and the script prints it
and exits 1.

    .venv/bin/python -m scripts.fuzz_router --cases 2000    # from the repository root
    .venv/bin/python -m scripts.fuzz_router --url http://127.0.0.1:8000 --api-key KEY   # a running router
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

__all__ = ["FuzzReport", "fuzz", "main"]

_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1e-300, 5e-324, -0.0, 1e308, 2**63, 0.5]),
    st.text(max_size=16),
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
_EXTREME = st.sampled_from([0, -1, 1e-300, 5e-324, -0.0, 1e-50, 1e308, 2**63, -(2**63), 2.000001, 0.999999999])


def _dumps(value: Any) -> bytes:
    # The standard library's encoder: orjson refuses integers beyond 64 bits, and those are cases too.
    return json.dumps(value).encode()


def _deep(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"


_RAW = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 3000).map(_deep),
    st.sampled_from([b"", b"{", b"[]", b"null", b'{"messages": NaN}', b'{"prompt": 1e999}', b'"\\ud800"']),
)


class SchemaStrategies:
    """Hypothesis strategies for the JSON schemas of an OpenAPI document (the subset it uses)."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.components: dict[str, Any] = document.get("components", {}).get("schemas", {})

    def of(self, schema: dict[str, Any]) -> st.SearchStrategy[Any]:
        if "$ref" in schema:
            return self.of(self.components[schema["$ref"].rsplit("/", 1)[-1]])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        if "oneOf" in schema:
            return st.one_of([self.of(s) for s in schema["oneOf"]])
        kind = schema.get("type", "object")
        if isinstance(kind, list):
            return st.one_of([self.of({**schema, "type": k}) for k in kind])
        if kind == "object":
            props = schema.get("properties", {})
            required = set(schema.get("required", ()))
            return st.fixed_dictionaries(
                {k: self.of(v) for k, v in props.items() if k in required},
                optional={k: self.of(v) for k, v in props.items() if k not in required},
            )
        if kind == "array":
            low = schema.get("minItems", 0)
            return st.lists(
                self.of(schema.get("items", {})), min_size=low, max_size=max(low, schema.get("maxItems", 4))
            )
        if kind == "integer":
            # Generated token counts stay small: the fuzz is about the router, not long answers.
            return st.integers(schema.get("minimum"), schema.get("maximum", 64))
        if kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum"))
            return st.floats(
                low,
                schema.get("maximum"),
                exclude_min="exclusiveMinimum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "string":
            return st.text(max_size=24)
        if kind == "boolean":
            return st.booleans()
        return st.none()


def _swap_one(body: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid body with one field (existing or new) set to arbitrary JSON or an extreme number."""

    @st.composite
    def swapped(draw: st.DrawFn) -> dict[str, Any]:
        value = dict(draw(body))
        keys = [*value, "temperature", "top_p", "max_tokens", "n", "top_logprobs", "logprobs", "messages", "prompt"]
        key = draw(st.sampled_from(keys))
        value[key] = draw(st.one_of(_JSON, _EXTREME))
        return value

    return swapped()


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)

    def line(self) -> str:
        by_status = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items()))
        return f"{self.cases} cases; statuses {by_status}"


def fuzz(base_url: str, *, cases: int, api_key: str = "", seed: int = 0) -> FuzzReport:
    """Run `cases` cases against the router at `base_url`; raises AssertionError on a 5xx."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    report = FuzzReport()
    with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
        document = client.get("/openapi.json").raise_for_status().json()
        schemas = SchemaStrategies(document)
        operations = []
        for path, item in document["paths"].items():
            post = item.get("post")
            if post is not None:
                body = schemas.of(post["requestBody"]["content"]["application/json"]["schema"])
                operations.append((path, body))
        case = st.one_of(
            [
                st.tuples(st.just(path), st.one_of(body, body, _swap_one(body), _JSON).map(_dumps) | _RAW)
                for path, body in operations
            ]
        )

        @settings(
            max_examples=cases,
            deadline=None,
            database=None,
            derandomize=seed == 0,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        @given(case=case)
        def one(case: tuple[str, bytes]) -> None:
            path, content = case
            resp = client.post(path, content=content, headers={"content-type": "application/json"})
            report.cases += 1
            report.statuses[resp.status_code] += 1
            assert resp.status_code < 500, f"POST {path} {content[:300]!r} -> {resp.status_code} {resp.text[:300]}"
            if resp.status_code >= 400:
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, resp.text

        (one if seed == 0 else hypothesis_seed(seed)(one))()
    return report


@contextlib.contextmanager
def _local_router() -> Iterator[str]:
    """A router on loopback in front of in-process test workers (1 prefill, 2 decode)."""
    from tests.deploy.router.conftest import in_process

    cluster = in_process(1, 2)
    with cluster.serve(cluster.config(max_body_bytes=1 << 20)) as running:
        yield running.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--url", default=None, help="fuzz this router instead of a local one")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--seed", type=int, default=0, help="0: the same cases every run")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(_local_router())
        try:
            report = fuzz(url, cases=args.cases, api_key=args.api_key, seed=args.seed)
        except AssertionError as exc:
            print(f"FAIL: {exc}", file=sys.stderr)
            return 1
    print(f"ok: {report.line()}; 0 router 5xx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
