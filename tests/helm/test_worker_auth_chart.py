"""The worker key in the chart: read from a Secret by the router and the GPU pods, handed to sglang
as `--api-key` only by `sglang-pd launch`, never written into a manifest; probes stay keyless."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sglang_pd.deploy.cli import main as cli_main
from sglang_pd.deploy.common.contract import ENV_ROUTER_WORKER_API_KEY, ENV_WORKER_API_KEY
from sglang_pd.deploy.ops.keyfile import CONFIG_FLAG, KEY_FILE_SHOWN
from sglang_pd.deploy.ops.launch import API_KEY_FLAG

from .conftest import helm_python, one, parse_manifests

SECRET = {"name": "pd-worker-key", "key": "token"}
# What the Secret holds in these tests; the chart is never given it, so it must appear nowhere.
KEY_VALUE = "wk-5f0c1e9a7d3b"
WORKER_KEY_REF = {"secretKeyRef": SECRET}


def _containers(docs: list[dict[str, Any]], kind: str, suffix: str) -> list[dict[str, Any]]:
    doc = one(docs, kind, suffix)
    if kind == "LeaderWorkerSet":
        tpl = doc["spec"]["leaderWorkerTemplate"]
        return [tpl[k]["spec"]["containers"][0] for k in ("leaderTemplate", "workerTemplate") if k in tpl]
    return doc["spec"]["template"]["spec"]["containers"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def test_router_and_every_gpu_pod_read_the_key_from_the_secret(render) -> None:
    docs = render({"workerKeySecret": SECRET})
    (router,) = _containers(docs, "Deployment", "-router")
    assert _env(router)[ENV_ROUTER_WORKER_API_KEY] == WORKER_KEY_REF
    assert ENV_WORKER_API_KEY not in _env(router)
    # Decode spans two nodes: the leader and the other rank both get it (launch adds it to each).
    gpu = _containers(docs, "LeaderWorkerSet", "-prefill") + _containers(docs, "LeaderWorkerSet", "-decode")
    assert len(gpu) == 3
    for c in gpu:
        assert _env(c)[ENV_WORKER_API_KEY] == WORKER_KEY_REF
        # The command names no key: launch appends --api-key from the environment when it execs sglang.
        assert c["command"][:3] == ["sglang-pd", "launch", "--role"] and API_KEY_FLAG not in c["command"]


def test_pods_with_the_key_pass_kubernetes_schemas(render) -> None:
    docs = render({"workerKeySecret": SECRET})
    kubernetes_validate.validate(one(docs, "Deployment", "-router"), "1.33.0", strict=True)
    for role in ("-prefill", "-decode"):
        tpl = one(docs, "LeaderWorkerSet", role)["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": tpl["spec"]}
        kubernetes_validate.validate(pod, "1.33.0", strict=True)


def test_by_default_the_chart_generates_the_key_and_every_pod_reads_it(chart, render) -> None:
    docs = render()
    (secret,) = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "demo-sglang-pd-worker-key"]
    (value,) = secret["data"].values()
    assert list(secret["data"]) == ["worker-key"] and len(base64.b64decode(value)) == 48
    generated = {"secretKeyRef": {"name": "demo-sglang-pd-worker-key", "key": "worker-key"}}
    (router,) = _containers(docs, "Deployment", "-router")
    assert _env(router)[ENV_ROUTER_WORKER_API_KEY] == generated
    for c in _containers(docs, "LeaderWorkerSet", "-prefill") + _containers(docs, "LeaderWorkerSet", "-decode"):
        assert _env(c)[ENV_WORKER_API_KEY] == generated
    notes = chart.render({}, name="demo", namespace="llm")["sglang-pd/templates/NOTES.txt"]
    assert "The engines are keyed" in notes and "no worker key" not in notes
    # A named Secret replaces the generated one.
    named = render({"workerKeySecret": SECRET})
    assert not [d for d in named if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-worker-key")]


def test_without_a_key_host_network_is_refused(chart) -> None:
    error = _refused(chart, {"workerKeySecret": {"generate": False}})
    assert "rdma.mode hostNetwork puts the engines' HTTP and bootstrap ports on the nodes' own addresses" in error
    assert "--set workerKeySecret.generate=true" in error


def test_opting_out_off_the_host_network_mentions_no_worker_key(chart, render) -> None:
    values = {"workerKeySecret": {"generate": False}, "rdma": {"mode": "devicePlugin"}}
    docs = render(values)
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-worker-key")]
    for c in _containers(docs, "Deployment", "-router") + _containers(docs, "LeaderWorkerSet", "-decode"):
        assert not {ENV_WORKER_API_KEY, ENV_ROUTER_WORKER_API_KEY} & set(_env(c))
    notes = chart.render(values, name="demo", namespace="llm")["sglang-pd/templates/NOTES.txt"]
    assert "no worker key (workerKeySecret.generate is false and workerKeySecret.name is empty)" in notes


def test_the_gate_calls_the_router_not_the_engines(render) -> None:
    docs = render({"workerKeySecret": SECRET, "gate": {"hook": {"enabled": True}}})
    job = one(docs, "Job", "-gate")["spec"]["template"]["spec"]["containers"][0]
    assert job["command"][job["command"].index("--base-url") + 1] == "http://demo-sglang-pd-router:8000/v1"
    assert not {ENV_WORKER_API_KEY, ENV_ROUTER_WORKER_API_KEY} & set(_env(job))


def _pod_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (Secrets from `secrets`)."""
    env = {}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
        else:  # fieldRef status.podIP
            env[e["name"]] = "10.0.0.5"
    return env


def test_the_key_reaches_sglang_only_through_launch(chart, render, tmp_path, monkeypatch, capsys) -> None:
    values = {"workerKeySecret": SECRET}
    raw = chart.render(values, name="demo", namespace="llm")
    assert not any(KEY_VALUE in text for text in raw.values())
    docs = parse_manifests(raw)
    topology = tmp_path / "topology.yaml"
    topology.write_text(one(docs, "ConfigMap", "-topology")["data"]["topology.yaml"])
    (prefill,) = _containers(docs, "LeaderWorkerSet", "-prefill")
    for name, value in _pod_env(prefill, {SECRET["name"]: {SECRET["key"]: KEY_VALUE}}).items():
        monkeypatch.setenv(name, value)
    # No GPUs here (the pod checks are test_pod_conformance.py's), and no KV peers to resolve.
    argv = [
        "launch",
        "--role",
        "prefill",
        "--topology",
        str(topology),
        "--dry-run",
        "--skip-checks",
        "--no-kv-firewall",
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    argv = json.loads(out)["argv"]
    # In a 0600 config file written at start, never on sglang's command line (deploy/ops/keyfile.py).
    assert argv[-2:] == [CONFIG_FLAG, KEY_FILE_SHOWN]
    assert not [a for a in argv if a.startswith(API_KEY_FLAG)]
    assert KEY_VALUE not in out


@pytest.mark.sglang
def test_probe_and_scrape_routes_are_open_under_sglangs_api_key(render) -> None:
    auth = pytest.importorskip("sglang.srt.utils.auth", reason="sglang is not installed (the `validate` extra)")
    docs = render({"workerKeySecret": SECRET, "metrics": {"podMonitor": {"enabled": True}}})
    paths = set()
    for c in _containers(docs, "LeaderWorkerSet", "-prefill") + _containers(docs, "LeaderWorkerSet", "-decode"):
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                paths.add(c[probe]["httpGet"]["path"])
    paths |= {e["path"] for e in one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"]}
    assert paths == {"/health", "/metrics"}

    def allowed(method: str, path: str, header: str | None) -> bool:
        decision = auth.decide_request_auth(
            method=method,
            path=path,
            authorization_header=header,
            api_key=KEY_VALUE,
            admin_api_key=None,
            auth_level=auth.AuthLevel.NORMAL,
        )
        return bool(decision.allowed)

    # kubelet and Prometheus send no Authorization header; sglang must let them through ...
    assert all(allowed("GET", p, None) for p in paths)
    # ... while the routes that act on requests need the key.
    assert not allowed("POST", "/abort_request", None) and not allowed("POST", "/generate", "Bearer nope")
    assert allowed("POST", "/abort_request", f"Bearer {KEY_VALUE}")


def _refused(chart, values: dict[str, Any]) -> str:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render(values, name="demo", namespace="llm")
    return str(info.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"workerKeySecret": {"name": "pd-worker-key", "key": ""}},
            'workerKeySecret.key: the Secret "pd-worker-key" is named but not the key in it',
        ),
        (
            {"decode": {"env": {ENV_WORKER_API_KEY: KEY_VALUE}}},
            f"decode.env.{ENV_WORKER_API_KEY}: a worker key in plain values is written into the pod spec",
        ),
        (
            {"env": {ENV_ROUTER_WORKER_API_KEY: KEY_VALUE}},
            f"env.{ENV_ROUTER_WORKER_API_KEY}: a worker key in plain values",
        ),
        (
            {"router": {"extraArgs": [f"--worker-api-key={KEY_VALUE}"]}},
            "router.extraArgs: --worker-api-key writes the worker key into the pod spec",
        ),
    ],
    ids=["name-without-key", "decode-env", "global-env", "router-flag"],
)
def test_misplaced_or_incomplete_keys_are_refused_with_the_fix(chart, values, message) -> None:
    error = _refused(chart, values)
    assert "VALUES VALIDATION" in error and message in error
    assert "workerKeySecret.name=<secret>" in error or "--set workerKeySecret.key=" in error


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"workerKeySecret": {"name": "Worker_Key"}}, "/workerKeySecret/name"),
        ({"workerKeySecret": {"name": "k", "key": "a/b"}}, "/workerKeySecret/key"),
        ({"workerKeySecret": {"secret": "k"}}, "secret"),
    ],
    ids=["name-not-dns", "key-with-slash", "unknown-field"],
)
def test_schema_refuses_names_kubernetes_would_not_take(chart, values, where) -> None:
    error = _refused(chart, values)
    assert "values don't meet the specifications of the schema" in error and where in error


def test_values_document_the_worker_key() -> None:
    text = (Path(__file__).resolve().parents[2] / "helm" / "sglang-pd" / "values.yaml").read_text()
    assert yaml.safe_load(text)["workerKeySecret"] == {"name": "", "key": "worker-key", "generate": True}
    for key in ("workerKeySecret.name", "workerKeySecret.key", "workerKeySecret.generate"):
        assert f"## @param {key} " in text
