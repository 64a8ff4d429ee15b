"""A per-worker circuit breaker: closed → open after N consecutive failures → half-open probe.
Every change of state is logged (warning when it opens), with the worker it guards.

What a failure is, is the caller's call (`legs.Legs`): a transport error or a timeout at once, a
5xx only once a health probe of the worker confirms it (a 5xx that one request causes while the
worker keeps serving must not turn every other client away). 4xx answers are never failures."""

from __future__ import annotations

import enum
import logging
import time

from ..log import logger

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(enum.IntEnum):
    CLOSED = 0  # requests flow; failures are counted
    HALF_OPEN = 1  # the cooldown passed; one probe request is let through
    OPEN = 2  # the worker is skipped until the cooldown passes


class CircuitBreaker:
    """Counts consecutive failures of one worker (see the module docstring for what counts)."""

    def __init__(self, *, failure_threshold: int, cooldown_s: float, name: str = "") -> None:
        self.name = name  # the worker it guards, for the log
        self.failure_threshold = max(1, failure_threshold)
        self.cooldown_s = cooldown_s
        self.state = BreakerState.CLOSED
        self.failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    def can_dispatch(self, now: float | None = None) -> bool:
        """Whether a request may go to this worker now (no state change)."""
        if self.state is BreakerState.CLOSED:
            return True
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            return now - self._opened_at >= self.cooldown_s
        return not self._probe_in_flight

    def on_dispatch(self, now: float | None = None) -> None:
        """Called when a request was sent to this worker; an open breaker past its cooldown
        turns half-open and this request is its probe."""
        if self.state is BreakerState.CLOSED:
            return
        now = time.monotonic() if now is None else now
        if self.state is BreakerState.OPEN and now - self._opened_at >= self.cooldown_s:
            self._become(BreakerState.HALF_OPEN)
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def record_success(self) -> None:
        self.failures = 0
        self._probe_in_flight = False
        self._become(BreakerState.CLOSED)

    def release_probe(self) -> None:
        """The half-open probe request ended with no verdict on the worker (a 5xx that a health
        probe showed to be the request's own doing): let the next request probe instead."""
        self._probe_in_flight = False

    def record_failure(self, now: float | None = None) -> None:
        self.failures += 1
        self._probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self._become(BreakerState.OPEN)
            self._opened_at = time.monotonic() if now is None else now

    def _become(self, state: BreakerState) -> None:
        if state is self.state:
            return
        level = logging.WARNING if state is BreakerState.OPEN else logging.INFO
        logger.log(
            level,
            f"circuit breaker {self.state.name.lower()} -> {state.name.lower()}",
            extra={"worker": self.name, "failures": self.failures, "cooldown_s": self.cooldown_s},
        )
        self.state = state

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self.state.name}, failures={self.failures})"
