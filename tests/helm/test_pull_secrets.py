"""Every pod the chart renders can pull its image from a private registry: with `imagePullSecrets` set, each
pod spec carries them (the engines, the router, the plan hook, and every form of the gsm8k gate: the hook Job,
the canary CronJob, the Argo AnalysisTemplate's Job, the `helm test` pods)."""

from __future__ import annotations

from typing import Any

from .conftest import preset_values

SECRETS = [{"name": "regcred"}, {"name": "mirror"}]
ALL_GATES = {
    "helmTest": {"enabled": True},
    "hook": {"enabled": True},
    "analysisTemplate": {"enabled": True},
    "canary": {"enabled": True, "nodeSelector": {"kubernetes.io/hostname": "n1"}},
}


def _pod_specs(value: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """Every pod spec (a mapping with `containers`) inside `value`, with the path it was found at."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(value, dict):
        if "containers" in value:
            found.append((where, value))
        for key, item in value.items():
            found += _pod_specs(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _pod_specs(item, f"{where}[{i}]")
    return found


def _specs(render: Any, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    specs: dict[str, dict[str, Any]] = {}
    for doc in render(values):
        for where, spec in _pod_specs(doc, f"{doc['kind']}/{doc['metadata']['name']}"):
            specs[where] = spec
    return specs


def test_every_pod_carries_the_pull_secrets(render) -> None:
    specs = _specs(render, {"imagePullSecrets": SECRETS, "gate": ALL_GATES})
    gates = sorted(w for w, s in specs.items() if any("gsm8k" in c["name"] for c in s["containers"]))
    kinds = {w.split("/")[0] for w in gates}
    assert kinds == {"Job", "CronJob", "AnalysisTemplate", "Pod"}, gates  # each gate form rendered
    missing = sorted(w for w, s in specs.items() if s.get("imagePullSecrets") != SECRETS)
    assert missing == [], missing
    assert len(specs) >= 8, sorted(specs)  # LWS x2, router, plan, kv probe, and the four gates


def test_reference_engine_pods_carry_them_too(render) -> None:
    values = {
        **preset_values("local-cpu"),
        "cpuImage": {"repository": "registry.example/cpu"},
        "imagePullSecrets": SECRETS,
        "gate": ALL_GATES,
    }
    specs = _specs(render, values)
    missing = sorted(w for w, s in specs.items() if s.get("imagePullSecrets") != SECRETS)
    assert missing == [] and len(specs) >= 7, (missing, sorted(specs))


def test_without_secrets_no_pod_names_any(render) -> None:
    specs = _specs(render, {"gate": ALL_GATES})
    assert [w for w, s in specs.items() if "imagePullSecrets" in s] == []
