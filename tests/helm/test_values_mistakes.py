"""Values mistakes the chart names: a value of the wrong type in a topology given as a file is a type error at the
value's path (the words agree with what pydantic refuses, which `sglang-pd launch` would hit), `preset` with
`topology` is refused, and an Ingress in front of a router without client keys gets a warning in NOTES."""

from __future__ import annotations

import copy
from typing import Any

import pydantic
import pytest
import yaml

from scripts.sync_chart import DEFAULT_PRESET
from sglang_pd.deploy.spec.topology import Topology

from .conftest import helm_python, one, preset_topology

LOCAL = {"rdma": {"mode": "none"}}

# (path in the topology, value): each a type pydantic refuses, so the chart must refuse it too.
WRONG = [
    (("decode", "tp"), "sixteen"),
    (("prefill", "port"), 30000.5),
    (("prefill", "nodes"), [1]),
    (("model", "page_size"), {"x": 1}),
    (("model", "trust_remote_code"), "maybe"),
    (("model", "served_name"), 7),
    (("hardware", "gpu_memory_gib"), "lots"),
    (("hardware", "rdma_devices"), "mlx5_0"),
    (("prefill", "env"), ["A=1"]),
    (("router", "port"), None),
]
# Values of another YAML type that pydantic's lax mode accepts: the chart must accept them as well.
ACCEPTED = [
    (("decode", "tp"), "1"),
    (("decode", "tp"), 1.0),
    (("model", "trust_remote_code"), "yes"),
    (("hardware", "gpu_memory_gib"), "1.5"),
    (("model", "context_length"), None),
]


def _with(path: tuple[str, str], value: Any) -> dict[str, Any]:
    t = copy.deepcopy(preset_topology("local-cpu"))
    t[path[0]][path[1]] = value
    return t


def _pydantic_refuses(t: dict[str, Any], path: tuple[str, str]) -> bool:
    try:
        Topology.model_validate(t)
    except pydantic.ValidationError as exc:
        return any(tuple(str(p) for p in e["loc"][:2]) == path for e in exc.errors())
    return False


def _render_error(chart, values: dict[str, Any]) -> str | None:
    try:
        chart.render(values, name="demo", namespace="llm")
    except helm_python.HelmError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("path", "value"), WRONG, ids=[".".join(p) for p, _ in WRONG])
def test_a_wrong_type_in_a_topology_file_is_a_type_error_at_its_path(chart, path, value) -> None:
    t = _with(path, value)
    assert _pydantic_refuses(t, path), "the case must be one that sglang-pd launch refuses"
    said = _render_error(chart, {"topology": yaml.safe_dump(t), **LOCAL})
    assert said is not None
    line = next((x for x in said.splitlines() if x.startswith(f"topology.{'.'.join(path)}: ")), said)
    assert line.startswith(f"topology.{'.'.join(path)}: must be "), said
    assert "sglang-pd plan FILE" in line
    # The one problem is named, not what a template would have made of the bad value.
    assert "GPUs per group do not fill" not in said and said.count("\ntopology.") == 1, said


def test_the_type_error_names_the_types_and_the_value(chart) -> None:
    said = _render_error(chart, {"topology": yaml.safe_dump(_with(("decode", "tp"), "sixteen")), **LOCAL})
    assert 'topology.decode.tp: must be an integer, not a string ("sixteen")' in str(said)
    said = _render_error(chart, {"topology": yaml.safe_dump(_with(("model", "context_length"), "long")), **LOCAL})
    assert 'topology.model.context_length: must be an integer or null, not a string ("long")' in str(said)


@pytest.mark.parametrize(("path", "value"), ACCEPTED, ids=[f"{'.'.join(p)}={v!r}" for p, v in ACCEPTED])
def test_a_value_pydantic_accepts_renders(chart, path, value) -> None:
    t = _with(path, value)
    Topology.model_validate(t)
    assert _render_error(chart, {"topology": yaml.safe_dump(t), **LOCAL}) is None


def test_a_wrong_type_in_a_topology_given_as_values_is_named_by_the_schema(chart) -> None:
    said = _render_error(chart, {"topology": _with(("decode", "tp"), "sixteen"), **LOCAL})
    assert "at '/topology/decode/tp': got string, want integer" in str(said)


@pytest.mark.parametrize("given", ["file", "values"])
def test_preset_and_topology_together_are_refused(chart, given: str) -> None:
    t = preset_topology("local-cpu")
    topology: Any = yaml.safe_dump(t) if given == "file" else t
    said = _render_error(chart, {"preset": "local-cpu-mla", "topology": topology, **LOCAL})
    assert said is not None
    assert 'preset and topology: both are set (preset "local-cpu-mla", and a topology of your own)' in said
    assert "Unset preset (--set preset=) to run your topology, or drop topology to run the preset." in said
    # Controls: either one alone renders.
    assert _render_error(chart, {"topology": topology, **LOCAL}) is None
    assert _render_error(chart, {"preset": "local-cpu-mla", **LOCAL}) is None


def test_neither_preset_nor_topology_runs_the_default_preset(render) -> None:
    shipped = yaml.safe_load(one(render({}), "ConfigMap", "-topology")["data"]["topology.yaml"])
    assert shipped["name"] == DEFAULT_PRESET == preset_topology(DEFAULT_PRESET)["name"]


INGRESS = {"router": {"ingress": {"enabled": True, "host": "llm.example.com"}}}
KEYLESS_WARNING = "Warning: the Ingress exposes the router at llm.example.com with no client key"


def _notes(chart, values: dict[str, Any]) -> str:
    return str(chart.render(values, name="demo", namespace="llm")["sglang-pd/templates/NOTES.txt"])


def test_an_ingress_in_front_of_a_keyless_router_is_warned_about(chart) -> None:
    notes = _notes(chart, INGRESS)
    assert KEYLESS_WARNING in notes and "set router.apiKeySecret.name" in notes
    # Controls: with client keys, or without an Ingress, no warning.
    keyed = copy.deepcopy(INGRESS)
    keyed["router"]["apiKeySecret"] = {"name": "client-keys"}
    assert KEYLESS_WARNING not in _notes(chart, keyed)
    assert "Ingress" not in _notes(chart, {})


def test_the_local_notes_promise_what_the_local_model_can_do(chart) -> None:
    local = _notes(chart, {"preset": "local-cpu", **LOCAL})
    assert "Gate the rollout on gsm8k accuracy" not in local
    smoke = 'docs/gsm8k-gate.md ("A smoke on the local\nstack") gives a run the local model passes'
    assert "no gsm8k model" in local and smoke in local
    # Control: a GPU preset's NOTES promise the floor.
    assert "Gate the rollout on gsm8k accuracy (floor 0.9)" in _notes(chart, {})
