"""Pair selection: the routing policies pick a (prefill, decode) pair among the available workers
that have room for the request (`capacity.py`; WorkerAtCapacity when the healthy ones have none),
then the bootstrap fields are chosen for it (rooms on prefill DP ranks by prefix and load,
`bootstrap.py`) and the two legs' bodies written. The prompt's text is only extracted when a
policy or the prefill's DP ranks need it."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Any

from ..api.validation import batch_size, routing_text
from ..exceptions import NoHealthyWorker, WorkerAtCapacity
from ..metrics import RouterMetrics
from ..pd.bootstrap import PDBodies, choose_rooms, pd_bodies, prefix_rank
from ..policies import Policy, RoutingRequest
from ..types import Role
from .capacity import Demand, Reservation, has_room
from .registry import Worker, WorkerRegistry
from .revisions import paired_prefills, record_pair, same_revision
from .rollout import Rollout

__all__ = ["Pair", "PairPicker"]


@dataclass(slots=True)
class Pair:
    """The prefill and decode worker of one attempt, with the bodies they are sent and, once the
    proxy made it, its reservation of their capacity."""

    prefill: Worker
    decode: Worker
    bodies: PDBodies
    dp_ranks: list[int]
    reservation: Reservation | None = None

    def release_ranks(self, _: object = None) -> None:
        """The prefill leg ended: its DP ranks have one request less in flight (a done callback)."""
        counts = self.prefill.dp_in_flight
        for rank in self.dp_ranks:
            # The counts start again at 0 when the worker reports another DP size (`set_dp_size`),
            # so a rank picked before may be gone, or already at 0.
            if rank < len(counts):
                counts[rank] = max(0, counts[rank] - 1)


class PairPicker:
    def __init__(
        self,
        registry: WorkerRegistry,
        prefill_policy: Policy,
        decode_policy: Policy,
        metrics: RouterMetrics | None = None,
        rollout: Rollout | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        # Which revision a request goes to while two are healthy (rollout.py).
        self.rollout = rollout if rollout is not None else Rollout(registry, metrics=metrics)
        self.policies: dict[Role, Policy] = {"prefill": prefill_policy, "decode": decode_policy}
        self._needs_text = prefill_policy.needs_text or decode_policy.needs_text
        self._rng = random.Random()
        self._dp_counter = itertools.count()
        registry.subscribe(self._on_change)

    def _on_change(self, event: str, worker: Worker) -> None:
        # A departed worker's routing state (e.g. cache_aware's prefix tree) must not outlive it.
        if event == "removed":
            self.policies[worker.role].forget(worker)

    def pick(
        self, endpoint: str, payload: dict[str, Any], rid: str, exclude: list[Worker], demand: Demand | None = None
    ) -> Pair:
        """Select a pair with the policies among the workers with room for `demand` (None: any) and
        write the legs' bodies; raises NoHealthyWorker, or WorkerAtCapacity when healthy workers of
        a role have no room."""
        prefills = self._with_room("prefill", exclude, demand)
        decodes = self._with_room("decode", exclude, demand)
        # The approved revision's workers, or those of the revision the request is pinned to or its canary share
        # picked, then pairs within that revision.
        prefills, decodes, revision, route = self.rollout.narrow(prefills, decodes, exclude)
        prefills = paired_prefills(prefills, decodes, self.registry, exclude)
        text = routing_text(payload) if self._needs_text else None
        request = RoutingRequest(text=text or "")
        prefill = self.policies["prefill"].select(prefills, request)
        decode = self.policies["decode"].select(same_revision(decodes, prefill), request)
        record_pair(self.metrics, prefill, decode)
        self.rollout.routed(revision or prefill.revision, route)
        batch = batch_size(endpoint, payload)
        preferred = None
        if prefill.dp_size > 1:
            preferred = prefix_rank(routing_text(payload) if text is None else text, prefill.dp_size)
        rooms, ranks = choose_rooms(
            1 if batch is None else batch, self._rng, dp_in_flight=prefill.dp_in_flight,
            start=next(self._dp_counter), preferred=preferred,
        )  # fmt: skip
        for rank in ranks:
            prefill.dp_in_flight[rank] += 1
        bodies = pd_bodies(
            payload, host=prefill.bootstrap_host, port=prefill.bootstrap_port, rooms=rooms, ranks=ranks,
            rid=rid, batch=batch,
        )  # fmt: skip
        return Pair(prefill, decode, bodies, ranks)

    def _with_room(self, role: Role, exclude: list[Worker], demand: Demand | None) -> list[Worker]:
        workers = self.registry.available(role, exclude)
        if not workers:
            raise NoHealthyWorker(role)
        if demand is None:
            return workers
        roomy = [w for w in workers if has_room(w, demand.slots, demand.tokens_on(w))]
        if not roomy:
            raise WorkerAtCapacity(role)
        return roomy
