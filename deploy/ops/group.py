"""The pods of one LeaderWorkerSet group: their addresses, and waiting for the leader before a rank joins it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

__all__ = ["GroupWaitError", "group_hosts", "resolve_all", "wait_for_leader"]

# How long a rank > 0 waits for its leader's rendezvous port: LeaderWorkerSet's LeaderCreated start
# policy starts the workers while the leader may still pull a multi-GB image, and sglang gives up after
# its own receive timeout (600 s; kubernetes-sigs/lws#746), which then restarts the whole group.
DEFAULT_LEADER_WAIT_S = 1800.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 15.0


class GroupWaitError(RuntimeError):
    """A group's pod did not become reachable in time; the message names it and what to check."""


def group_hosts(leader_address: str, size: int) -> list[str]:
    """The DNS names of a group's pods from its leader's: LWS names the leader pod `<set>-<group>` and
    worker `i` `<set>-<group>-<i>`, each resolvable under the set's headless Service
    (https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/)."""
    leader, dot, domain = leader_address.partition(".")
    return [leader_address] + [f"{leader}-{i}{dot}{domain}" for i in range(1, size)]


def _backoff(
    attempt: Callable[[], str | None], deadline_s: float, sleep: Callable[[float], None], clock: Callable[[], float]
) -> str | None:
    """Call `attempt` until it returns None (done), with doubling delays; the last problem when time runs out."""
    end, delay = clock() + deadline_s, FIRST_DELAY_S
    while True:
        problem = attempt()
        if problem is None or clock() + delay > end:
            return problem
        sleep(delay)
        delay = min(delay * 2, MAX_DELAY_S)


def resolve_all(
    hosts: list[str],
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Every host's IP address, waiting (with back-off) for pods not yet scheduled; GroupWaitError after
    `timeout_s`."""
    found: dict[str, str] = {}

    def attempt() -> str | None:
        for host in hosts:
            if host in found:
                continue
            try:
                found[host] = str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
            except OSError as exc:
                return f"{host} does not resolve ({exc})"
        return None

    problem = _backoff(attempt, timeout_s, sleep, clock)
    if problem is not None:
        raise GroupWaitError(
            f"{problem} after {timeout_s:.0f} s: a pod of this group has no address yet (unscheduled? "
            "`kubectl get pods -l leaderworkerset.sigs.k8s.io/name=...`); raise SGLANG_PD_GROUP_WAIT_S to wait longer."
        )
    return [found[h] for h in hosts]


def wait_for_leader(
    host: str,
    port: int,
    timeout_s: float = DEFAULT_LEADER_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once the leader accepts TCP connections on its rendezvous `port` (its sglang has started);
    GroupWaitError naming the leader after `timeout_s`."""

    def attempt() -> str | None:
        try:
            with socket.create_connection((host, port), timeout=5.0):
                return None
        except OSError as exc:
            return f"the group's leader {host}:{port} does not accept connections ({exc})"

    problem = _backoff(attempt, timeout_s, sleep, clock)
    if problem is not None:
        raise GroupWaitError(
            f"{problem} after {timeout_s:.0f} s: the leader pod has not started sglang (still pulling its image or "
            "loading? `kubectl describe pod` it); raise SGLANG_PD_GROUP_WAIT_S to wait longer."
        )
