"""Pairs within one revision: a prefill's KV goes only to a decode of the prefill's revision.

A worker's revision (deploy/spec/revision.py) hashes what decides KV compatibility and behaviour: the image,
sglang's version, the model and both roles' rendered settings. During an upgrade both revisions serve at once;
a prefill of the new one must not send its KV to a decode of the old, whose layout or flags may differ, so the
picker narrows its candidates here (pairs.py). A worker whose revision is unknown ("", e.g. a static worker
given without one) pairs only with workers whose revision is unknown too.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..exceptions import NoHealthyWorker, WorkerAtCapacity
from ..metrics import RouterMetrics
from .registry import Worker, WorkerRegistry

__all__ = ["NoRevisionPair", "paired_prefills", "record_pair", "same_revision"]


class NoRevisionPair(NoHealthyWorker):
    """Prefill and decode workers are healthy, but no revision has both (answered as NoHealthyWorker is)."""

    def __init__(self, prefill: Iterable[str], decode: Iterable[str]) -> None:
        super().__init__("decode")
        self.args = (
            f"No prefill and decode worker of one revision is healthy (prefill revisions {_shown(prefill)}, "
            f"decode revisions {_shown(decode)}): a prefill sends its KV only to a decode of its own revision. "
            "Check `GET /workers` and the rollout (docs/upgrades.md).",
        )


def _shown(revisions: Iterable[str]) -> str:
    return ", ".join(sorted(r or "(unknown)" for r in set(revisions))) or "none"


def _revisions(workers: Iterable[Worker]) -> set[str]:
    return {w.revision for w in workers}


def paired_prefills(
    prefills: list[Worker], decodes: list[Worker], registry: WorkerRegistry, exclude: list[Worker]
) -> list[Worker]:
    """The prefills among `prefills` that have a decode of their revision among `decodes` (the workers with
    room). None: WorkerAtCapacity when healthy workers of a shared revision exist but have no room (the
    request may wait for it), else NoRevisionPair."""
    shared = _revisions(prefills) & _revisions(decodes)
    if shared:
        return [p for p in prefills if p.revision in shared]
    healthy_p, healthy_d = registry.available("prefill", exclude), registry.available("decode", exclude)
    if _revisions(healthy_p) & _revisions(healthy_d):
        raise WorkerAtCapacity("decode")
    raise NoRevisionPair(_revisions(healthy_p), _revisions(healthy_d))


def same_revision(decodes: list[Worker], prefill: Worker) -> list[Worker]:
    """The decodes that may take `prefill`'s KV."""
    return [d for d in decodes if d.revision == prefill.revision]


def record_pair(metrics: RouterMetrics | None, prefill: Worker, decode: Worker) -> None:
    """Count a picked pair by its revision, and a pair across revisions, which must never happen."""
    if metrics is None:
        return
    metrics.revision_requests.labels(prefill.revision).inc()
    if prefill.revision != decode.revision:
        metrics.cross_revision_pairs.inc()
