"""What each engine can take, and the requests that wait in the router until a pair can take them.

An engine says in `/server_info` how many requests it runs at once (`max_running_requests`) and
how many tokens its KV pool holds (`max_total_num_tokens`); its context length is in the same place
(`context_length`) and in its model card (`max_model_len`). The router sends a worker at most
`max_running_requests` requests, and no more estimated tokens than its pool holds (`estimate`):
beyond that sglang would only queue them (its waiting queue is unbounded in PD mode, where
`--max-queued-requests` is ignored), and a queue the router cannot see is one that neither times
out nor answers 429. Worse, a stream queued there sends no byte until it runs, so on a slow
engine it would end with the router's stream idle timeout (504) instead. A worker with nothing
admitted always takes the next request, so one request larger than the estimate allows still runs.

A request that finds every healthy pair full waits in the `CapacityGate`, first come first served,
for at most the router's queue timeout (`--queue-timeout`) and behind at most `--max-queued-requests`
others; beyond either it gets a 429 with Retry-After, as the admission queue answers
(`middleware/admission.py`). Reservations are made when a pair is picked (`Reservation`), so that
two requests picked in the same tick cannot both take a worker's last slot, and released when each
leg ends.

In a router process group (`group.py`) each serving process counts its own reservations against a
worker's whole capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ...common.openai_errors import ApiError
from ..api.validation import routing_text
from ..exceptions import ClientGone, WorkerAtCapacity

if TYPE_CHECKING:
    from .registry import Worker, WorkerRegistry

__all__ = [
    "BYTES_PER_TOKEN",
    "DEFAULT_NEW_TOKENS",
    "CapacityGate",
    "Demand",
    "Reservation",
    "check_max_tokens",
    "estimate",
    "has_room",
    "take_server_info",
]

# The router has no tokenizer: a prompt is taken as one token per 4 UTF-8 bytes (English text
# averages about that; token ids count one each), and a request that sets no limit as generating
# sglang's default `max_new_tokens` (128, `SamplingParams`). This bounds what is sent, not what
# runs: an engine short of KV pages queues the request itself.
BYTES_PER_TOKEN = 4
DEFAULT_NEW_TOKENS = 128
# A waiting request looks again this often even without a release (a worker became healthy, or
# was added).
_RECHECK_S = 0.5

T = TypeVar("T")

_FULL = (
    "Every worker pair is at its capacity and {queued} requests already wait for one. Retry after the "
    "Retry-After delay, or add workers."
)
_TIMEOUT = (
    "Every worker pair stayed at its capacity for the queue timeout of {timeout:g} s. Retry after the "
    "Retry-After delay, add workers, or raise --queue-timeout."
)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def take_server_info(worker: Worker, info: dict[str, Any]) -> None:
    """Record the capacity a worker's `/server_info` reports (sglang 0.5.17 and 0.5.23 use these
    keys; a missing or null one leaves that limit unknown, hence unenforced)."""
    worker.take_limits(_positive_int(info.get("max_running_requests")), _positive_int(info.get("max_total_num_tokens")))
    context = _positive_int(info.get("context_length"))
    if context is not None:
        worker.take_context_length(context)


def take_model_card(worker: Worker, card: dict[str, Any]) -> None:
    """Record the context length of a worker's model card (sglang's `max_model_len`)."""
    context = _positive_int(card.get("max_model_len"))
    if context is not None:
        worker.take_context_length(context)


class Demand:
    """What one request is estimated to take: `slots` running requests (a batch counts each
    prompt), and tokens on the prefill (its prompts) and on the decode (prompts and completions)."""

    __slots__ = ("decode_tokens", "prefill_tokens", "slots")

    def __init__(self, slots: int, prefill_tokens: int, decode_tokens: int) -> None:
        self.slots = slots
        self.prefill_tokens = prefill_tokens
        self.decode_tokens = decode_tokens


def _asked_new_tokens(endpoint: str, payload: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(parameter, value) of each token limit the request sets."""
    if endpoint == "/generate":
        params = payload.get("sampling_params")
        if isinstance(params, dict):
            yield "sampling_params.max_new_tokens", params.get("max_new_tokens")
        elif isinstance(params, list):
            for i, one in enumerate(params):
                if isinstance(one, dict):
                    yield f"sampling_params[{i}].max_new_tokens", one.get("max_new_tokens")
        return
    yield "max_completion_tokens", payload.get("max_completion_tokens")
    yield "max_tokens", payload.get("max_tokens")


def estimate(endpoint: str, payload: dict[str, Any], batch: int | None) -> Demand:
    """The request's `Demand` (the module docstring says how tokens are estimated)."""
    ids = payload.get("input_ids")
    if endpoint == "/generate" and isinstance(ids, list) and ids:
        prompt = sum(len(one) for one in ids if isinstance(one, list)) or len(ids)
    else:
        prompt = max(1, len(routing_text(payload).encode()) // BYTES_PER_TOKEN)
    asked = [v for _, v in _asked_new_tokens(endpoint, payload) if isinstance(v, int) and not isinstance(v, bool)]
    new = max(asked) if asked else DEFAULT_NEW_TOKENS
    prompts = batch or 1
    n = payload.get("n")
    samples = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    new_total = max(0, new) * samples * prompts
    return Demand(prompts, prompt, prompt + new_total)


def has_room(worker: Worker, slots: int, tokens: int) -> bool:
    """Whether `worker` may be sent a request of `slots` requests and `tokens` tokens now."""
    if worker.admitted == 0:
        return True
    if worker.max_running is not None and worker.admitted + slots > worker.max_running:
        return False
    return worker.max_total_tokens is None or worker.admitted_tokens + tokens <= worker.max_total_tokens


class Reservation:
    """One request's share of its pair's capacity, from the pick until each leg has ended;
    `release` is idempotent per role, so every path may call it."""

    __slots__ = ("_decode", "_demand", "_on_release", "_prefill")

    def __init__(self, prefill: Worker, decode: Worker, demand: Demand, on_release: Callable[[], None]) -> None:
        self._prefill: Worker | None = prefill
        self._decode: Worker | None = decode
        self._demand = demand
        self._on_release = on_release
        prefill.admit(demand.slots, demand.prefill_tokens)
        decode.admit(demand.slots, demand.decode_tokens)

    def release_prefill(self, _: object = None) -> None:
        """The prefill leg ended (also a done callback)."""
        if self._prefill is not None:
            self._prefill.release(self._demand.slots, self._demand.prefill_tokens)
            self._prefill = None
            self._on_release()

    def release_decode(self, _: object = None) -> None:
        """The decode leg ended: its answer was read, its stream closed, or it failed."""
        if self._decode is not None:
            self._decode.release(self._demand.slots, self._demand.decode_tokens)
            self._decode = None
            self._on_release()

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


class CapacityGate:
    """Requests waiting for a pair with room, served first come first served (module docstring)."""

    def __init__(self, *, max_waiting: int, timeout_s: float, on_depth: Callable[[int], None] | None = None) -> None:
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._on_depth = on_depth
        self._queue: deque[list[asyncio.Future[None] | None]] = deque()
        self._retry_after = str(max(1, math.ceil(timeout_s / 4)))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def notify(self) -> None:
        """Capacity was released: the first waiting request looks again."""
        if self._queue:
            wake = self._queue[0][0]
            if wake is not None and not wake.done():
                wake.set_result(None)

    async def wait(self, attempt: Callable[[], T], disconnect: asyncio.Future[None]) -> T:
        """Call `attempt` (a pick that raises WorkerAtCapacity while every pair is full) when this
        request's turn comes and capacity frees, until it returns; raises a 429 ApiError after the
        queue timeout or when the queue is full, ClientGone when the client leaves."""
        if len(self._queue) >= self.max_waiting:
            raise self._refusal(_FULL.format(queued=len(self._queue)), "capacity_queue_full")
        entry: list[asyncio.Future[None] | None] = [None]
        self._queue.append(entry)
        self._depth()
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                if self._queue[0] is entry:
                    try:
                        picked = attempt()
                    except WorkerAtCapacity:
                        pass
                    else:
                        return picked
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._refusal(_TIMEOUT.format(timeout=self.timeout_s), "capacity_queue_timeout")
                wake = entry[0] = loop.create_future()
                try:
                    await asyncio.wait({wake, disconnect}, timeout=min(left, _RECHECK_S))
                finally:
                    wake.cancel()
                if disconnect.done():
                    raise ClientGone()
        finally:
            with contextlib.suppress(ValueError):
                self._queue.remove(entry)
            self._depth()
            self.notify()  # the next request's turn: room may be left, or this one gave up its place

    def _refusal(self, message: str, code: str) -> ApiError:
        return ApiError(429, message, code=code, headers={"retry-after": self._retry_after})

    def _depth(self) -> None:
        if self._on_depth is not None:
            self._on_depth(len(self._queue))


def check_max_tokens(endpoint: str, payload: dict[str, Any], registry: WorkerRegistry) -> None:
    """Refuse (400 naming the parameter) a token limit above the served model's context length, the
    smallest its workers report; nothing is checked while no worker has reported one."""
    model = payload.get("model") if endpoint != "/generate" else None  # sglang ignores /generate's model
    limits = [
        w.context_length
        for w in registry.all()
        if w.context_length is not None and (not isinstance(model, str) or not w.models or model in w.models)
    ]
    if not limits:
        return
    limit = min(limits)
    for param, value in _asked_new_tokens(endpoint, payload):
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            served = f" of {model}" if isinstance(model, str) else ""
            raise ApiError(
                400,
                f"'{param}' is {value}, more than the context length{served} ({limit} tokens), which the prompt "
                f"and the completion share. Lower '{param}' to at most {limit} minus the prompt's tokens.",
                param=param,
                code="context_length_exceeded",
            )
