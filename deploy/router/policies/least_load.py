from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import RotatingPolicy, RoutingRequest

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["LeastLoad"]


class LeastLoad(RotatingPolicy):
    """The worker with the fewest requests in flight; ties rotate so idle workers share load."""

    name = "least_load"

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        n = len(workers)
        start = next(self._counter) % n
        best = workers[start]
        for i in range(1, n):
            w = workers[(start + i) % n]
            if w.in_flight < best.in_flight:
                best = w
        return best
