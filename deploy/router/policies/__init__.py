"""Routing policies, one file each, behind the `Policy` protocol (`select(workers, request)`)."""

from __future__ import annotations

from .base import Policy, RoutingRequest
from .cache_aware import CacheAware
from .least_load import LeastLoad
from .power_of_two import PowerOfTwo
from .random import Random
from .round_robin import RoundRobin

__all__ = [
    "CacheAware",
    "LeastLoad",
    "Policy",
    "PowerOfTwo",
    "Random",
    "RoundRobin",
    "RoutingRequest",
    "make_policy",
]

_POLICIES: dict[str, type[Policy]] = {
    "round_robin": RoundRobin,
    "random": Random,
    "power_of_two": PowerOfTwo,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
}


def make_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"Unknown policy {name!r}. Use one of: {', '.join(_POLICIES)}.") from None
