from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import RoutingRequest, SampledPolicy

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["PowerOfTwo"]


class PowerOfTwo(SampledPolicy):
    """Sample two workers at random and take the one with fewer requests in flight."""

    name = "power_of_two"

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(range(len(workers)), 2)
        wa, wb = workers[a], workers[b]
        return wa if wa.in_flight <= wb.in_flight else wb
