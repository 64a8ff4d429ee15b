"""Render the chart with the real Helm SDK (helm-python-sdk embeds Helm v4) and parse what it renders."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (the `dev` extra)")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "sglang-pd"
PRESETS = REPO / "deploy" / "spec" / "presets"


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that rejects duplicate keys (the API server's strict decoding does too)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        if dupes:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {sorted(dupes)}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


def parse_manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.load_all(text, Loader=_UniqueKeyLoader) if d]
    return docs


def preset_topology(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((PRESETS / f"{name}.yaml").read_text()))


def preset_values(name: str) -> dict[str, Any]:
    """Chart values that select a shipped preset (and no RDMA for the TCP one)."""
    values: dict[str, Any] = {"preset": name}
    if preset_topology(name)["transfer"]["protocol"] == "tcp":
        values["rdma"] = {"mode": "none"}
    return values


def own_topology_values(t: dict[str, Any]) -> dict[str, Any]:
    """Chart values that run `t` as your own topology (no preset: the chart refuses both), TCP ones without RDMA."""
    values: dict[str, Any] = {"topology": t}
    if t["transfer"]["protocol"] == "tcp":
        values["rdma"] = {"mode": "none"}
    return values


@pytest.fixture(scope="session")
def chart():
    c = helm_python.Chart.load(str(CHART))
    yield c
    c.close()


@pytest.fixture
def render(chart) -> Callable[..., list[dict[str, Any]]]:
    def do(values: dict[str, Any] | None = None, name: str = "demo", namespace: str = "llm") -> list[dict[str, Any]]:
        return parse_manifests(chart.render(copy.deepcopy(values or {}), name=name, namespace=namespace))

    return do


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]
