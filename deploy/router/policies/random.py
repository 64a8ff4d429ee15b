from __future__ import annotations

import random as _random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Policy, RoutingRequest

if TYPE_CHECKING:
    from ..workers import Worker

__all__ = ["Random"]


class Random(Policy):
    name = "random"
    needs_text = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        return workers[self._rng.randrange(len(workers))]
