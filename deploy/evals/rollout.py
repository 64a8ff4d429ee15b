"""Wait for a rollout before scoring it (`sglang-pd eval gsm8k --wait-rollout NAME`).

A gate that scores while a LeaderWorkerSet is still rolling judges a mix of the old and the new groups, or
only the old ones: its verdict would say nothing about the release. So, inside the gate's pod, the gate first
reads each LeaderWorkerSet named (raw HTTP to the API server with the pod's service-account token, as
publish.py does) until it has rolled out, as the LWS API (leaderworkerset.x-k8s.io/v1, `LeaderWorkerSetStatus`)
describes its status: `replicas` groups created, `updatedReplicas` groups on the current template, and
`readyReplicas` groups ready, each equal to `spec.replicas`, and no `UpdateInProgress` condition that is True.
The status fields are `omitempty` in that API: a missing one is 0. Where a condition carries an
`observedGeneration` older than the object's `metadata.generation`, the controller has not yet seen the
current spec, and the status is not trusted.

The budget is the chart's: the slowest role's groups times its startup budget (one group at a time, as the
chart's rolling update takes them), plus a margin. Past it the gate ends with exit 4 and asks no question: a
partial rollout is not scored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from .errors import EndpointError
from .publish import InCluster

__all__ = ["RolloutNotReady", "fetch_lws", "rollout_problem", "wait_for_rollout"]

LWS_API = "apis/leaderworkerset.x-k8s.io/v1"

Fetch = Callable[[str], Mapping[str, Any]]


class RolloutNotReady(EndpointError):
    """A LeaderWorkerSet did not finish its rollout within the budget (exit 4: not scored)."""


def _count(status: Mapping[str, Any], key: str) -> int:
    value = status.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


def rollout_problem(lws: Mapping[str, Any]) -> str | None:
    """What the LeaderWorkerSet `lws` (the API object, as JSON) still waits for; None when it has rolled out."""
    metadata = lws.get("metadata") or {}
    spec = lws.get("spec") or {}
    status = lws.get("status") or {}
    name = metadata.get("name", "?")
    desired = spec.get("replicas", 1)  # the API's default
    desired = int(desired) if isinstance(desired, int) else 1
    generation = metadata.get("generation")
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    seen = [c["observedGeneration"] for c in conditions if isinstance(c.get("observedGeneration"), int)]
    if isinstance(generation, int) and seen and min(seen) < generation:
        return f"{name}: its controller has not yet seen generation {generation} (conditions at {min(seen)})"
    for key, what in (("replicas", "created"), ("updatedReplicas", "updated"), ("readyReplicas", "ready")):
        have = _count(status, key)
        if have != desired:
            return f"{name}: {have} of {desired} groups {what}"
    if any(c.get("type") == "UpdateInProgress" and c.get("status") == "True" for c in conditions):
        return f"{name}: rolling update in progress"
    return None


def fetch_lws(cluster: InCluster, *, timeout_s: float = 10.0) -> Fetch:
    """A function that GETs one LeaderWorkerSet of the pod's namespace by name."""
    verify: bool | str = str(cluster.ca_path) if cluster.ca_path is not None else True

    def fetch(name: str) -> Mapping[str, Any]:
        url = f"{cluster.api_url}/{LWS_API}/namespaces/{cluster.namespace}/leaderworkersets/{name}"
        headers = {"Authorization": f"Bearer {cluster.token}", "Accept": "application/json"}
        try:
            response = httpx.get(url, headers=headers, timeout=timeout_s, verify=verify)
        except httpx.HTTPError as exc:
            raise RolloutNotReady(f"Cannot reach the Kubernetes API at {url} ({type(exc).__name__}: {exc}).") from exc
        if response.status_code in (401, 403):
            raise RolloutNotReady(
                f"The Kubernetes API refused to read LeaderWorkerSet {cluster.namespace}/{name} (HTTP "
                f"{response.status_code}); the gate's ServiceAccount needs get on it (the chart's gate Role grants it)."
            )
        if response.status_code == 404:
            raise RolloutNotReady(
                f"LeaderWorkerSet {cluster.namespace}/{name} does not exist; check --wait-rollout's names "
                "(`kubectl get lws`)."
            )
        if response.status_code != 200:
            raise RolloutNotReady(f"Reading LeaderWorkerSet {name} failed: HTTP {response.status_code}.")
        data = response.json()
        if not isinstance(data, dict):
            raise RolloutNotReady(f"LeaderWorkerSet {name}: the API answered no object.")
        return data

    return fetch


def wait_for_rollout(
    fetch: Fetch,
    names: Sequence[str],
    budget_s: float,
    *,
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda _: None,
) -> None:
    """Return once every LeaderWorkerSet of `names` has rolled out (`rollout_problem`); RolloutNotReady naming
    what was still missing when `budget_s` ran out, or when the API refuses or lacks one (no waiting then)."""
    deadline = clock() + budget_s
    last: list[str] = []
    while True:
        problems = [p for p in (rollout_problem(fetch(name)) for name in names) if p is not None]
        if not problems:
            return
        if problems != last:
            log("waiting for the rollout: " + "; ".join(problems))
            last = problems
        if clock() >= deadline:
            raise RolloutNotReady(
                f"The rollout did not finish within {budget_s:g} s ({'; '.join(problems)}); a partial rollout is "
                "not scored. See `kubectl get lws` and the pods' events."
            )
        sleep(min(poll_s, max(0.0, deadline - clock())))
