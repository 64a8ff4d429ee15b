"""The PD bootstrap fields, as pure functions: bootstrap rooms, the prefill DP rank a room lands
on, and the two legs' request bodies (docs/pd-protocol.md).

The router adds `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (lists for a batch
`/generate`) and its own `rid` (`request_ids.py`) to the client's body and sends the same body to
both legs. With prefill DP attention, decode finds the prefill's DP rank as
`bootstrap_room % dp_size`, so a router that routes to a rank (`routed_dp_rank`, prefill leg
only) must pick a room that agrees with it.

A rank is chosen by prefix, then by load: each DP rank keeps its own prefix cache, so requests
whose prompts start alike go to the same rank (`prefix_rank`, a hash of the prompt's first
`PREFIX_CHARS` characters), unless that rank has more than `AFFINITY_SLACK` requests in flight
beyond the least-loaded one; then, and without a prompt text, the least-loaded rank. The hash is
CRC-32, not Python's `hash()`, which differs per process: every serving process of a router
group, and every router replica, maps a prefix to the same rank.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["AFFINITY_SLACK", "MAX_ROOM", "PREFIX_CHARS", "PDBodies", "choose_rooms", "pd_bodies", "prefix_rank"]

MAX_ROOM = 2**63 - 1
# The prompt characters that pick a prefix's rank: one block of the cache_aware policy
# (`policies/cache_aware.py`), so turns of a conversation that share their start share a rank.
PREFIX_CHARS = 64
# Requests in flight a prefix's rank may have beyond the least-loaded one before it is passed over.
AFFINITY_SLACK = 4


def prefix_rank(text: str, dp_size: int) -> int | None:
    """The DP rank for prompts that start as `text` does; None without a text."""
    if not text:
        return None
    return zlib.crc32(text[:PREFIX_CHARS].encode("utf-8", "surrogatepass")) % dp_size


def _least_loaded(in_flight: Sequence[int], start: int) -> int:
    """The rank with the fewest requests in flight; ties go to the first from `start` on, so idle
    ranks take turns."""
    n = len(in_flight)
    return min(((start + i) % n for i in range(n)), key=in_flight.__getitem__)


def _room_on_rank(room: int, rank: int, dp_size: int) -> int:
    """The room nearest below `room` with `room % dp_size == rank`, kept within 0..MAX_ROOM."""
    room = room - room % dp_size + rank
    return room - dp_size if room > MAX_ROOM else room


def choose_rooms(
    count: int,
    rng: random.Random,
    *,
    dp_in_flight: Sequence[int] = (0,),
    start: int = 0,
    preferred: int | None = None,
) -> tuple[list[int], list[int]]:
    """`count` random rooms and, for a prefill with DP attention (len(dp_in_flight) > 1), the rank
    each lands on: `preferred` (the prompt's `prefix_rank`) unless it is overloaded, else the
    least-loaded rank, counting the ranks picked before it. Returns (rooms, ranks); ranks is empty
    without DP attention."""
    dp_size = len(dp_in_flight)
    rooms = [rng.randint(0, MAX_ROOM) for _ in range(count)]
    if dp_size <= 1:
        return rooms, []
    loads = list(dp_in_flight)
    ranks = []
    for i in range(count):
        rank = _least_loaded(loads, start + i)
        if preferred is not None and loads[preferred] - loads[rank] <= AFFINITY_SLACK:
            rank = preferred
        loads[rank] += 1
        ranks.append(rank)
        rooms[i] = _room_on_rank(rooms[i], rank, dp_size)
    return rooms, ranks


@dataclass(frozen=True, slots=True)
class PDBodies:
    """The two legs' bodies and the request ids the workers will know the request by."""

    prefill: bytes
    decode: bytes
    rids: list[str]


def pd_bodies(
    payload: dict[str, Any],
    *,
    host: str,
    port: int | None,
    rooms: list[int],
    ranks: list[int],
    rid: str,
    batch: int | None,
) -> PDBodies:
    """The client's body plus the bootstrap fields and `rid` (per prompt for a batch of `batch`);
    the prefill's body also carries `routed_dp_rank` when ranks were chosen."""
    body = dict(payload)
    # `rid` replaces any the client sent: the engines abort by it, so it must be the router's.
    if batch is None:
        rids = [rid]
        body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=rooms[0], rid=rid)
    else:
        rids = [f"{rid}-{i}" for i in range(batch)]
        body.update(bootstrap_host=[host] * batch, bootstrap_port=[port] * batch, bootstrap_room=rooms, rid=rids)
    decode = orjson.dumps(body)
    if not ranks:
        return PDBodies(decode, decode, rids)
    body["routed_dp_rank"] = ranks[0] if batch is None else ranks
    return PDBodies(orjson.dumps(body), decode, rids)
