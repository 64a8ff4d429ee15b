"""The chart's revision label (`sglang-pd.revision`) equals deploy/spec/revision.py's, and a GPU pod template
changes only when what the engines run changes: a router-only change leaves both LeaderWorkerSets byte for
byte as they were, a decode flag changes them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.common.contract import SGLANG_VERSION
from sglang_pd.deploy.spec.revision import REVISION_LABEL, canonical_json, revision, revision_document

from .conftest import CHART, by_kind, own_topology_values, parse_manifests, preset_topology, preset_values

IMAGE = {"repository": "registry.example/sglang-pd", "tag": "0.2.0-sglang0.5.23"}
LWS_FILES = ("sglang-pd/templates/prefill/leaderworkerset.yaml", "sglang-pd/templates/decode/leaderworkerset.yaml")


def _labels(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Every revision label of each LeaderWorkerSet's pod templates, by LWS name."""
    found: dict[str, set[str]] = {}
    for lws in by_kind(docs, "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]
        pods = [template[k] for k in ("leaderTemplate", "workerTemplate") if k in template]
        found[lws["metadata"]["name"]] = {p["metadata"]["labels"][REVISION_LABEL] for p in pods}
    return found


def _only_label(docs: list[dict[str, Any]]) -> str:
    labels = set().union(*_labels(docs).values())
    assert len(labels) == 1, labels  # one revision on every pod of both roles
    return labels.pop()


def _topology() -> dict[str, Any]:
    """The H200 preset with values that exercise the encoding: floats, integer map keys, characters
    Go's JSON escapes, a non-ASCII one."""
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["decode"]["mem_fraction_static"] = 0.85
    t["decode"]["env"] = {"SGLANG_NOTE": "a<b&c>d é"}
    t["hardware"]["gpu_memory_gib"] = 141.0
    return t


def test_chart_label_is_the_python_revision(render):
    t = _topology()
    values = {"topology": t, "image": IMAGE, "prefill": {"env": {"EXTRA": "1"}}, "env": {"SHARED": "x"}}
    devices = t["hardware"]["rdma_devices"]
    fabric = {"NCCL_IB_HCA": "=" + ",".join(devices), "NVSHMEM_HCA_LIST": ",".join(devices)}  # preset infiniband
    env = {"prefill": {**fabric, "SHARED": "x", "EXTRA": "1"}, "decode": {**fabric, "SHARED": "x"}}
    image = f"{IMAGE['repository']}:{IMAGE['tag']}"
    expected = revision(revision_document(t, image=image, sglang_version=SGLANG_VERSION, env=env))
    assert _only_label(render(values)) == expected
    # Control: each input moves the label, so the equality above is not two constants agreeing.
    assert revision(revision_document(t, image=image + "x", env=env)) != expected
    assert revision(revision_document(t, image=image, env={**env, "decode": {}})) != expected
    changed = copy.deepcopy(values)
    changed["env"] = {"SHARED": "y"}
    assert _only_label(render(changed)) != expected


def test_go_json_form():
    # Helm decodes numbers to float64 and map keys to strings; Go sorts keys as strings and escapes <, >, &.
    assert canonical_json({"b": 1.0, "a": {10: "x", 2: "y"}, "c": "<&>", "d": 0.85}) == (
        '{"a":{"10":"x","2":"y"},"b":1,"c":"\\u003c\\u0026\\u003e","d":0.85}'
    )


def test_model_config_file_moves_the_revision(render):
    t = preset_topology("local-cpu")
    base = {**preset_values("local-cpu"), "cpuImage": {"repository": "registry.example/cpu"}}
    config = '{"architectures": ["LlamaForCausalLM"]}'
    with_file = {**base, "model": {"configFile": config}}
    image = "registry.example/cpu:" + yaml.safe_load(_values_file().read_text())["referenceEngine"]["image"]["tag"]
    assert _only_label(render(base)) == revision(revision_document(t, image=image))
    assert _only_label(render(with_file)) == revision(revision_document(t, image=image, model_config=config))
    assert _only_label(render(with_file)) != _only_label(render(base))


def _values_file() -> Path:
    return CHART / "values.yaml"


def _lws_texts(chart: Any, values: dict[str, Any]) -> dict[str, str]:
    rendered = chart.render(copy.deepcopy(values), name="demo", namespace="llm")
    return {path: rendered[path] for path in LWS_FILES}


@pytest.mark.parametrize("preset", ["deepseek-r1-h200-1p1d", "local-cpu"])
def test_router_only_change_leaves_both_pod_templates_byte_identical(chart, preset):
    t = preset_topology(preset)
    base = {**own_topology_values(t), "cpuImage": {"repository": "registry.example/cpu"}}
    router_changed = copy.deepcopy(base)
    router_changed["topology"]["router"] = {
        **t.get("router", {}),
        "port": 8123,
        "prefill_policy": "round_robin",
        "max_concurrent_requests": 7,
    }
    router_changed["router"] = {"replicas": 5, "extraArgs": ["--stream-stall", "9"]}
    before, after = _lws_texts(chart, base), _lws_texts(chart, router_changed)
    assert before == after
    # The router did change: its Deployment differs, so the equality above is not an unchanged render.
    ours = chart.render(copy.deepcopy(base), name="demo", namespace="llm")
    theirs = chart.render(copy.deepcopy(router_changed), name="demo", namespace="llm")
    assert ours["sglang-pd/templates/router/deployment.yaml"] != theirs["sglang-pd/templates/router/deployment.yaml"]
    # Scaling changes replicas only, never the pod templates (no restart).
    scaled = copy.deepcopy(base)
    scaled["topology"]["decode"]["groups"] = t["decode"]["groups"] + 1
    docs_base = parse_manifests(chart.render(copy.deepcopy(base), name="demo", namespace="llm"))
    docs_scaled = parse_manifests(chart.render(copy.deepcopy(scaled), name="demo", namespace="llm"))
    templates = [
        [lws["spec"]["leaderWorkerTemplate"] for lws in by_kind(d, "LeaderWorkerSet")] for d in (docs_base, docs_scaled)
    ]
    assert templates[0] == templates[1]


@pytest.mark.parametrize("preset", ["deepseek-r1-h200-1p1d", "local-cpu"])
def test_decode_flag_changes_the_decode_template(chart, preset):
    t = preset_topology(preset)
    base = {**own_topology_values(t), "cpuImage": {"repository": "registry.example/cpu"}}
    flagged = copy.deepcopy(base)
    flagged["topology"]["decode"]["max_running_requests"] = int(t["decode"].get("max_running_requests") or 64) + 1
    before, after = _lws_texts(chart, base), _lws_texts(chart, flagged)
    decode = LWS_FILES[1]
    assert before[decode] != after[decode]
    # One revision for both roles: the prefills roll too, so that the new decodes have prefills to pair with.
    assert before[LWS_FILES[0]] != after[LWS_FILES[0]]
    old = _only_label(parse_manifests({decode: before[decode]}))
    new = _only_label(parse_manifests({decode: after[decode]}))
    assert old != new
