"""Changing a role's nodes on an existing release: LeaderWorkerSet before 0.7.0 keeps a group's size immutable,
so the chart refuses the upgrade at render (before the topology ConfigMap changes) and says to delete the
LeaderWorkerSet first; 0.7.0 and later resize in place.

What is simulated: the chart reads the existing LeaderWorkerSet with `lookup`, which returns nothing in offline
rendering (the Helm SDK here has no cluster). These tests render a copy of the chart whose
"sglang-pd.existingLeaderWorkerSet" returns a given object instead, shaped as the API server serves it; the guard
and the validation that calls it are the chart's own. Only a real cluster shows that `lookup` returns that object
and that the LWS webhook refuses a size change before 0.7.0 (lws v0.6.2 pkg/webhooks/leaderworkerset_webhook.go
line 106) and accepts it from 0.7.0 (lws PRs 576 and 601).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import CHART, helm_python, one, parse_manifests, preset_topology

# Parsed after templates/_helpers.tpl (Helm parses templates of one depth in reverse name order, and the last
# definition of a name wins: helm pkg/engine/engine.go sortTemplates), so it replaces the lookup.
OVERRIDE = "_existing_simulated.tpl"


def existing_lws(size: int, *, lws_0_7: bool) -> dict[str, Any]:
    """A LeaderWorkerSet as the API server returns it: from LWS 0.7.0 its CRD defaults
    rolloutStrategy.rollingUpdateConfiguration.partition to 0 on every read; before, the field does not exist."""
    rolling: dict[str, Any] = {"maxSurge": 0, "maxUnavailable": 1}
    if lws_0_7:
        rolling["partition"] = 0
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "demo-sglang-pd-decode", "namespace": "llm"},
        "spec": {
            "replicas": 1,
            "leaderWorkerTemplate": {"size": size, "restartPolicy": "RecreateGroupOnPodRestart"},
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling},
        },
    }


@pytest.fixture
def chart_seeing(tmp_path: Path) -> Iterator[Callable[[dict[str, Any] | None], Any]]:
    """A copy of the chart whose decode LeaderWorkerSet lookup returns `existing` (None: nothing found)."""
    loaded: list[Any] = []

    def load(existing: dict[str, Any] | None) -> Any:
        copy = tmp_path / f"chart-{len(loaded)}"
        shutil.copytree(CHART, copy)
        found = json.dumps(existing or {})
        (copy / "templates" / OVERRIDE).write_text(
            '{{- define "sglang-pd.existingLeaderWorkerSet" -}}\n'
            f'{{{{- if eq .role "decode" -}}}}{{{{ {json.dumps(found)} }}}}{{{{- else -}}}}{{}}{{{{- end -}}}}\n'
            "{{- end -}}\n"
        )
        chart = helm_python.Chart.load(str(copy))
        loaded.append(chart)
        return chart

    yield load
    for chart in loaded:
        chart.close()


def _three_node_decode() -> dict[str, Any]:
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["decode"].update(nodes=3, tp=24, attn_dp_size=24, ep=24, max_running_requests=3072)
    return t


def test_a_size_change_on_lws_before_0_7_is_refused_naming_the_fix(chart_seeing) -> None:
    chart = chart_seeing(existing_lws(2, lws_0_7=False))
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"topology": _three_node_decode()}, name="demo", namespace="llm", is_upgrade=True)
    message = str(info.value)
    assert "decode.nodes: the LeaderWorkerSet demo-sglang-pd-decode runs groups of 2 pods" in message
    assert "this upgrade makes them 3" in message and "older than 0.7.0" in message
    assert "kubectl -n llm delete leaderworkerset demo-sglang-pd-decode" in message
    assert "or upgrade LeaderWorkerSet to 0.7.0 or later" in message
    assert "prefill.nodes" not in message  # the prefill set is unchanged


@pytest.mark.parametrize(
    ("existing", "why"),
    [
        (existing_lws(3, lws_0_7=False), "same size: nothing to resize"),
        (existing_lws(2, lws_0_7=True), "LWS 0.7.0 or later resizes in place"),
        (None, "a first install: no LeaderWorkerSet yet"),
    ],
    ids=["same-size-old-lws", "new-lws", "no-object"],
)
def test_the_guard_lets_through_what_lws_can_apply(chart_seeing, existing, why: str) -> None:
    chart = chart_seeing(existing)
    docs = parse_manifests(chart.render({"topology": _three_node_decode()}, name="demo", namespace="llm"))
    assert one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["size"] == 3, why


def test_offline_rendering_sees_no_cluster(chart) -> None:
    # The real chart: `lookup` finds nothing offline, so `helm template` renders any size; the guard acts only
    # when Helm talks to a cluster that serves the LeaderWorkerSet API.
    docs = parse_manifests(chart.render({"topology": _three_node_decode()}, name="demo", namespace="llm"))
    assert one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["size"] == 3
