"""The PD handshake between a prefill and a decode reference engine.

As in sglang, the decode engine allocates pages for the prompt in its registered pool and tells
the prefill engine's bootstrap server where they are; the prefill engine writes the prompt's KV
pages into them through Mooncake (prefill pushes), then answers with the first output token and
a crc32 of the KV it sent. sglang carries that step over ZMQ; here it is one long-poll HTTP call
to the bootstrap port (`POST /kv/claim`), so a decode engine that dies drops the call, and
`POST /kv/cancel` lets an aborted decode request take its pages back safely (the call returns
only once no write into them can still be in flight).
"""

from __future__ import annotations

import asyncio
import time
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
    claim: asyncio.Future[Claim]
    result: asyncio.Future[dict[str, Any]]
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set once the prefill request for the room is here (it may still queue behind other prompts).
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    created: float = field(default_factory=time.monotonic)


class RoomTable:
    """Rooms in flight on a prefill engine: whichever side arrives first waits for the other."""

    def __init__(self) -> None:
        self._rooms: dict[int, Room] = {}

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int, *, ttl_s: float = 300.0) -> Room:
        now = time.monotonic()
        for k in [k for k, v in self._rooms.items() if now - v.created > ttl_s]:
            self.fail(k, ClaimRejected(f"Bootstrap room {k} expired.", 504))
            del self._rooms[k]
        r = self._rooms.get(room)
        if r is None:
            loop = asyncio.get_running_loop()
            r = self._rooms[room] = Room(loop.create_future(), loop.create_future())
        return r

    def drop(self, room: int) -> None:
        self._rooms.pop(room, None)

    async def wait_claim(self, room: int, timeout_s: float) -> tuple[Room, Claim]:
        r = self.get(room)
        try:
            claim = await asyncio.wait_for(asyncio.shield(r.claim), timeout_s)
        except TimeoutError:
            raise ClaimRejected(
                f"No decode engine claimed bootstrap room {room} within {timeout_s:.0f} s; is the decode engine "
                "running and able to reach this bootstrap port?",
                status=504,
            ) from None
        if r.cancelled:
            raise ClaimRejected(f"The decode engine cancelled bootstrap room {room}.", status=499)
        return r, claim

    def fail(self, room: int, exc: BaseException) -> None:
        """Fail the room's result; a decode engine that claims it later gets the error at once."""
        r = self._rooms.get(room) or self.get(room)
        if not r.result.done():
            r.result.set_exception(exc)
            r.result.exception()  # mark retrieved: the decode side may already be gone
