"""Traffic during a rollout: client requests stay on the approved revision until the gate approves another.

While two revisions are healthy (an upgrade brings the new one up beside the old, docs/upgrades.md), the
router serves client requests from one, the *approved* revision, and a *candidate* only gets

- requests pinned to it by the `x-sglpd-revision: REV` header, which the router honours only with the admin
  key (the gate's: `sglang-pd eval gsm8k --revision REV` scores the candidate alone), and
- a canary share of the client requests, `--canary-share` (0 by default: none).

`POST /admin/revisions/approve {"revision": REV}` makes REV the approved revision. The revision approved before
then drains: it gets no new unpinned request, and its requests in flight finish (`GET /admin/revisions` shows
it `draining` until none is left, then `drained`: it can be removed).

The first revision with a healthy pair is approved on its own when none is (a first install, a router
restart). An approved revision whose last worker is deregistered lapses, and the next one with a healthy
pair is approved the same way: an in-place upgrade, where the old revision's pods are replaced rather than
joined, has nothing to hold traffic on. A revision stays approved while its workers are registered but
unhealthy: client requests then get a 503 naming the candidates, rather than a revision no gate passed.
"""

from __future__ import annotations

import contextvars
import random
from collections.abc import Iterable
from typing import Any, Literal

from ..exceptions import NoHealthyWorker, WorkerAtCapacity
from ..log import logger
from ..metrics import RouterMetrics
from .registry import Worker, WorkerRegistry

__all__ = [
    "PIN_HEADER",
    "ROUTES",
    "NoApprovedPair",
    "PinnedWithoutPair",
    "Rollout",
    "pinned_revision",
]

# The request header that pins a request to one revision (admin key only: api/middleware/auth.py).
PIN_HEADER = "x-sglpd-revision"
# How a request reached its revision: the approved one, the canary share, or pinned by the header.
Route = Literal["client", "canary", "pinned"]
ROUTES: tuple[Route, ...] = ("client", "canary", "pinned")
# The revision the request being served is pinned to (None: not pinned); set by the app per request.
pinned_revision: contextvars.ContextVar[str | None] = contextvars.ContextVar("sglpd_pinned_revision", default=None)

_APPROVE_HINT = "POST /admin/revisions/approve with the admin key approves one (docs/upgrades.md)"


class NoApprovedPair(NoHealthyWorker):
    """The approved revision has no healthy pair; candidates get no client request until one is approved."""

    def __init__(self, approved: str, candidates: Iterable[str]) -> None:
        super().__init__("decode")
        shown = ", ".join(sorted(_name(c) for c in candidates)) or "none"
        self.args = (
            f"The approved revision {_name(approved)} has no healthy prefill and decode pair, and client requests "
            f"go only to the approved revision (healthy candidates: {shown}); {_APPROVE_HINT}.",
        )


class PinnedWithoutPair(NoHealthyWorker):
    """A request pinned to a revision that has no healthy pair."""

    def __init__(self, revision: str, healthy: Iterable[str]) -> None:
        super().__init__("decode")
        shown = ", ".join(sorted(_name(r) for r in healthy)) or "none"
        self.args = (
            f"The request is pinned to revision {_name(revision)} ({PIN_HEADER}), which has no healthy prefill and "
            f"decode pair (revisions with one: {shown}). Check `GET /admin/revisions`.",
        )


def _name(revision: str) -> str:
    return revision or "(unknown)"


def _paired(registry: WorkerRegistry, exclude: Iterable[Worker] = ()) -> list[str]:
    """The revisions with a healthy prefill and decode, in the prefills' registration order."""
    decodes = {w.revision for w in registry.available("decode", exclude)}
    seen: dict[str, None] = {}
    for prefill in registry.available("prefill", exclude):
        if prefill.revision in decodes:
            seen.setdefault(prefill.revision)
    return list(seen)


class Rollout:
    """Which revision serves client requests, and the share a candidate gets. One per router process
    (a process group's serving processes take the approval from the control process: `apply`)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        canary_share: float = 0.0,
        metrics: RouterMetrics | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not 0.0 <= canary_share <= 1.0:
            raise ValueError(f"Config 'canary_share' has value {canary_share}. It must be between 0 and 1.")
        self.registry = registry
        self.canary_share = canary_share
        self.metrics = metrics
        self.approved: str | None = None
        # Revisions approved before the current one, oldest first: they drain.
        self.previous: list[str] = []
        self._rng = rng or random.Random()
        self._routed: dict[tuple[str, Route], Any] = {}
        registry.subscribe(self._on_change)

    # -- approval -----------------------------------------------------------------------------

    def approve(self, revision: str, *, reason: str = "approved") -> None:
        if revision == self.approved:
            return
        if self.approved is not None:
            self.previous = [r for r in self.previous if r != self.approved] + [self.approved]
        self.previous = [r for r in self.previous if r != revision]
        old, self.approved = self.approved, revision
        if self.metrics is not None:
            if old is not None:
                self.metrics.revision_approved.labels(old).set(0)
            self.metrics.revision_approved.labels(revision).set(1)
        logger.info("revision approved", extra={"revision": revision, "previous": old, "reason": reason})

    def apply(self, state: dict[str, Any]) -> None:
        """Take the approval a process group's control process holds (`state()` of its Rollout)."""
        approved = state.get("approved")
        if approved is None:  # the control process has approved none yet: keep ours
            return
        if approved != self.approved:
            self.approve(approved, reason="group")
        self.previous = list(state.get("previous", []))

    def state(self) -> dict[str, Any]:
        return {"approved": self.approved, "previous": list(self.previous)}

    def _on_change(self, event: str, worker: Worker) -> None:
        # An approved revision with no worker left lapses (its pods were replaced, not joined).
        if event != "removed":
            return
        if self.approved is not None and not any(w.revision == self.approved for w in self.registry.all()):
            logger.info("approved revision has no worker left", extra={"revision": self.approved})
            self.previous = [r for r in self.previous if r != self.approved] + [self.approved]
            if self.metrics is not None:
                self.metrics.revision_approved.labels(self.approved).set(0)
            self.approved = None
        live = {w.revision for w in self.registry.all()}
        self.previous = [r for r in self.previous if r in live]

    # -- routing ------------------------------------------------------------------------------

    def current(self) -> str | None:
        """The approved revision, approving the first revision with a healthy pair when none is."""
        if self.approved is None:
            paired = _paired(self.registry)
            if paired:
                self.approve(paired[0], reason="first revision with a healthy pair")
        return self.approved

    def narrow(
        self, prefills: list[Worker], decodes: list[Worker], exclude: list[Worker]
    ) -> tuple[list[Worker], list[Worker], str, Route]:
        """The prefills and decodes (those with room) of the revision this request goes to, that revision
        and the route; raises PinnedWithoutPair / NoApprovedPair, or WorkerAtCapacity when the revision's
        healthy pair has no room."""
        pinned = pinned_revision.get()
        route: Route
        if pinned is not None:
            revision, route = pinned, "pinned"
        else:
            approved = self.current()
            if approved is None:  # no revision has a healthy pair: the picker's own error says which role
                return prefills, decodes, "", "client"
            revision, route = approved, "client"
            if self.canary_share and self._rng.random() < self.canary_share:
                candidates = sorted(
                    {p.revision for p in prefills} & {d.revision for d in decodes} - {approved, *self.previous}
                )
                if candidates:
                    revision, route = self._rng.choice(candidates), "canary"
        narrowed_p = [w for w in prefills if w.revision == revision]
        narrowed_d = [w for w in decodes if w.revision == revision]
        if not narrowed_p or not narrowed_d:
            paired = _paired(self.registry, exclude)
            if revision in paired:
                raise WorkerAtCapacity("decode" if narrowed_p else "prefill")
            if route == "pinned":
                raise PinnedWithoutPair(revision, paired)
            raise NoApprovedPair(revision, [r for r in paired if r != revision])
        return narrowed_p, narrowed_d, revision, route

    def routed(self, revision: str, route: Route) -> None:
        """Count a pair picked for `revision` by `route`."""
        if self.metrics is None:
            return
        child = self._routed.get((revision, route))
        if child is None:
            child = self._routed[revision, route] = self.metrics.revision_traffic.labels(revision, route)
        child.inc()

    # -- the admin API's view -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """Every registered revision: its state, workers (healthy of registered) and requests in flight. It approves
        nothing: until a request or an admin approves one, `approved` is null."""
        approved = self.approved
        by_revision: dict[str, list[Worker]] = {}
        for worker in self.registry.all():
            by_revision.setdefault(worker.revision, []).append(worker)
        paired = set(_paired(self.registry))
        revisions = []
        for revision, workers in by_revision.items():
            in_flight = sum(w.in_flight for w in workers)
            if revision == approved:
                state = "approved"
            elif revision in self.previous:
                state = "draining" if in_flight else "drained"
            else:
                state = "candidate"
            revisions.append(
                {
                    "revision": revision,
                    "state": state,
                    "paired": revision in paired,
                    "prefill": [w.url for w in workers if w.role == "prefill"],
                    "decode": [w.url for w in workers if w.role == "decode"],
                    "healthy": sum(w.healthy for w in workers),
                    "in_flight": in_flight,
                }
            )
        return {"approved": approved, "canary_share": self.canary_share, "revisions": revisions}

    def approvable(self, revision: str) -> str | None:
        """Why `revision` cannot be approved now (None: it can): it needs a healthy pair."""
        paired = _paired(self.registry)
        if revision in paired:
            return None
        shown = ", ".join(sorted(_name(r) for r in paired)) or "none"
        return (
            f"Revision {_name(revision)} has no healthy prefill and decode pair, so approving it would leave client "
            f"requests without one (revisions with a pair: {shown}). Wait until GET /admin/revisions shows it paired."
        )
