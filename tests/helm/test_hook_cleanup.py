"""Hook objects do not outlive their purpose: `helm uninstall` leaves hooks behind (they are not part of the
release), so every hook carries a delete policy that removes it once it succeeds, a failed Job is removed after
hooks.ttlSecondsAfterFinished, and what a hook's pod mounts or runs as is either a hook deleted with it or a
release object `helm uninstall` deletes."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import one, preset_values

HOOK = "helm.sh/hook"
DELETE = "helm.sh/hook-delete-policy"
# Deleted before its next run (no "already exists") and once it succeeds; not on failure, so that a failed gate or
# plan check can still be read (`kubectl logs`, and Helm 4 prints a failed Job's logs itself).
WANTED = {"before-hook-creation", "hook-succeeded"}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "everything": {
        "gate": {"hook": {"enabled": True}, "analysisTemplate": {"enabled": True}, "canary": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
        "networkPolicy": {"enabled": True},
        "workerKeySecret": {"name": "wk"},
        "router": {"apiKeySecret": {"name": "keys"}},
    },
    "pvc-model-config": {
        "model": {"source": "pvc", "pvc": {"claimName": "w"}, "configFile": "{}"},
        "gate": {"hook": {"enabled": True}},
    },
    "device-plugin": {"rdma": {"mode": "devicePlugin"}, "gate": {"hook": {"enabled": True}}},
    "h20": preset_values("deepseek-v3-h20-3p2d"),
    "local-cpu": {**preset_values("local-cpu"), "gate": {"hook": {"enabled": True}}},
    "local-cpu-mla": preset_values("local-cpu-mla"),
}


def hook_problems(doc: dict[str, Any]) -> list[str]:
    """Why a hook object would outlive its run; nothing for one that is cleaned up, or for a release object."""
    annotations = doc["metadata"].get("annotations") or {}
    if HOOK not in annotations:
        return []
    name = f"{doc['kind']} {doc['metadata']['name']}"
    policies = {p.strip() for p in str(annotations.get(DELETE, "")).split(",") if p.strip()}
    problems = [f"{name}: {DELETE} is {sorted(policies)}, not {sorted(WANTED)}"] if policies != WANTED else []
    if doc["kind"] == "Job" and not doc["spec"].get("ttlSecondsAfterFinished"):
        problems.append(f"{name}: a failed Job stays forever without spec.ttlSecondsAfterFinished")
    return problems


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"] if doc["kind"] == "Job" else doc["spec"])


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_every_hook_is_deleted_when_it_succeeds(render, values: dict[str, Any]) -> None:
    docs = render(values)
    hooks = [d for d in docs if HOOK in (d["metadata"].get("annotations") or {})]
    assert len(hooks) >= 4  # the plan check and its ConfigMap, the gsm8k and KV-probe test pods at least
    assert [p for d in hooks for p in hook_problems(d)] == []


@pytest.mark.parametrize("values", list(VALUE_SETS.values()), ids=list(VALUE_SETS))
def test_what_a_hook_pod_uses_is_cleaned_up_with_it_or_with_the_release(render, values: dict[str, Any]) -> None:
    docs = render(values)
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    checked: set[tuple[str, str]] = set()
    for doc in docs:
        if HOOK not in (doc["metadata"].get("annotations") or {}) or doc["kind"] not in ("Job", "Pod"):
            continue
        spec = _pod_spec(doc)
        used = [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
        if spec.get("serviceAccountName"):
            account = spec["serviceAccountName"]
            used += [("ServiceAccount", account), ("Role", account), ("RoleBinding", account)]
        for kind, name in used:
            assert (kind, name) in by_name, f"{doc['metadata']['name']} uses {kind} {name}, which the chart lacks"
            # A hook object carries its own delete policy; a release object goes with `helm uninstall`.
            assert hook_problems(by_name[(kind, name)]) == [], (doc["metadata"]["name"], kind, name)
            checked.add((kind, name))
    # The plan check's own ConfigMap is a hook; the gate's account and its RBAC are release objects.
    assert ("ConfigMap", "demo-sglang-pd-plan") in checked
    if values.get("gate", {}).get("hook", {}).get("enabled"):
        assert {"ServiceAccount", "Role", "RoleBinding"} <= {kind for kind, _ in checked}


def test_failed_hook_jobs_keep_their_logs_for_the_ttl_then_go(render) -> None:
    docs = render({"gate": {"hook": {"enabled": True}}, "hooks": {"ttlSecondsAfterFinished": 3600}})
    for suffix in ("-plan", "-gate"):
        job = one(docs, "Job", suffix)
        assert job["spec"]["ttlSecondsAfterFinished"] == 3600
        assert "hook-failed" not in job["metadata"]["annotations"][DELETE]
        # Helm 4 prints a failed hook's pod logs (helm.sh/hook-output-log-policy, pkg/action/hooks.go).
        assert job["metadata"]["annotations"]["helm.sh/hook-output-log-policy"] == "hook-failed"
    default = one(render({"gate": {"hook": {"enabled": True}}}), "Job", "-gate")
    assert default["spec"]["ttlSecondsAfterFinished"] == 7 * 24 * 3600


@pytest.mark.parametrize(
    ("annotations", "spec", "kind", "said"),
    [
        ({HOOK: "test"}, {}, "Pod", "helm.sh/hook-delete-policy is [], not"),
        ({HOOK: "test", DELETE: "before-hook-creation"}, {}, "Pod", "is ['before-hook-creation'], not"),
        ({HOOK: "post-upgrade", DELETE: "before-hook-creation,hook-succeeded"}, {}, "Job", "ttlSecondsAfterFinished"),
        (
            {HOOK: "post-upgrade", DELETE: "hook-succeeded,hook-failed"},
            {"ttlSecondsAfterFinished": 60},
            "Job",
            "is ['hook-failed', 'hook-succeeded'], not",
        ),
    ],
    ids=["no-policy", "only-before-creation", "job-without-ttl", "deletes-failed-logs"],
)
def test_the_check_fails_on_hooks_that_would_linger_or_lose_their_logs(annotations, spec, kind, said) -> None:
    doc = {"kind": kind, "metadata": {"name": "x", "annotations": annotations}, "spec": spec}
    problems = hook_problems(doc)
    assert problems and said in " ".join(problems)
    release_object = {"kind": "ConfigMap", "metadata": {"name": "x"}}
    assert hook_problems(release_object) == []
