from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import RoutingRequest, SampledPolicy

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["Random"]


class Random(SampledPolicy):
    """Any worker, uniformly."""

    name = "random"

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return workers[self._rng.randrange(len(workers))]
