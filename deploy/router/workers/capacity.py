"""What each engine can take, and the requests that wait in the router until a pair can take them
(docs/admission.md has the policy and how it compares with smg's and llm-d's).

An engine says in `/server_info` how many requests it runs at once (`max_running_requests`) and
how many tokens its KV pool holds (`max_total_num_tokens`); its context length is in the same place
(`context_length`) and in its model card (`max_model_len`). The router sends a worker at most
`max_running_requests` requests, and no more estimated tokens than its pool holds (`estimate`):
beyond that sglang would only queue them (its waiting queue is unbounded in PD mode, where
`--max-queued-requests` is ignored), and a queue the router cannot see is one that neither times
out nor answers 429. Worse, a stream queued there sends no byte until it runs, so on a slow
engine it would end with the router's stream idle timeout (504) instead. A worker with nothing
admitted always takes the next request, so one request larger than the estimate allows still runs.

A request reserves its prompt and what its completion likely uses, not its whole max_tokens: per
sequence at most 1/RESERVE_SHARE of the worker's pool (sglang's scheduler likewise counts a
clipped, ratio-scaled max_new_tokens when it admits: `SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION` and
`new_token_ratio`, `srt/managers/schedule_policy.py`). The engine itself retracts or queues when
the completions grow past the estimate; the reservation is released in full when its leg ends. A
request whose largest prompt alone cannot run (longer than the context, or than every prefill's
or every decode's pool) is refused at once (`check_prompt`: 400, 413), never queued.

A request that finds every healthy pair full waits in the `CapacityGate` for at most the router's
queue timeout (`--queue-timeout`) and behind at most `--max-queued-requests` others; beyond either
it gets a 429 with Retry-After, as the admission queue answers (`middleware/admission.py`). At each
release the waiting requests that fit are served in arrival order: one that does not fit is passed
by later ones that do until it has waited 1/PASS_LIMIT_SHARE of the queue timeout, then the
requests behind it wait for it. A client (fairness.py) that holds 1/k of the healthy decodes'
slots or tokens, k the clients holding or waiting, is passed over while another client's request
waits. Reservations are made when a pair is picked (`Reservation`), so that two requests picked in
the same tick cannot both take a worker's last slot, and released when each leg ends.

With a client reserve (`--client-reserve R`), no client holds more than 1 - R of those slots or
tokens even while it is alone: the rest waits for the next client to arrive, which a client holding
every slot would otherwise keep waiting until one of its requests ends. Off by default: behind a
proxy that hides client addresses, without client keys, every request is one client, and a reserve
would only idle capacity.

In a router process group (`group.py`) each serving process counts its own reservations against a
worker's whole capacity, and its own clients' shares.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ...common.openai_errors import ApiError
from ..api.validation import routing_text
from ..exceptions import ClientGone, WorkerAtCapacity
from .fairness import ClientLedger, client_var

if TYPE_CHECKING:
    from .registry import Worker, WorkerRegistry

__all__ = [
    "BYTES_PER_TOKEN",
    "DEFAULT_NEW_TOKENS",
    "REFUSE_BYTES_PER_TOKEN",
    "RESERVE_SHARE",
    "CapacityGate",
    "Demand",
    "Reservation",
    "check_max_tokens",
    "check_prompt",
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
# A request reserves its prompt and, per sequence, at most 1/RESERVE_SHARE of the worker's KV pool
# for its completion (never less than DEFAULT_NEW_TOKENS), not its whole max_tokens.
RESERVE_SHARE = 8
# A text prompt is refused as too long only when it is, even counted at this many bytes a token:
# common tokenizers average 3-5 bytes a token on text, so no prompt that fits is refused.
REFUSE_BYTES_PER_TOKEN = 6
# A waiting request that does not fit is passed by later ones that do until it has waited this
# share of the queue timeout; then the requests behind it wait for it, so it cannot starve.
PASS_LIMIT_SHARE = 4
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
_RESERVED = (
    "This client held {held} of the decodes' {total} {what} for the queue timeout of {timeout:g} s, and this "
    "request would take it past --client-reserve {reserve:g}, which keeps the rest for other clients. Retry "
    "once some of this client's requests have ended, or lower --client-reserve."
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
    prompt), `prompt_tokens` (all its prompts), `new_tokens` asked per sequence and `sequences`
    (prompts × n); `prompt_floor`, a lower bound of its largest prompt (the refusal's measure);
    `client`, whose request it is (fairness.py)."""

    __slots__ = ("client", "new_tokens", "prompt_floor", "prompt_tokens", "sequences", "slots")

    def __init__(
        self,
        slots: int,
        prompt_tokens: int,
        new_tokens: int,
        sequences: int = 1,
        *,
        prompt_floor: int = 0,
        client: str = "",
    ) -> None:
        self.slots = slots
        self.prompt_tokens = prompt_tokens
        self.new_tokens = new_tokens
        self.sequences = sequences
        self.prompt_floor = prompt_floor
        self.client = client

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens

    def decode_tokens(self, worker: Worker) -> int:
        """The prompts plus what the completions likely use on `worker` (`likely_tokens`)."""
        return self.likely_tokens(worker.max_total_tokens)

    def likely_tokens(self, pool: int | None) -> int:
        """The prompts plus what the completions likely use on a KV pool of `pool` tokens: per
        sequence its `new_tokens`, at most 1/RESERVE_SHARE of the pool (module docstring)."""
        new = self.new_tokens
        if pool is not None:
            new = min(new, max(DEFAULT_NEW_TOKENS, pool // RESERVE_SHARE))
        return self.prompt_tokens + new * self.sequences

    def tokens_on(self, worker: Worker) -> int:
        return self.prefill_tokens if worker.role == "prefill" else self.decode_tokens(worker)

    def covers(self, other: Demand) -> bool:
        """Whether this request needs at least what `other` needs, everywhere."""
        return (
            self.slots >= other.slots
            and self.prompt_tokens >= other.prompt_tokens
            and self.new_tokens * self.sequences >= other.new_tokens * other.sequences
        )


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
    """The request's `Demand` (the module docstring says how tokens are estimated), for the
    client of the request being served."""
    ids = payload.get("input_ids")
    if endpoint == "/generate" and isinstance(ids, list) and ids:
        lists = [len(one) for one in ids if isinstance(one, list)]
        prompt = sum(lists) or len(ids)
        floor = max(lists, default=len(ids))
    else:
        text = routing_text(payload).encode()
        prompt = max(1, len(text) // BYTES_PER_TOKEN)
        texts = payload.get("text") if endpoint == "/generate" else None
        if isinstance(texts, list):  # a batch: its largest prompt
            biggest = max((len(t.encode()) for t in texts if isinstance(t, str)), default=0)
        else:
            biggest = len(text)
        floor = biggest // REFUSE_BYTES_PER_TOKEN
    asked = [v for _, v in _asked_new_tokens(endpoint, payload) if isinstance(v, int) and not isinstance(v, bool)]
    new = max(asked) if asked else DEFAULT_NEW_TOKENS
    prompts = batch or 1
    n = payload.get("n")
    samples = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return Demand(prompts, prompt, max(0, new), samples * prompts, prompt_floor=floor, client=client_var.get())


def has_room(worker: Worker, slots: int, tokens: int) -> bool:
    """Whether `worker` may be sent a request of `slots` requests and `tokens` tokens now."""
    if worker.admitted == 0:
        return True
    if worker.max_running is not None and worker.admitted + slots > worker.max_running:
        return False
    return worker.max_total_tokens is None or worker.admitted_tokens + tokens <= worker.max_total_tokens


class Reservation:
    """One request's share of its pair's capacity, from the pick until each leg has ended;
    `release` is idempotent per role, so every path may call it. The decode's share also counts
    for the request's client in `ledger` (the gate's fair share)."""

    __slots__ = ("_decode", "_decode_tokens", "_demand", "_ledger", "_on_release", "_prefill")

    def __init__(
        self,
        prefill: Worker,
        decode: Worker,
        demand: Demand,
        on_release: Callable[[], None],
        ledger: ClientLedger | None = None,
    ) -> None:
        self._prefill: Worker | None = prefill
        self._decode: Worker | None = decode
        self._demand = demand
        self._on_release = on_release
        self._ledger = ledger
        # Kept: the worker's pool (hence the share) may be reported anew before the release.
        self._decode_tokens = demand.decode_tokens(decode)
        prefill.admit(demand.slots, demand.prefill_tokens)
        decode.admit(demand.slots, self._decode_tokens)
        if ledger is not None:
            ledger.add(demand.client, demand.slots, self._decode_tokens)

    def release_prefill(self, _: object = None) -> None:
        """The prefill leg ended (also a done callback)."""
        if self._prefill is not None:
            self._prefill.release(self._demand.slots, self._demand.prefill_tokens)
            self._prefill = None
            self._on_release()

    def release_decode(self, _: object = None) -> None:
        """The decode leg ended: its answer was read, its stream closed, or it failed."""
        if self._decode is not None:
            self._decode.release(self._demand.slots, self._decode_tokens)
            self._decode = None
            if self._ledger is not None:
                self._ledger.sub(self._demand.client, self._demand.slots, self._decode_tokens)
            self._on_release()

    def release(self) -> None:
        self.release_prefill()
        self.release_decode()


class _Waiter:
    __slots__ = ("attempt", "demand", "result", "since")

    def __init__(self, attempt: Callable[[], Any], demand: Demand, result: asyncio.Future[Any]) -> None:
        self.attempt = attempt
        self.demand = demand
        self.result = result
        self.since = time.monotonic()


class CapacityGate:
    """Requests waiting for a pair with room (module docstring: who goes first)."""

    def __init__(
        self,
        *,
        max_waiting: int,
        timeout_s: float,
        on_depth: Callable[[int], None] | None = None,
        registry: WorkerRegistry | None = None,
        reserve: float = 0.0,
    ) -> None:
        """`reserve`: the share of the decodes' slots and tokens no one client may hold (0: none)."""
        self.max_waiting = max_waiting
        self.reserve = reserve
        self.timeout_s = timeout_s
        self.ledger = ClientLedger()
        self._on_depth = on_depth
        self._registry = registry  # the decodes whose capacity the clients share
        self._queue: deque[_Waiter] = deque()
        self._clients: Counter[str] = Counter()  # waiting requests per client
        self._retry_after = str(max(1, math.ceil(timeout_s / 4)))
        self._pass_limit_s = timeout_s / PASS_LIMIT_SHARE

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def must_wait(self, demand: Demand) -> bool:
        """Whether `demand` goes through the queue rather than straight to a pick: others wait
        already, or it would take its client into the reserve."""
        return bool(self._queue) or (self.reserve > 0 and self._over_share(demand))

    def notify(self) -> None:
        """Capacity was released: the waiting requests that fit now get it (`_dispatch`)."""
        if self._queue:
            self._dispatch()

    async def wait(self, attempt: Callable[[], T], disconnect: asyncio.Future[None], demand: Demand) -> T:
        """Call `attempt` (a pick that reserves, or raises WorkerAtCapacity while no pair has room
        for `demand`) when its turn comes, until it returns; raises a 429 ApiError after the queue
        timeout or when the queue is full, ClientGone when the client leaves."""
        # A newcomer tries at once unless the queue's head is past passing or its client holds
        # its share (while others wait, or all but the reserve): every earlier waiter was tried
        # at the last release. Only one that must wait can find the queue full: requests held back
        # for their client's share must not shut others out of the room they leave.
        if not self._head_is_old() and not self._over_share(demand):
            try:
                return attempt()
            except WorkerAtCapacity:
                pass
        if len(self._queue) >= self.max_waiting:
            raise self._refusal(_FULL.format(queued=len(self._queue)), "capacity_queue_full")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(attempt, demand, loop.create_future())
        self._queue.append(waiter)
        self._clients[demand.client] += 1
        self._depth()
        deadline = time.monotonic() + self.timeout_s
        try:
            while not waiter.result.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(demand)
                await asyncio.wait({waiter.result, disconnect}, timeout=min(left, _RECHECK_S))
                if waiter.result.done():
                    break
                if disconnect.done():
                    raise ClientGone()
                if self._queue and self._queue[0] is waiter:
                    # No release for a while: a worker may have become healthy or been added.
                    self._dispatch()
            picked: T = waiter.result.result()
            return picked
        except BaseException:
            if waiter.result.done() and not waiter.result.cancelled() and waiter.result.exception() is None:
                _give_back(waiter.result.result())  # picked for a request that is gone
            raise
        finally:
            self._forget(waiter)

    def _dispatch(self) -> None:
        """Serve the waiting requests that fit, first come first served: a request that does not
        fit is passed by later ones that do (unless it has waited past the passing limit: then
        the requests behind it wait for it), and a client holding its share waits while another
        client's request waits."""
        failed: list[Demand] = []
        share = self._share()
        for waiter in list(self._queue):
            if waiter.result.done():
                continue
            demand = waiter.demand
            if self._over_share(demand, share):
                continue
            if not any(demand.covers(f) for f in failed):
                try:
                    waiter.result.set_result(waiter.attempt())
                    self._forget(waiter)
                    continue
                except WorkerAtCapacity:
                    failed.append(demand)
                except Exception as exc:  # NoHealthyWorker and the like: that request's answer
                    waiter.result.set_exception(exc)
                    self._forget(waiter)
                    continue
            if time.monotonic() - waiter.since >= self._pass_limit_s:
                return  # the requests behind it wait until it fits

    def _head_is_old(self) -> bool:
        """Whether the first waiter that `_dispatch` would try has waited past the passing limit
        (a waiter passed over for its client's share holds no one back). The queue is in arrival
        order, so the search ends at the first waiter that is not yet old."""
        now, share = time.monotonic(), None
        for waiter in self._queue:
            if now - waiter.since < self._pass_limit_s:
                return False
            share = share or self._share()
            if not self._over_share(waiter.demand, share):
                return True
        return False

    def _totals(self) -> tuple[int, int]:
        """The healthy decodes' request slots and KV tokens (0 where none reported them yet)."""
        if self._registry is None:
            return 0, 0
        decodes = self._registry.available("decode")
        return sum(w.max_running or 0 for w in decodes), sum(w.max_total_tokens or 0 for w in decodes)

    def _share(self) -> tuple[int, int, int]:
        """`_totals`, and the number of clients holding or waiting."""
        return *self._totals(), max(1, len(self.ledger.clients() | set(self._clients)))

    def _over_share(self, demand: Demand, share: tuple[int, int, int] | None = None) -> bool:
        """Whether `demand`'s client holds its share of the decodes: 1/k of their slots or tokens,
        k the clients holding or waiting, while another client's request waits; or, with a
        reserve, whether `demand` would take it into the reserve."""
        slots, tokens = self.ledger.held(demand.client)
        if not slots:
            return False
        others_wait = len(self._queue) - self._clients.get(demand.client, 0) > 0
        if not (others_wait or self.reserve):
            return False
        total_slots, total_tokens = share[:2] if share else self._totals()
        if self.reserve and self._into_reserve(demand, total_slots, total_tokens) is not None:
            return True
        if not others_wait:
            return False
        active = share[2] if share else self._share()[2]
        return (0 < total_slots <= slots * active) or (0 < total_tokens <= tokens * active)

    def _into_reserve(self, demand: Demand, total_slots: int, total_tokens: int) -> str | None:
        """Which of the decodes' totals `demand` would take its client into the reserve of:
        "request slots", "KV tokens", or None. The reserve is rounded up to whole slots and
        tokens (any reserve keeps at least one slot), and a client holding nothing may always
        run one request, however large."""
        slots, tokens = self.ledger.held(demand.client)
        if not slots:
            return None
        if total_slots > 0 and slots + demand.slots > max(1, total_slots - self._kept(total_slots)):
            return "request slots"
        likely = demand.likely_tokens(total_tokens or None)
        if total_tokens > 0 and tokens + likely > total_tokens - self._kept(total_tokens):
            return "KV tokens"
        return None

    def _kept(self, total: int) -> int:
        """How much of `total` the reserve keeps (the epsilon: 0.3 of 90 is 27, not 27.000000000000004)."""
        return math.ceil(total * self.reserve - 1e-9)

    def _timed_out(self, demand: Demand) -> ApiError:
        """The 429 for a request whose queue timeout passed: its client's reserve, or no room."""
        total_slots, total_tokens = self._totals()
        what = self._into_reserve(demand, total_slots, total_tokens) if self.reserve else None
        if what is None:
            return self._refusal(_TIMEOUT.format(timeout=self.timeout_s), "capacity_queue_timeout")
        slots, tokens = self.ledger.held(demand.client)
        held, total = (slots, total_slots) if what == "request slots" else (tokens, total_tokens)
        message = _RESERVED.format(held=held, total=total, what=what, timeout=self.timeout_s, reserve=self.reserve)
        return self._refusal(message, "capacity_client_reserve")

    def _forget(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        self._clients[waiter.demand.client] -= 1
        if self._clients[waiter.demand.client] <= 0:
            del self._clients[waiter.demand.client]
        self._depth()

    def _refusal(self, message: str, code: str) -> ApiError:
        return ApiError(429, message, code=code, headers={"retry-after": self._retry_after})

    def _depth(self) -> None:
        if self._on_depth is not None:
            self._on_depth(len(self._queue))


def _give_back(picked: Any) -> None:
    """Undo a pick whose request left before taking it: its reservation and DP ranks."""
    reservation = getattr(picked, "reservation", None)
    if reservation is not None:
        reservation.release()
    release_ranks = getattr(picked, "release_ranks", None)
    if release_ranks is not None and getattr(picked, "dp_ranks", None):
        release_ranks()


def check_prompt(endpoint: str, payload: dict[str, Any], demand: Demand, registry: WorkerRegistry) -> None:
    """Refuse at once a request whose largest prompt alone cannot run: 400 when it is longer than
    the served model's context length, 413 when no prefill's or no decode's KV pool can hold it.
    A limit no worker reports is not checked."""
    prompt = demand.prompt_floor
    model = payload.get("model") if endpoint != "/generate" else None
    param = {"/generate": "input_ids" if "input_ids" in payload else "text", "/v1/completions": "prompt"}.get(
        endpoint, "messages"
    )
    how = "" if param == "input_ids" else f" (counting {REFUSE_BYTES_PER_TOKEN} bytes a token, a lower bound)"
    contexts = [
        w.context_length
        for w in registry.all()
        if w.context_length is not None and (not isinstance(model, str) or not w.models or model in w.models)
    ]
    if contexts and prompt > min(contexts):
        raise ApiError(
            400,
            f"The prompt is at least {prompt} tokens{how}, more than the context length of {min(contexts)} "
            f"tokens. Shorten '{param}'.",
            param=param,
            code="context_length_exceeded",
        )
    for role in ("prefill", "decode"):
        pools = [w.max_total_tokens for w in registry.of(role) if w.max_total_tokens is not None]
        if pools and prompt > max(pools):
            raise ApiError(
                413,
                f"The prompt is at least {prompt} tokens{how}, more than the largest {role} KV cache pool holds "
                f"({max(pools)} tokens, max_total_num_tokens): no {role} worker can run it. Shorten '{param}', "
                "or serve it with workers that have more KV cache memory.",
                param=param,
                code="prompt_exceeds_kv_pool",
            )


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
