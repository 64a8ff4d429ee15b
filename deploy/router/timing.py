"""Where a request's time to first token went, as the router sees it.

A PD request's first token waits, in turn, for: an admission slot and a worker pair with room
(`queue`), failed attempts and their backoff (`retry`), the prefill leg from its sending to the
end of the prefill's forward pass (`prefill`), the KV transfer from there to the prefill's
answer (`transfer`: in sglang the prefill answers once its KV pages are sent), the decode's first
token after that (`decode`: the decode's scheduling and first step), and the router's own work
around them (`router`: reading, parsing and routing the request, relaying the chunk). The parts
add up to the router's time to first token (`total`), from the request's arrival at the router's
ASGI entry to its first chunk going out; both legs start at once, so a decode that answers before
the prefill does leaves `decode` at 0.

The line between `prefill` and `transfer` is the engine's own: sglang 0.5.23 started with
`--enable-metrics` puts the scheduler's `prefill_finished_time` (wall clock, when the forward
pass ended and the KV transfer began: `srt/disaggregation/prefill.py`, `set_prefill_finished_time`)
and `queue_time` (seconds) into each `/generate` answer's `meta_info`
(`srt/observability/req_time_stats.py`, `convert_to_output_meta_info`). Its OpenAI endpoints
return no `meta_info`: there, and with engines that report no such time, `transfer` is 0 and the
transfer is inside `prefill`. The engine's wall-clock time is joined to the router's clock as
read on this host (the same clock on one machine; NTP-close across a cluster), bounded by the
router's own readings.

A client that sends `x-sglpd-timing: 1` gets them in a W3C `Server-Timing` header, in ms
(https://www.w3.org/TR/server-timing/), also on a stream, whose headers leave with its first
chunk, followed by sglang's `queue_time` as `prefill_queue` / `decode_queue` where reported
(informational: inside `prefill` / `decode`).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from starlette.types import Scope

if TYPE_CHECKING:
    import asyncio

    from .transport.client import Reply
    from .workers.registry import Worker

__all__ = ["ARRIVED", "QUEUED", "Timing", "engine_queue_time", "timing_wanted"]

# ASGI scope keys: when the request reached the router (perf_counter), and how long it waited
# for an admission slot (seconds; absent when it waited for none).
ARRIVED = "sglang_pd.arrived"
QUEUED = "sglang_pd.queued"
_ASK = b"x-sglpd-timing"
_QUEUE_TIME = re.compile(rb'"queue_time"\s*:\s*([0-9.eE+-]+)')
_PREFILL_FINISHED = re.compile(rb'"prefill_finished_time"\s*:\s*([0-9.eE+-]+)')


def timing_wanted(scope: Scope) -> bool:
    """Whether the client asked for the breakdown (`x-sglpd-timing: 1`)."""
    for name, value in scope["headers"]:
        if name == _ASK:
            return value.strip() not in (b"", b"0")
    return False


def engine_queue_time(body: bytes) -> float | None:
    """sglang's `meta_info.queue_time` in an answer's bytes (the last, in a stream), if present."""
    return _last_number(_QUEUE_TIME, body)


def _last_number(pattern: re.Pattern[bytes], body: bytes) -> float | None:
    found = pattern.findall(body)
    if not found:
        return None
    try:
        return float(found[-1])
    except ValueError:
        return None


class Timing:
    """One request's clock readings (perf_counter), set as it goes through the router."""

    __slots__ = (
        "answered",
        "arrived",
        "decode",
        "first",
        "first_sent",
        "prefill",
        "prefill_body",
        "prefill_done",
        "prefill_finished",
        "queued",
        "sent",
        "wanted",
    )

    def __init__(self, arrived: float, queued: float = 0.0, *, wanted: bool = False) -> None:
        self.arrived = arrived
        self.queued = queued  # admission and capacity waits
        self.wanted = wanted  # the client asked for the Server-Timing header
        self.first_sent = 0.0  # the first attempt's legs left
        self.sent = 0.0  # the answering attempt's legs left
        self.prefill_done = 0.0  # the answering attempt's prefill answered (0: not yet)
        self.prefill_finished = 0.0  # its forward pass ended, as the engine reports it (0: unknown)
        self.first = 0.0  # the decode's answer, or its first chunk, arrived
        self.answered = 0.0  # the answer (its first chunk) left for the client
        self.prefill: Worker | None = None
        self.decode: Worker | None = None
        self.prefill_body = b""

    def legs_sent(self, prefill_t: asyncio.Task[Reply]) -> None:
        now = time.perf_counter()
        self.sent = now
        if not self.first_sent:
            self.first_sent = now
        self.prefill_done = 0.0
        self.prefill_finished = 0.0
        prefill_t.add_done_callback(self._prefill_answered)

    def _prefill_answered(self, task: asyncio.Task[Reply]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self.prefill_done = now = time.perf_counter()
        body = task.result().body
        if self.wanted:
            self.prefill_body = body
        if b"prefill_finished_time" in body and (wall := _last_number(_PREFILL_FINISHED, body)) is not None:
            self.prefill_finished = wall - (time.time() - now)  # on the router's clock

    def parts(self) -> dict[str, float]:
        """The parts in seconds (`TTFT_PARTS`'s order) and `total`; all 0 before an answer."""
        if not self.answered or not self.first:
            return {}
        total = self.answered - self.arrived
        retry = self.sent - self.first_sent
        done = self.prefill_done if self.prefill_done and self.prefill_done < self.first else self.first
        computed = min(max(self.prefill_finished, self.sent), done) if self.prefill_finished else done
        prefill = max(0.0, computed - self.sent)
        transfer = done - computed
        decode = self.first - done
        router = total - self.queued - retry - prefill - transfer - decode
        return {
            "queue": self.queued,
            "retry": retry,
            "prefill": prefill,
            "transfer": transfer,
            "decode": decode,
            "router": router,
            "total": total,
        }

    def server_timing(self, decode_body: bytes = b"") -> str:
        """The `Server-Timing` value: each part's `dur` in ms, then sglang's queue times if known."""
        entries = [f"{name};dur={seconds * 1000:.3f}" for name, seconds in self.parts().items()]
        for name, body in (("prefill_queue", self.prefill_body), ("decode_queue", decode_body)):
            if body and (queue_time := engine_queue_time(body)) is not None:
                entries.append(f"{name};dur={queue_time * 1000:.3f}")
        return ", ".join(entries)
