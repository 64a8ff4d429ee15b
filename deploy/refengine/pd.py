"""The PD handshake between a prefill and a decode reference engine.

As in sglang, the decode engine allocates pages for the prompt in its registered pool and tells
the prefill engine's bootstrap server where they are; the prefill engine writes the prompt's KV
pages into them through Mooncake (prefill pushes), then answers with the first output token and
a crc32 of the KV it sent. sglang carries that step over ZMQ; here it is one long-poll HTTP call
to the bootstrap port (`POST /kv/claim`), so a decode engine that dies drops the call, and
`POST /kv/cancel` lets an aborted decode request take its pages back safely (the call returns
only once no write into them can still be in flight).

A room is held from the first of its two halves (the prefill request, the decode's claim) to the
end of the last: it is released on success, on failure, on abort and on a half that never comes
(the other waits the bootstrap timeout, as sglang's `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`).
A room given up before its other half arrived is remembered for a while, so that the late half
fails at once instead of holding a new room for the whole timeout.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .exceptions import ClaimRejected

__all__ = ["Claim", "ClaimRejected", "Room", "RoomTable"]


@dataclass
class Claim:
    """What a decode engine sends for one room."""

    room: int
    session_id: str  # the decode engine's Mooncake session
    layout: dict[str, Any]  # its PagedLayout (layer bases, page bytes, pages)
    dst_pages: list[int]
    prompt_tokens: int
    page_size: int
    weights_digest: str
    rid: str = ""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Claim:
        return cls(
            room=int(d["room"]),
            session_id=str(d["session_id"]),
            layout=dict(d["layout"]),
            dst_pages=[int(p) for p in d["dst_pages"]],
            prompt_tokens=int(d["prompt_tokens"]),
            page_size=int(d["page_size"]),
            weights_digest=str(d["weights_digest"]),
            rid=str(d.get("rid", "")),
        )


@dataclass
class Room:
    id: int
    claim: asyncio.Future[Claim]
    result: asyncio.Future[dict[str, Any]]
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set once the prefill request for the room is here (it may still queue behind other prompts).
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    created: float = field(default_factory=time.monotonic)
    prefill_done: bool = False  # the prefill request came and ended
    decode_done: bool = False  # the decode's claim came and was answered


# Room ids given up before their other half came, remembered this many at most.
_REMEMBERED_ROOMS = 4096


class RoomTable:
    """Rooms in flight on a prefill engine: whichever half arrives first waits for the other.

    `ttl_s`: a room older than this is dropped whatever its state (a backstop: every path releases
    its room itself). `remember_s`: how long a room given up early stays known as closed."""

    def __init__(self, *, ttl_s: float = 900.0, remember_s: float = 300.0) -> None:
        self.ttl_s = ttl_s
        self.remember_s = remember_s
        self._rooms: dict[int, Room] = {}
        self._closed: OrderedDict[int, tuple[float, ClaimRejected]] = OrderedDict()

    def __len__(self) -> int:
        """The rooms held now."""
        self._sweep()
        return len(self._rooms)

    def _sweep(self) -> None:
        now = time.monotonic()
        for k in [k for k, v in self._rooms.items() if now - v.created > self.ttl_s]:
            room = self._rooms.pop(k)
            room.cancelled = True
            self.fail(room, ClaimRejected(f"Bootstrap room {k} expired after {self.ttl_s:.0f} s.", 504))
        while self._closed and now - next(iter(self._closed.values()))[0] > self.remember_s:
            self._closed.popitem(last=False)

    def _open(self, room_id: int) -> Room:
        self._sweep()
        closed = self._closed.get(room_id)
        if closed is not None:
            raise closed[1]
        room = self._rooms.get(room_id)
        if room is None:
            loop = asyncio.get_running_loop()
            room = self._rooms[room_id] = Room(room_id, loop.create_future(), loop.create_future())
        return room

    def peek(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

    def join_prefill(self, room_id: int) -> Room:
        """The prefill request for `room_id` is here; raises ClaimRejected if the decode gave the room up."""
        room = self._open(room_id)
        if room.arrived.is_set():
            raise ClaimRejected(f"Bootstrap room {room_id} already has a prefill request.", 409)
        room.arrived.set()
        return room

    def join_decode(self, claim: Claim) -> Room:
        """The decode's claim of a room is here; raises ClaimRejected if the room was claimed or
        its prefill request ended without it."""
        room = self._open(claim.room)
        if room.claim.done():
            raise ClaimRejected(f"Bootstrap room {claim.room} was already claimed.", 409)
        room.claim.set_result(claim)
        return room

    def leave_prefill(self, room: Room) -> None:
        """The prefill request ended (sent the KV, failed or was aborted)."""
        room.prefill_done = True
        if not room.claim.done():  # no decode came: a late claim learns why at once
            self._close(room, "its prefill request ended before the decode engine claimed it")
        elif room.decode_done:
            self._drop(room)

    def leave_decode(self, room: Room) -> None:
        """The decode's claim was answered (or given up)."""
        room.decode_done = True
        if not room.result.done():
            room.cancelled = True  # nobody takes the KV any more: the prefill must not write it
        if not room.arrived.is_set():  # no prefill came: a late one learns why at once
            self._close(room, "the decode engine gave it up before its prefill request arrived")
        elif room.prefill_done:
            self._drop(room)

    def close_unclaimed(self, room_id: int) -> None:
        """The decode gave up `room_id` before claiming it: its prefill request, if it comes, fails at once."""
        if room_id not in self._rooms:
            self._remember(room_id, "the decode engine cancelled it")

    def _close(self, room: Room, why: str) -> None:
        self._drop(room)
        self._remember(room.id, why)

    def _remember(self, room_id: int, why: str) -> None:
        self._closed[room_id] = (time.monotonic(), ClaimRejected(f"Bootstrap room {room_id} is closed: {why}.", 410))
        while len(self._closed) > _REMEMBERED_ROOMS:
            self._closed.popitem(last=False)

    def _drop(self, room: Room) -> None:
        if self._rooms.get(room.id) is room:
            del self._rooms[room.id]

    async def wait_claim(self, room: Room, timeout_s: float) -> Claim:
        try:
            async with asyncio.timeout(timeout_s):
                claim = await asyncio.shield(room.claim)
        except TimeoutError:
            raise ClaimRejected(
                f"No decode engine claimed bootstrap room {room.id} within {timeout_s:.0f} s; is the decode engine "
                "running and able to reach this bootstrap port?",
                status=504,
            ) from None
        if room.cancelled:
            raise ClaimRejected(f"The decode engine cancelled bootstrap room {room.id}.", status=499)
        return claim

    def fail(self, room: Room, exc: BaseException) -> None:
        """Fail the room's result; a decode waiting on it gets the error at once."""
        if not room.result.done():
            room.result.set_exception(exc)
            room.result.exception()  # mark retrieved: the decode side may already be gone
