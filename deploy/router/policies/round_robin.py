from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import RotatingPolicy, RoutingRequest

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["RoundRobin"]


class RoundRobin(RotatingPolicy):
    """Each worker in turn."""

    name = "round_robin"

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return workers[next(self._counter) % len(workers)]
