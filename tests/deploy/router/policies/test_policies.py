from __future__ import annotations

from collections import Counter

import pytest

from sglang_pd.deploy.router.policies import (
    CacheAware,
    LeastLoad,
    Policy,
    PowerOfTwo,
    Random,
    RoundRobin,
    RoutingRequest,
    make_policy,
)
from sglang_pd.deploy.router.workers.breaker import CircuitBreaker
from sglang_pd.deploy.router.workers.registry import Worker


def _workers(n: int, role: str = "prefill") -> list[Worker]:
    return [
        Worker(url=f"http://10.0.0.{i}:30000", role=role, breaker=CircuitBreaker(failure_threshold=3, cooldown_s=1))  # type: ignore[arg-type]
        for i in range(n)
    ]


@pytest.mark.parametrize("name", ["round_robin", "random", "power_of_two", "least_load", "cache_aware"])
def test_every_policy_implements_the_protocol(name: str) -> None:
    policy = make_policy(name)
    assert isinstance(policy, Policy)
    assert policy.name == name
    workers = _workers(3)
    assert policy.select(workers, RoutingRequest(text="hello")) in workers


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


def test_round_robin_cycles() -> None:
    workers = _workers(3)
    policy = RoundRobin()
    picks = [policy.select(workers, RoutingRequest()) for _ in range(6)]
    assert picks == workers + workers


def test_random_spreads() -> None:
    workers = _workers(4)
    policy = Random(seed=1)
    counts = Counter(policy.select(workers, RoutingRequest()).url for _ in range(2000))
    assert len(counts) == 4 and min(counts.values()) > 350


def test_power_of_two_prefers_the_less_loaded_of_two() -> None:
    workers = _workers(2)
    workers[0].in_flight = 10
    policy = PowerOfTwo(seed=0)
    assert all(policy.select(workers, RoutingRequest()) is workers[1] for _ in range(20))


def test_least_load_picks_minimum_and_rotates_ties() -> None:
    workers = _workers(3)
    workers[0].in_flight = 5
    policy = LeastLoad()
    picks = {policy.select(workers, RoutingRequest()).url for _ in range(6)}
    assert picks == {workers[1].url, workers[2].url}
    workers[1].in_flight = 1
    assert policy.select(workers, RoutingRequest()) is workers[2]


def test_cache_aware_keeps_prefix_affinity() -> None:
    workers = _workers(4)
    policy = CacheAware(block_chars=8, cache_threshold=0.5)
    system = "You are a helpful assistant. " * 8
    first = policy.select(workers, RoutingRequest(text=system + "question one"))
    for i in range(10):
        # Same long prefix, different tails: stays on the worker that has the prefix cached.
        assert policy.select(workers, RoutingRequest(text=system + f"question {i} " * 2)) is first


def test_cache_aware_spreads_unrelated_prompts() -> None:
    workers = _workers(4)
    policy = CacheAware(block_chars=8)
    picks = {policy.select(workers, RoutingRequest(text=f"{i} unrelated prompt number {i} " * 4)).url for i in range(8)}
    assert len(picks) == 4


def test_cache_aware_yields_to_load_imbalance() -> None:
    workers = _workers(2)
    policy = CacheAware(block_chars=8, balance_abs_threshold=4, balance_rel_threshold=1.5)
    text = "shared prefix for everyone " * 8
    cached = policy.select(workers, RoutingRequest(text=text))
    other = workers[1] if cached is workers[0] else workers[0]
    cached.in_flight = 20
    assert policy.select(workers, RoutingRequest(text=text)) is other


def test_forget_frees_a_workers_prefix_tree() -> None:
    workers = _workers(2)
    policy = CacheAware(block_chars=8)
    chosen = policy.select(workers, RoutingRequest(text="a long shared prompt prefix " * 4))
    assert policy.remembers(chosen)
    policy.forget(chosen)
    assert not policy.remembers(chosen)
    for name in ("round_robin", "random", "power_of_two", "least_load"):
        make_policy(name).forget(chosen)  # stateless policies accept it too
