from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Policy, RoutingRequest

if TYPE_CHECKING:
    from ..workers import Worker

__all__ = ["RoundRobin"]


class RoundRobin(Policy):
    name = "round_robin"
    needs_text = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return workers[next(self._counter) % len(workers)]
