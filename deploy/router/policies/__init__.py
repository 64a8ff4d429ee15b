"""Routing policies, one file each, behind the `Policy` protocol (`select(workers, request)`,
`forget(worker)`); their names are `contract.POLICIES`."""

from __future__ import annotations

from sglang_pd.deploy.common.contract import POLICIES

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

_POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (RoundRobin, Random, PowerOfTwo, LeastLoad, CacheAware)}
assert set(_POLICIES) == set(POLICIES), "every name in contract.POLICIES has exactly one class"


def make_policy(name: str) -> Policy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"Unknown policy {name!r}. Use one of: {', '.join(POLICIES)}.") from None
