from __future__ import annotations

from sglang_pd.deploy.router.workers.breaker import BreakerState, CircuitBreaker


def test_opens_after_consecutive_failures_and_probes_after_cooldown() -> None:
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=10)
    breaker.record_failure(now=0)
    breaker.record_failure(now=0)
    assert breaker.state is BreakerState.CLOSED and breaker.can_dispatch(0)
    breaker.record_failure(now=1)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_dispatch(5)
    assert breaker.can_dispatch(11)
    breaker.on_dispatch(11)
    assert breaker.state is BreakerState.HALF_OPEN
    assert not breaker.can_dispatch(11), "only one probe at a time"
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.failures == 0


def test_failed_probe_reopens() -> None:
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1)
    breaker.record_failure(now=0)
    breaker.on_dispatch(2)
    breaker.record_failure(now=2)
    assert breaker.state is BreakerState.OPEN
    assert not breaker.can_dispatch(2.5)
    assert breaker.can_dispatch(3.1)


def test_success_resets_the_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1)
    breaker.record_failure(now=0)
    breaker.record_success()
    breaker.record_failure(now=0)
    assert breaker.state is BreakerState.CLOSED
