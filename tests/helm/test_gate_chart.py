"""The chart's gsm8k gate: all questions by default, the baseline ConfigMap passed from one release to the
next, the canary CronJob and its metrics on the dashboard; schema-valid for Kubernetes 1.30 and 1.33."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sglang_pd.deploy.cli import build_parser
from sglang_pd.deploy.evals.cli import build_options
from sglang_pd.deploy.evals.textfile import render_metrics

from .conftest import CHART, by_kind, helm_python, one

K8S_VERSIONS = ["1.30.0", "1.33.0"]
GATE_ON = {"gate": {"hook": {"enabled": True}, "canary": {"enabled": True}}}


def _command(pod_spec: dict[str, Any]) -> list[str]:
    return list(pod_spec["containers"][0]["command"])


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def _parsed(cmd: list[str]) -> Any:
    """The rendered command through the real CLI parser and option checks (a typo in a flag fails here)."""
    assert cmd[0] == "sglang-pd"
    args = build_parser("eval").parse_args(cmd[1:])
    build_options(args)
    return args


def test_the_gate_asks_all_questions_and_is_paired_with_the_stored_baseline(render) -> None:
    docs = render({"gate": {"hook": {"enabled": True}}})
    baseline_cm = one(docs, "ConfigMap", "-gate-baseline")
    # No `data`: Helm never overwrites the report the gate stored (it only patches what it renders).
    assert "data" not in baseline_cm and baseline_cm["metadata"]["name"] == "demo-sglang-pd-gate-baseline"
    for pod in (one(docs, "Job", "-gate")["spec"]["template"]["spec"], one(docs, "Pod", "-test-gsm8k")["spec"]):
        cmd = _command(pod)
        assert _flag(cmd, "--num-questions") == "all" and _flag(cmd, "--max-drop") == "0.02"
        assert _flag(cmd, "--baseline") == "/baseline/report.json" and "--baseline-optional" in cmd
        assert _flag(cmd, "--publish-baseline") == "demo-sglang-pd-gate-baseline"
        args = _parsed(cmd)
        assert args.num_questions is None and args.min_accuracy == 0.9
        assert pod["serviceAccountName"] == "demo-sglang-pd-gate"
        volume = next(v for v in pod["volumes"] if v["name"] == "gsm8k-baseline")
        assert volume["configMap"] == {"name": "demo-sglang-pd-gate-baseline", "optional": True}
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "gsm8k-baseline")
        assert mount == {"name": "gsm8k-baseline", "mountPath": "/baseline", "readOnly": True}


def test_the_gate_may_only_read_its_lws_and_read_and_patch_its_configmap(render) -> None:
    docs = render()
    role = one(docs, "Role", "-gate")
    assert role["rules"] == [
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
         "resourceNames": ["demo-sglang-pd-prefill", "demo-sglang-pd-decode"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["demo-sglang-pd-gate-baseline"],
         "verbs": ["get", "patch"]},
    ]  # fmt: skip
    lws = {d["metadata"]["name"] for d in docs if d["kind"] == "LeaderWorkerSet"}
    assert lws == set(role["rules"][0]["resourceNames"])  # the names the Role grants are the chart's LWS
    binding = one(docs, "RoleBinding", "-gate")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-sglang-pd-gate", "namespace": "llm"}]
    assert one(docs, "ServiceAccount", "-gate")["metadata"]["name"] == "demo-sglang-pd-gate"


def test_without_a_baseline_nothing_is_stored_and_the_token_only_reads_the_rollout(render) -> None:
    docs = render({"gate": {"baseline": {"enabled": False}, "gsm8k": {"numQuestions": 200}}})
    assert not [d for d in docs if d["metadata"]["name"].endswith("-gate-baseline")]
    # The account stays for the wait on the rollout, with no right on any ConfigMap.
    assert [r["resources"] for r in one(docs, "Role", "-gate")["rules"]] == [["leaderworkersets"]]
    pod = one(docs, "Pod", "-test-gsm8k")["spec"]
    cmd = _command(pod)
    assert "--baseline" not in cmd and "--publish-baseline" not in cmd and _flag(cmd, "--num-questions") == "200"
    assert pod["serviceAccountName"] == "demo-sglang-pd-gate" and "volumes" not in pod
    _parsed(cmd)


def test_no_gate_no_baseline_objects(render) -> None:
    docs = render({"gate": {"helmTest": {"enabled": False}}})
    assert not [d for d in docs if "gate" in d["metadata"]["name"] or d["metadata"]["name"].endswith("-test-gsm8k")]


def test_the_canary_cronjob(render) -> None:
    docs = render(GATE_ON)
    cron = one(docs, "CronJob", "-gate-canary")
    assert cron["spec"]["schedule"] == "*/30 * * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    cmd = _command(pod)
    assert "--sample" in cmd and _flag(cmd, "--num-questions") == "300" and _flag(cmd, "--max-drop") == "0.05"
    assert _flag(cmd, "--baseline") == "/baseline/report.json" and "--publish-baseline" not in cmd
    assert _flag(cmd, "--metrics-textfile") == "/textfile/sglang_pd_gsm8k_demo.prom"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--metrics-label"] == [
        "release=demo",
        "release_namespace=llm",
    ]
    assert int(_flag(cmd, "--timeout")) < job["activeDeadlineSeconds"]
    args = _parsed(cmd)
    assert args.sample and args.baseline_optional
    textfile = next(v for v in pod["volumes"] if v["name"] == "textfile")
    assert textfile["hostPath"] == {"path": "/var/lib/node_exporter/textfile_collector", "type": "DirectoryOrCreate"}
    security = pod["containers"][0]["securityContext"]
    assert security["runAsUser"] == 0 and security["capabilities"] == {"drop": ["ALL"]}
    assert security["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False  # reads the baseline as a volume, never writes it


def test_the_canary_can_be_pinned_and_rescheduled(render) -> None:
    values = {"gate": {"canary": {"enabled": True, "schedule": "0 * * * *", "nodeSelector": {"role": "cpu"}}}}
    cron = one(render(values), "CronJob", "-gate-canary")
    assert cron["spec"]["schedule"] == "0 * * * *"
    assert cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["nodeSelector"] == {"role": "cpu"}


def test_the_canary_needs_the_baseline_to_hold_all_questions(chart) -> None:
    values = {"gate": {"canary": {"enabled": True}, "gsm8k": {"numQuestions": 200}}}
    with pytest.raises(helm_python.HelmError, match=r"set gate\.gsm8k\.numQuestions=all"):
        chart.render(values, name="demo", namespace="llm")


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"gate": {"gsm8k": {"numQuestions": "most"}}}, "/gate/gsm8k/numQuestions"),
        ({"gate": {"gsm8k": {"maxDrop": 2}}}, "/gate/gsm8k/maxDrop"),
        ({"gate": {"canary": {"maxDrop": -0.1}}}, "/gate/canary/maxDrop"),
        ({"gate": {"canary": {"textfileDirectory": "relative/dir"}}}, "/gate/canary/textfileDirectory"),
        ({"gate": {"canary": {"every": "5m"}}}, "every"),
    ],
)
def test_schema_rejects_wrong_gate_values(chart, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render(values, name="demo", namespace="llm")
    assert "values don't meet the specifications of the schema" in str(info.value) and where in str(info.value)


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_gate_objects_pass_kubernetes_schemas(render, k8s: str) -> None:
    docs = render(GATE_ON)
    kinds = set()
    for doc in docs:
        name = doc["metadata"]["name"]
        if "gate" in name or name.endswith("-test-gsm8k"):
            kubernetes_validate.validate(doc, k8s, strict=True)
            kinds.add(doc["kind"])
    assert kinds == {"ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Job", "CronJob", "Pod"}


def test_dashboard_shows_the_canary_metrics_the_gate_writes(render) -> None:
    docs = render({"metrics": {"grafanaDashboard": {"enabled": True}}})
    dashboard = json.loads(one(docs, "ConfigMap", "-dashboard")["data"]["sglang-pd.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    shown = set(re.findall(r"sglang_pd_gsm8k_[a-z_]+", exprs))
    assert {"sglang_pd_gsm8k_accuracy", "sglang_pd_gsm8k_gate_passed", "sglang_pd_gsm8k_drop_upper_bound"} <= shown
    # Every metric the dashboard reads is one the canary writes (names checked against the writer).
    report = {
        "metrics": {"n": 300, "accuracy": 0.95, "error_rate": 0, "retry_rate": 0, "invalid_response_rate": 0,
                    "truncation_rate": 0},
        "gate": {"rules": [{"rule": "baseline_paired", "numbers": {"drop": 0, "drop_upper": 0.01, "max_drop": 0.05}}]},
    }  # fmt: skip
    written = set(re.findall(r"^(sglang_pd_gsm8k_[a-z_]+)\{", render_metrics(report, 0, {"release": "demo"}), re.M))
    assert shown <= written
    assert all('release_namespace="$namespace"' in e for e in exprs.split("sglang_pd_gsm8k_")[1:])


def test_values_document_the_gate_defaults() -> None:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)["gate"]
    assert values["gsm8k"]["numQuestions"] == "all" and values["gsm8k"]["maxDrop"] == 0.02
    assert values["baseline"] == {"enabled": True} and values["canary"]["enabled"] is False
    for key in ("gate.gsm8k.numQuestions", "gate.gsm8k.maxDrop", "gate.baseline.enabled", "gate.canary.enabled"):
        assert f"## @param {key} " in text
    assert "1314" in text and "--baseline" in text


def test_the_gate_has_its_own_service_account(render) -> None:
    # Never the router's (which may list pods): the gate may touch one ConfigMap only.
    docs = render()
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"].get("serviceAccountName")
    assert router != "demo-sglang-pd-gate"
    assert "demo-sglang-pd-gate" in {d["metadata"]["name"] for d in by_kind(docs, "ServiceAccount")}
