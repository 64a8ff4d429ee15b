"""The policy seam: `select(workers, request) -> worker`, and `forget(worker)` when a worker
leaves the registry (the registry's removal, from the admin API or from discovery, calls it)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["Policy", "RotatingPolicy", "RoutingRequest", "SampledPolicy"]


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may look at. `text` is filled only for policies with `needs_text`."""

    text: str = ""


@runtime_checkable
class Policy(Protocol):
    name: str
    needs_text: bool

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        """Pick one of `workers` (never empty) for `request`."""
        ...

    def forget(self, worker: Worker) -> None:
        """Drop what the policy keeps about `worker`, which has left. Stateless policies keep
        nothing: they inherit this no-op by subclassing Policy."""
        return None


class RotatingPolicy(Policy):
    """A load-only policy that starts each pick one worker further (ties rotate)."""

    needs_text = False

    def __init__(self) -> None:
        self._counter = itertools.count()


class SampledPolicy(Policy):
    """A load-only policy that picks at random; `seed` makes it repeatable."""

    needs_text = False

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
