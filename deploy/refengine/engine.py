"""The reference engine's core: requests, the model thread, the KV pool and the PD roles.

One model thread runs every model step in arrival order, one step at a time (a prompt's
prefill, or one decode token), so concurrent requests progress together and a long request never
blocks a short one. At most `max_running_requests` requests run; the others wait their turn
(`scheduler.py`), and a request that finds no free KV pages waits for some, as sglang's scheduler
keeps it queued rather than refusing it. Roles: `both` (prefill and decode here), `prefill` (compute the prompt's KV,
write it into the decode engine's pages, answer with the first token) and `decode` (receive the
KV, then generate). Without bootstrap fields every role serves a request on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import httpx

from sglang_pd.deploy.common.contract import (
    DEFAULT_BOOTSTRAP_PORT,
    ENV_WORKER_API_KEY,
    SGLANG_VERSION,
    WORKER_AUTH_HEADER,
)
from sglang_pd.deploy.kv import KVConfig, KVError, KVTransferEngine, PagedLayout, get_engine

from .exceptions import PoolExhausted, RequestFailed
from .kvpool import KVPool, default_num_pages
from .model import LoadedModel, sample_token
from .pd import Claim, ClaimRejected, Room, RoomTable
from .scheduler import Scheduler, max_queued_from_env
from .sources import DEFAULT_MODEL
from .tokenizer import IncrementalDetokenizer

__all__ = ["Bootstrap", "EngineConfig", "RefEngine", "RequestFailed", "SamplingParams", "StepOutput"]

Role = Literal["prefill", "decode", "both"]
T = TypeVar("T")
log = logging.getLogger("sglang_pd.refengine")


@dataclass(kw_only=True)
class EngineConfig:
    role: Role = "both"
    served_name: str = DEFAULT_MODEL
    page_size: int = 16
    kv_pages: int | None = None  # None: kvpool.default_num_pages for the model
    max_running_requests: int = 64
    # sglang's --max-queued-requests (None: unbounded); sglang ignores it in PD roles (scheduler.py).
    max_queued_requests: int | None = field(default_factory=max_queued_from_env)
    # What a request may use, prompt and new tokens together (sglang's --context-length); None: the
    # model's own. Larger than the model's is refused, as sglang refuses it by default.
    context_length: int | None = None
    bootstrap_port: int | None = None
    # A fault to make a bad revision (--fault-kv-noise, off by default): a prefill overwrites the KV pages it
    # computed with noise before their checksum, as a broken kernel or a misread layout would. The decode takes
    # them as sent and answers from noise; only an accuracy check sees it.
    fault_kv_noise: bool = False
    bootstrap_timeout_s: float = 30.0  # both halves of a room must have arrived within this
    # Once both have, how long decode waits for the prefill to compute and send the KV (sglang's
    # SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s): prompts queue on the one model thread.
    waiting_timeout_s: float = 300.0
    kv: KVConfig = field(default_factory=KVConfig)
    verify_kv: bool = True  # decode checks the crc32 of the KV it received
    # Test hooks (SGLANG_PD_REFENGINE_TEST_*), all off by default: spread the prefill's writes over
    # this many seconds, add this many seconds to each prefill's forward pass, hold the prefill's
    # answer this many seconds after its KV was sent (in sglang the decode's first token and the
    # prefill's answer follow the same transfer event, in either order), and overwrite one page
    # with noise after its crc was taken (as if corrupted in transit).
    test_slow_transfer_s: float = 0.0
    test_prefill_delay_s: float = 0.0
    test_prefill_answer_delay_s: float = 0.0
    test_corrupt_page: bool = False
    # sglang's /health: a one-token generation, checked every tick, given up after the timeout
    # (`health_generate` in sglang's srt/entrypoints/http_server.py: 1 s, SGLANG_HEALTH_CHECK_TIMEOUT).
    health_tick_s: float = 1.0
    health_timeout_s: float = 20.0


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int


@dataclass
class StepOutput:
    token_id: int | None  # None for a final step that adds no token
    text: str  # the text this step adds
    finish_reason: dict[str, Any] | None = None


@dataclass
class RequestContext:
    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = False  # holds one of the scheduler's running slots
    arrived: float = field(default_factory=time.time)
    # sglang's per-request scheduler times, as `--enable-metrics` puts them into `meta_info`
    # (srt/observability/req_time_stats.py, SchedulerReqTimeStats.convert_to_output_meta_info):
    # `forward_entry_time` and `prefill_finished_time` as wall-clock seconds, `queue_time` in seconds.
    times: dict[str, float] = field(default_factory=dict)

    async def guard(self, aw: Any) -> Any:
        """Await `aw` unless the request is aborted first (then raise RequestFailed)."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.aborted.wait())
        try:
            done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()  # the caller was cancelled: `aw` must not go on (and take a slot) without it
            raise
        finally:
            stop.cancel()
        if task not in done:
            task.cancel()
            raise RequestFailed(f"Request {self.rid} was aborted.", status=499)
        return task.result()


class RefEngine:
    def __init__(self, config: EngineConfig, model: LoadedModel) -> None:
        self.config = config
        self.model = model
        self.tokenizer = model.tokenizer
        self.context_length = self._context_length(config.context_length, model)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        pages = config.kv_pages or default_num_pages(model.kv_shape, config.page_size)
        self.pool = KVPool(shape=model.kv_shape, page_size=config.page_size, num_pages=pages)
        self.kv: KVTransferEngine | None = None
        if config.role != "both":
            self.kv = get_engine(config.kv)
            self.kv.register(self.pool.base, self.pool.nbytes)
        # A room outlives no wait of its halves: both arriving, then the KV computed and sent.
        ttl_s = 2 * config.bootstrap_timeout_s + config.waiting_timeout_s + config.kv.timeout_s + 60
        self.rooms = RoomTable(ttl_s=ttl_s, remember_s=config.bootstrap_timeout_s)
        pd_role = config.role != "both"
        if pd_role and config.max_queued_requests is not None:
            log.info(
                json.dumps(
                    {"event": "max_queued_requests_ignored", "role": config.role,
                     "why": "sglang ignores --max-queued-requests in disaggregation mode"}
                )
            )  # fmt: skip
        self.scheduler = Scheduler(config.max_running_requests, None if pd_role else config.max_queued_requests)
        self._page_waiters: list[asyncio.Future[None]] = []
        self.requests: dict[str, RequestContext] = {}
        self.started = time.time()
        self.counters = {"requests": 0, "tokens": 0, "prompt_tokens": 0, "failed": 0, "aborted": 0}
        self.transfers_in_flight = 0
        # When the model thread last finished a step: sglang's health check passes once the
        # scheduler has produced anything after the check began (its `last_receive_tstamp`).
        self.last_step_at = time.monotonic()
        self._http: httpx.AsyncClient | None = None

    @staticmethod
    def _context_length(asked: int | None, model: LoadedModel) -> int:
        if asked is None:
            return model.context_length
        if not 0 < asked <= model.context_length:
            raise ValueError(
                f"--context-length has value {asked}; {model.name} supports 1 to {model.context_length} tokens."
            )
        return asked

    # -- plumbing ---------------------------------------------------------------------------

    async def run_model(self, fn: Callable[..., T], *args: Any) -> T:
        result = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self.last_step_at = time.monotonic()
        return result

    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            c = self.config
            read_s = c.bootstrap_timeout_s + c.waiting_timeout_s + c.kv.timeout_s + 30
            key = os.environ.get(ENV_WORKER_API_KEY, "")  # the peer's bootstrap API requires it
            headers = {WORKER_AUTH_HEADER: f"Bearer {key}"} if key else {}
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(read_s, connect=5.0), headers=headers)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _log(self, event: str, rid: str, **fields: Any) -> None:
        log.info(json.dumps({"event": event, "rid": rid, "role": self.config.role, **fields}))

    def begin(self, rid: str) -> RequestContext:
        """A request is here; it runs once `run_slot` gives it a slot, and `end` lets it go."""
        ctx = self.requests[rid] = RequestContext(rid)
        self.counters["requests"] += 1
        return ctx

    async def run_slot(self, ctx: RequestContext) -> None:
        """Wait (abortable) for one of the scheduler's running slots."""
        if not ctx.running:
            await ctx.guard(self.scheduler.acquire(ctx))

    def end(self, ctx: RequestContext) -> None:
        if self.requests.get(ctx.rid) is ctx:
            del self.requests[ctx.rid]
        if ctx.running:
            ctx.running = False
            self.scheduler.release()

    def abort(self, rid: str | None) -> int:
        """Abort one request (or all when rid is empty); returns how many were aborted."""
        targets = list(self.requests.values()) if not rid else [c for c in [self.requests.get(rid)] if c]
        for ctx in targets:
            ctx.aborted.set()
        self.counters["aborted"] += len(targets)
        return len(targets)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """sglang's length checks (`TokenizerManager._validate_one_request`), in its words."""
        if not ids:
            raise RequestFailed("The prompt is empty; send some text or input_ids.", 400)
        n, new, limit = len(ids), params.max_new_tokens, self.context_length
        if n >= limit:
            raise RequestFailed(
                f"The input ({n} tokens) is longer than the model's context length ({limit} tokens).", 400
            )
        if n + new > limit:
            raise RequestFailed(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested "
                f"a total of {n + new} tokens: {n} tokens from the input messages and {new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit.",
                400,
            )
        # The scheduler's own limit (`validate_input_length`): the prompt must also fit the KV pool.
        max_input = min(limit, self.pool.num_pages * self.config.page_size) - 1
        if n >= max_input:
            raise RequestFailed(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({max_input} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.",
                400,
            )

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self, ctx: RequestContext, ids: list[int], params: SamplingParams, bootstrap: Bootstrap | None
    ) -> AsyncGenerator[StepOutput, None]:
        """Decode-side generation (roles decode and both; prefill without bootstrap fields)."""
        self.check_prompt(ids, params)
        self.counters["prompt_tokens"] += len(ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        pages: list[int] = []
        try:
            if bootstrap is not None and self.config.role == "decode":
                # As sglang's decode: pages first (its prealloc queue), then the KV, then a running slot.
                try:
                    pages = await self._alloc(ctx, len(ids))
                except RequestFailed:  # aborted before its claim: the prefill need not wait for one
                    await self._cancel_room(bootstrap)
                    raise
                first, rows = await self._receive_kv(ctx, ids, pages, bootstrap)
                await self.run_slot(ctx)
                cache = await self.run_model(self.model.cache_from_rows, rows)
            else:
                await self.run_slot(ctx)
                logits, rows = await ctx.guard(self.run_model(self.model.prefill, ids))
                first = self._sample(logits, params, seed, 0)
                cache = await self.run_model(self.model.cache_from_rows, rows)
            detok = IncrementalDetokenizer(self.tokenizer)
            token, n = first, 0
            while True:
                n += 1
                self.counters["tokens"] += 1
                step = self._step(token, n, params, detok)
                yield step
                if step.finish_reason is not None:
                    return
                if ctx.aborted.is_set():
                    yield StepOutput(None, "", {"type": "abort", "message": "aborted"})
                    return
                logits = await self.run_model(self.model.decode_step, cache, token, len(ids) + n - 1)
                token = self._sample(logits, params, seed, n)
        finally:
            self._free(pages)

    def _sample(self, logits: Any, params: SamplingParams, seed: int, step: int) -> int:
        return sample_token(
            logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed, step=step
        )

    def _step(self, token: int, n: int, params: SamplingParams, detok: IncrementalDetokenizer) -> StepOutput:
        eos = self.tokenizer.eos_token_id
        if token == eos and not params.ignore_eos:
            return StepOutput(token, "", {"type": "stop", "matched": token})
        if token in params.stop_token_ids:
            return StepOutput(token, "", {"type": "stop", "matched": token})
        before = detok.text
        delta = detok.add(token)
        for s in params.stop:
            at = detok.text.find(s, max(0, len(before) - len(s) + 1))
            if s and at >= 0:
                detok.text = detok.text[:at]
                return StepOutput(token, detok.text[len(before) :], {"type": "stop", "matched": s})
        if n >= params.max_new_tokens:
            return StepOutput(token, delta, {"type": "length", "length": n})
        return StepOutput(token, delta)

    async def _alloc(self, ctx: RequestContext, tokens: int) -> list[int]:
        """Pages for `tokens`, waiting (abortable) while the pool has too few free: sglang keeps such
        a request queued. `check_prompt` has refused a prompt larger than the whole pool."""
        while True:
            try:
                return self.pool.alloc(tokens)
            except PoolExhausted:
                waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._page_waiters.append(waiter)
                try:
                    await ctx.guard(waiter)
                finally:
                    with contextlib.suppress(ValueError):
                        self._page_waiters.remove(waiter)

    def _free(self, pages: list[int]) -> None:
        if not pages:
            return
        self.pool.free(pages)
        # Every waiter tries again: which of them fits depends on how many pages each needs.
        waiters, self._page_waiters = self._page_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- decode side of PD ------------------------------------------------------------------

    async def _receive_kv(self, ctx: RequestContext, ids: list[int], pages: list[int], b: Bootstrap) -> tuple[int, Any]:
        assert self.kv is not None
        url = f"http://{b.host}:{b.port}/kv/claim"
        claim = {
            "room": b.room,
            "rid": ctx.rid,
            "session_id": self.kv.session_id,
            "layout": self.pool.layout().to_json(),
            "dst_pages": pages,
            "prompt_tokens": len(ids),
            "page_size": self.config.page_size,
            "weights_digest": self.model.weights_digest,
        }
        try:
            r = await ctx.guard(self.http().post(url, json=claim))
        except RequestFailed:
            # Aborted: take the pages back only once the prefill cannot write into them any more.
            await self._cancel_room(b)
            raise
        except httpx.HTTPError as exc:
            await self._cancel_room(b)  # a prefill that timed out may still be writing
            raise RequestFailed(
                f"The prefill bootstrap server {b.host}:{b.port} did not answer for room {b.room} "
                f"({type(exc).__name__}: {exc}); check the prefill engine and its --bootstrap-port.",
                502,
            ) from exc
        if r.status_code != 200:
            # The prefill may still hold the room: cancel it before these pages go back to the pool.
            await self._cancel_room(b)
            detail = (
                r.json().get("error", r.text)
                if r.headers.get("content-type", "").startswith("application/json")
                else r.text
            )
            raise RequestFailed(f"The prefill engine failed room {b.room}: {detail}", 502)
        result = r.json()
        rows = self.pool.read(pages, len(ids))
        if self.config.verify_kv:
            crc = self.pool.checksum(pages, len(ids))
            if crc != result["crc"]:
                self.counters["failed"] += 1
                raise RequestFailed(
                    f"KV integrity check failed for room {b.room}: the pages received (crc32 {crc:08x}) differ from "
                    f"those sent ({result['crc']:08x}); the transfer corrupted data.",
                    502,
                )
        self._log("kv_received", ctx.rid, room=b.room, pages=len(pages), seconds=result.get("seconds"))
        return int(result["first_token"]), rows

    async def _cancel_room(self, b: Bootstrap) -> None:
        url = f"http://{b.host}:{b.port}/kv/cancel"
        with contextlib.suppress(httpx.HTTPError, asyncio.CancelledError):  # a dead prefill writes nothing more
            await asyncio.shield(self.http().post(url, json={"room": b.room}, timeout=10))

    # -- prefill side of PD -----------------------------------------------------------------

    async def prefill_and_send(
        self, ctx: RequestContext, ids: list[int], params: SamplingParams, b: Bootstrap
    ) -> StepOutput:
        """Wait for the decode's claim of the room, then compute the prompt's KV, write it into the
        decode engine's pages and return the first token. The order is sglang's: a request waits
        in the bootstrap queue for the decode's KV indices before it is prefilled, so a prefill
        waiting for its decode holds no running slot (nor pages)."""
        assert self.kv is not None
        self.check_prompt(ids, params)
        self.counters["prompt_tokens"] += len(ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        pages: list[int] = []
        try:
            room = self.rooms.join_prefill(b.room)
        except ClaimRejected as exc:
            self.counters["failed"] += 1
            raise RequestFailed(str(exc), exc.status) from exc
        try:
            try:
                claim = await ctx.guard(self.rooms.wait_claim(room, self.config.bootstrap_timeout_s))
            except ClaimRejected as exc:
                raise RequestFailed(str(exc), exc.status) from exc
            self._check_claim(claim, len(ids))
            await self.run_slot(ctx)
            entered = time.time()
            ctx.times["forward_entry_time"] = entered
            ctx.times["queue_time"] = entered - ctx.arrived
            if self.config.test_prefill_delay_s > 0:
                await ctx.guard(asyncio.sleep(self.config.test_prefill_delay_s))
            logits, rows = await ctx.guard(self.run_model(self.model.prefill, ids))
            first = self._sample(logits, params, seed, 0)
            pages = await self._alloc(ctx, len(ids))
            await self.run_model(self.pool.write, pages, rows)
            if self.config.fault_kv_noise:
                await self.run_model(self._noise_pages, pages)
            crc = await self.run_model(self.pool.checksum, pages, len(ids))
            if self.config.test_corrupt_page:
                self._corrupt(pages[0])
            ctx.times["prefill_finished_time"] = time.time()  # computed; the KV transfer follows
            seconds = await self._send(ctx, room, claim, pages)
            if not room.result.done():
                room.result.set_result({"first_token": first, "crc": crc, "seconds": seconds})
            if self.config.test_prefill_answer_delay_s > 0:
                await ctx.guard(asyncio.sleep(self.config.test_prefill_answer_delay_s))
            self.counters["tokens"] += 1
            return self._step(first, 1, params, IncrementalDetokenizer(self.tokenizer))
        except BaseException as exc:
            self.counters["failed"] += 1
            self.rooms.fail(room, exc if isinstance(exc, Exception) else RequestFailed("cancelled", 499))
            raise
        finally:
            self.rooms.leave_prefill(room)
            self._free(pages)

    async def _send(self, ctx: RequestContext, room: Room, claim: Claim, pages: list[int]) -> float:
        """Write `pages` into the claimed pages of the decode engine, unless it cancelled the room;
        returns the seconds the write took."""
        t0 = time.perf_counter()
        async with room.writing:
            if room.cancelled:
                raise RequestFailed(f"The decode engine cancelled room {room.id}.", 499)
            self.transfers_in_flight += 1
            try:
                await asyncio.to_thread(self._write, claim, pages)
            except KVError as exc:
                self._log("kv_transfer_failed", ctx.rid, room=room.id, error=type(exc).__name__, detail=str(exc))
                raise RequestFailed(
                    f"KV transfer to the decode engine ({claim.session_id}) failed: {type(exc).__name__}: {exc}",
                    502,
                ) from exc
            finally:
                self.transfers_in_flight -= 1
        seconds = time.perf_counter() - t0
        self._log("kv_sent", ctx.rid, room=room.id, pages=len(pages), seconds=round(seconds, 6))
        return seconds

    def _noise_pages(self, pages: list[int]) -> None:
        # --fault-kv-noise: every buffer of these pages becomes noise of the values' own scale.
        import torch

        index = torch.tensor(pages)
        kept = self.pool.buffer[:, index]
        noise = torch.randn(kept.shape, generator=torch.Generator().manual_seed(len(pages)), dtype=kept.dtype)
        self.pool.buffer[:, index] = noise * kept.float().std().to(kept.dtype)

    def _corrupt(self, page: int) -> None:
        # Test hook: noise over one page of the first layer, after its checksum was taken.
        import torch

        shape = self.pool.buffer[0, page].shape
        self.pool.buffer[0, page] = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 10

    def _check_claim(self, claim: Claim, prompt_tokens: int) -> None:
        problems = []
        if claim.prompt_tokens != prompt_tokens:
            problems.append(f"the decode engine counts {claim.prompt_tokens} prompt tokens, this one {prompt_tokens}")
        if claim.page_size != self.config.page_size:
            problems.append(f"page size {claim.page_size} on decode, {self.config.page_size} here")
        if claim.weights_digest != self.model.weights_digest:
            problems.append("the engines run different weights (model or seed differ)")
        if problems:
            raise RequestFailed(f"Prefill and decode disagree for room {claim.room}: " + "; ".join(problems) + ".", 500)

    def _write(self, claim: Claim, pages: list[int]) -> None:
        assert self.kv is not None
        dst = PagedLayout.from_json(claim.layout)
        if self.config.test_slow_transfer_s <= 0:
            self.kv.write_pages(claim.session_id, self.pool.layout(), dst, pages, claim.dst_pages)
            return
        pause = self.config.test_slow_transfer_s / max(1, len(pages))
        for s, d in zip(pages, claim.dst_pages, strict=True):
            self.kv.write_pages(claim.session_id, self.pool.layout(), dst, [s], [d])
            time.sleep(pause)

    async def serve_claim(self, claim: Claim) -> dict[str, Any]:
        """The bootstrap server's side: hand the claim to the prefill request, wait for its result."""
        room = self.rooms.join_decode(claim)
        c = self.config
        try:
            arrival: asyncio.Future[Any] = asyncio.ensure_future(room.arrived.wait())
            try:
                await asyncio.wait(
                    {arrival, room.result}, timeout=c.bootstrap_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                arrival.cancel()
            if not room.arrived.is_set() and not room.result.done():
                raise ClaimRejected(
                    f"No prefill request arrived for bootstrap room {claim.room} within "
                    f"{c.bootstrap_timeout_s:.0f} s; the router must send the request to both engines.",
                    504,
                )
            try:
                async with asyncio.timeout(c.waiting_timeout_s + c.kv.timeout_s):
                    return await asyncio.shield(room.result)
            except TimeoutError:
                raise ClaimRejected(
                    f"The prefill request for bootstrap room {claim.room} arrived but sent no KV within "
                    f"{c.waiting_timeout_s:.0f} s; the prefill engine is overloaded (lower the request rate).",
                    504,
                ) from None
        except RequestFailed as exc:
            raise ClaimRejected(str(exc), 502) from exc
        finally:
            self.rooms.leave_decode(room)

    async def cancel_claim(self, room_id: int) -> None:
        """The decode gave the room up: once no write into its pages is in flight, fail the room."""
        room = self.rooms.peek(room_id)
        if room is None:  # the claim never came (or the room ended): a late prefill request fails at once
            self.rooms.close_unclaimed(room_id)
            return
        room.cancelled = True
        async with room.writing:  # wait out a write in flight
            pass
        self.rooms.fail(room, RequestFailed("cancelled by the decode engine", 499))

    # -- introspection ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests here that hold no running slot (queued, or waiting for their KV or their claim)."""
        return max(0, len(self.requests) - self.scheduler.running)

    def metrics_text(self) -> str:
        p = "sglang_pd_refengine"
        lines = []
        for name, value, kind in (
            ("requests_total", self.counters["requests"], "counter"),
            ("failed_requests_total", self.counters["failed"], "counter"),
            ("aborted_requests_total", self.counters["aborted"], "counter"),
            ("generation_tokens_total", self.counters["tokens"], "counter"),
            ("prompt_tokens_total", self.counters["prompt_tokens"], "counter"),
            ("running_requests", self.scheduler.running, "gauge"),
            ("waiting_requests", self.waiting, "gauge"),
            ("kv_pages_used", self.pool.used_pages, "gauge"),
            ("kv_pages_total", self.pool.num_pages, "gauge"),
            ("kv_transfers_in_flight", self.transfers_in_flight, "gauge"),
            # Rooms held on this (prefill) engine: 0 once no PD request is in flight.
            ("bootstrap_rooms", len(self.rooms), "gauge"),
        ):
            lines += [f"# TYPE {p}_{name} {kind}", f'{p}_{name}{{role="{self.config.role}"}} {value}']
        text = "\n".join(lines) + "\n"
        if self.kv is not None:
            text += self.kv.metrics.prometheus()
        return text

    def server_info(self) -> dict[str, Any]:
        c = self.config
        return {
            "model_path": self.model.name,
            "served_model_name": c.served_name,
            "disaggregation_mode": "null" if c.role == "both" else c.role,
            # sglang reports its --disaggregation-bootstrap-port (default 8998) in every role
            "disaggregation_bootstrap_port": c.bootstrap_port or DEFAULT_BOOTSTRAP_PORT,
            "disaggregation_transfer_backend": "mooncake",
            "page_size": c.page_size,
            "max_running_requests": c.max_running_requests,
            "max_queued_requests": c.max_queued_requests,
            "context_length": self.context_length,
            "kv_pages": self.pool.num_pages,
            "kv_cache_shape": self.model.kv_shape.describe(),
            "kv_session_id": self.kv.session_id if self.kv else None,
            "weights_digest": self.model.weights_digest,
            "engine": "sglang-pd reference engine",
            # The parallel layout as sglang 0.5.23 reports it (one engine: no TP, no DP attention).
            "version": SGLANG_VERSION,
            "tp_size": 1,
            "dp_size": 1,
            "attn_dp_size": 1,
            "enable_dp_attention": False,
            "max_total_num_tokens": self.pool.num_pages * c.page_size,
            "chunked_prefill_size": -1,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started,
            "internal_states": [{"num_running_reqs": self.scheduler.running, "num_waiting_reqs": self.waiting}],
        }
