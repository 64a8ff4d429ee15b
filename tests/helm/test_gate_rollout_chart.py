"""The chart's rollout gates wait for the rollout before scoring: both LeaderWorkerSets named, a budget that
follows the startup budget (the slower role's groups times its startup probe's failureThreshold x
periodSeconds, plus 5 minutes) instead of a fixed 300 s, and a pod deadline that holds the waits and the run."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from .conftest import by_kind, one, own_topology_values, preset_topology, preset_values
from .test_gate_chart import _command, _flag, _parsed

ALL_ROLLOUT_GATES = {
    "gate": {"hook": {"enabled": True}, "analysisTemplate": {"enabled": True}, "canary": {"enabled": True}}
}
MARGIN_S = 300


def _rollout_pods(docs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], int]]:
    """Each rollout gate's pod spec and the activeDeadlineSeconds it runs under."""
    job = one(docs, "Job", "-gate")["spec"]
    pod = one(docs, "Pod", "-test-gsm8k")["spec"]
    analysis = one(docs, "AnalysisTemplate", "-gsm8k")["spec"]["metrics"][0]["provider"]["job"]["spec"]
    return {
        "hook": (job["template"]["spec"], job["activeDeadlineSeconds"]),
        "helm test": (pod, pod["activeDeadlineSeconds"]),
        "analysis": (analysis["template"]["spec"], analysis["activeDeadlineSeconds"]),
    }


def _startup_s(lws: dict[str, Any]) -> int:
    """A group's startup budget, read back from its rendered leader: failureThreshold x periodSeconds."""
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = template.get("leaderTemplate", template["workerTemplate"])
    probe = leader["spec"]["containers"][0]["startupProbe"]
    return int(probe["failureThreshold"]) * int(probe["periodSeconds"])


def _expected(docs: list[dict[str, Any]]) -> tuple[set[str], int, int]:
    """The LWS names, and the rollout and ready budgets the rendered LWS imply."""
    lws = by_kind(docs, "LeaderWorkerSet")
    rollout = max(int(d["spec"]["replicas"]) * _startup_s(d) for d in lws) + MARGIN_S
    return {d["metadata"]["name"] for d in lws}, rollout, max(_startup_s(d) for d in lws)


@pytest.mark.parametrize("preset", ["deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d", "local-cpu"])
def test_rollout_gates_wait_for_both_lws_with_the_derived_budget(render, preset: str) -> None:
    values = {**preset_values(preset), **ALL_ROLLOUT_GATES, "cpuImage": {"repository": "registry.example/cpu"}}
    docs = render(values)
    names, rollout, ready = _expected(docs)
    for gate, (pod, deadline) in _rollout_pods(docs).items():
        cmd = _command(pod)
        args = _parsed(cmd)
        assert set(args.wait_rollout) == names and len(names) == 2, gate
        assert args.rollout_timeout == rollout and args.wait_ready == ready, gate
        assert args.wait_ready != 300 or ready == 300
        # The pod outlives both waits and the run's own --timeout.
        assert deadline == 3600 + rollout + ready and int(_flag(cmd, "--timeout")) + rollout + ready < deadline
    canary = one(docs, "CronJob", "-gate-canary")["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert "--wait-rollout" not in _command(canary)  # a periodic check of a running release


def test_the_budget_follows_the_startup_budget_and_the_groups(render) -> None:
    base = {**preset_values("deepseek-v3-h20-3p2d"), "gate": {"hook": {"enabled": True}}}

    def budgets(values: dict[str, Any]) -> tuple[float, float]:
        args = _parsed(_command(_rollout_pods_hook(render(values))))
        return args.rollout_timeout, args.wait_ready

    rollout, ready = budgets(base)
    slower = copy.deepcopy(base)
    slower["decode"] = {"startupProbe": {"failureThreshold": 1500, "periodSeconds": 10}}  # 15000 s a group
    groups = preset_topology("deepseek-v3-h20-3p2d")["decode"]["groups"]
    assert budgets(slower) == (max(rollout, groups * 15000 + MARGIN_S), 15000)
    assert budgets(slower)[0] > rollout
    topology = preset_topology("deepseek-v3-h20-3p2d")
    topology["decode"]["groups"] = topology["decode"]["groups"] + 4
    more = {**own_topology_values(topology), "gate": {"hook": {"enabled": True}}}
    assert budgets(more)[0] > rollout and budgets(more)[1] == ready


def _rollout_pods_hook(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(one(docs, "Job", "-gate")["spec"]["template"]["spec"])
