"""The gate's client key: every gate pod the chart renders (the hook Job, the `helm test` pod, the Argo
AnalysisTemplate, the canary CronJob) reads one key of its own, never the router's list of every
client's keys, and the chart refuses values that would hand it that list."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import helm_python

ROUTER_KEYS = {"router": {"apiKeySecret": {"name": "client-keys", "key": "api-keys"}}}
EVERY_GATE = {
    "gate": {"hook": {"enabled": True}, "helmTest": {"enabled": True}, "analysisTemplate": {"enabled": True},
             "canary": {"enabled": True}},
}  # fmt: skip


def _merged(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = {**out.get(key, {}), **value}
    return out


def _gate_containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each rendered gate container by its object's kind and name (those running `sglang-pd eval gsm8k`)."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("command", [])[:3] == ["sglang-pd", "eval", "gsm8k"]:
                found[where] = node
            for value in node.values():
                walk(value, where)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    for doc in docs:
        walk(doc, f"{doc['kind']} {doc['metadata']['name']}")
    return found


def _key_refs(container: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    ]


def test_every_gate_pod_reads_the_gates_own_key_and_not_the_routers_list(render) -> None:
    gates = _gate_containers(render(_merged(ROUTER_KEYS, EVERY_GATE)))
    kinds = {where.split()[0] for where in gates}
    assert kinds == {"Job", "Pod", "AnalysisTemplate", "CronJob"}, sorted(gates)
    for where, container in gates.items():
        assert _key_refs(container) == [("client-keys", "gate-api-key")], where
        env = {e["name"]: e for e in container["env"]}
        assert env["OPENAI_API_KEY"]["valueFrom"]["secretKeyRef"]["key"] != "api-keys", where


def test_a_secret_of_its_own_is_used_where_named(render) -> None:
    values = _merged(ROUTER_KEYS, EVERY_GATE, {"gate": {"apiKeySecret": {"name": "gate-key", "key": "key"}}})
    for where, container in _gate_containers(render(values)).items():
        assert _key_refs(container) == [("gate-key", "key")], where


def test_a_keyless_router_gives_the_gate_no_key(render) -> None:
    gates = _gate_containers(render(EVERY_GATE))
    assert gates and all(not _key_refs(c) for c in gates.values())


@pytest.mark.parametrize(
    "gate_key",
    [{"key": "api-keys"}, {"name": "client-keys", "key": "api-keys"}],
    ids=["same Secret by default", "same Secret named"],
)
def test_values_that_hand_the_gate_the_routers_list_are_refused(chart, gate_key: dict[str, str]) -> None:
    values = _merged(ROUTER_KEYS, EVERY_GATE, {"gate": {"apiKeySecret": gate_key}})
    with pytest.raises(helm_python.HelmError) as refused:
        chart.render(values, name="demo", namespace="llm")
    said = str(refused.value)
    assert "the router's whole list of client keys" in said and "gate-api-key" in said, said


def test_control_the_same_key_in_another_secret_is_accepted(render) -> None:
    values = _merged(ROUTER_KEYS, EVERY_GATE, {"gate": {"apiKeySecret": {"name": "gate-key", "key": "api-keys"}}})
    assert all(_key_refs(c) == [("gate-key", "api-keys")] for c in _gate_containers(render(values)).values())
