"""The router's ASGI application: pure ASGI middleware (auth → body limit → admission) in front
of a dispatcher that sends the inference endpoints straight to the proxy and everything else
(health, metrics, models, the /workers admin API) to FastAPI."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..common.contract import as_role
from ..common.openai_errors import ApiError, error_response
from ..spec.revision import revision_problem
from .api.middleware import ADMIN_SCOPE_KEY, AdmissionMiddleware, AuthMiddleware, BodyLimitMiddleware
from .api.middleware.auth import PIN_SCOPE_KEY
from .api.openapi import OPENAPI
from .api.request_ids import RequestIds, request_ids
from .api.validation import ENDPOINTS, parse_body, validate
from .config import RouterConfig
from .exceptions import ClientGone
from .log import client_request_id_var, logger, request_id_var
from .metrics import CONTENT_TYPE_LATEST, OUTCOMES, TTFT_PARTS, RouterMetrics, outcome
from .pd.legs import Legs, PairStreamOutcome
from .pd.proxy import PDProxy
from .pd.relay import ClientWatch, RelayResponse
from .policies import make_policy
from .timing import ARRIVED, QUEUED, Timing, timing_wanted
from .tracing import Tracer, current_trace
from .transport.client import HttpWorkerClient, WorkerClient
from .workers.fairness import client_identity, client_var
from .workers.health import HealthChecker
from .workers.owner import LocalWorkers, WorkerOwner
from .workers.pairs import PairPicker
from .workers.registry import WorkerRegistry
from .workers.rollout import Rollout, pinned_revision

__all__ = ["RouterApp", "create_app"]


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class RouterApp:
    """The ASGI callable uvicorn serves, with handles on the parts tests and the server need."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        worker_api_key: str = "",
        discovery_list_pods: Any = None,
        client: WorkerClient | None = None,
        owner: WorkerOwner | None = None,
    ) -> None:
        """`client` replaces the HTTP transport to workers (tests pass an in-process one);
        `discovery_list_pods` replaces the Kubernetes API call of discovery. `owner` owns the
        workers: this app by default (`LocalWorkers`), or a router process group's control process
        (`GroupMember`, for a serving process of the group)."""
        self.config = config
        self.owner: WorkerOwner = owner if owner is not None else LocalWorkers(config, list_pods=discovery_list_pods)
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(
            breaker_failure_threshold=config.breaker_failure_threshold,
            breaker_cooldown_s=config.breaker_cooldown_s,
            allow_link_local=config.allow_link_local_workers,
        )
        if client is None:
            client = HttpWorkerClient(timeouts=config.timeouts, api_key=worker_api_key)
        self.rollout = Rollout(self.registry, canary_share=config.canary_share, metrics=self.metrics)
        if config.approved_revision:
            self.rollout.approve(config.approved_revision, reason="--approved-revision")
        self.owner.follow(self.rollout)
        self.pairs = PairPicker(
            self.registry, make_policy(config.prefill_policy), make_policy(config.decode_policy), metrics=self.metrics,
            rollout=self.rollout,
        )  # fmt: skip
        self.legs = Legs(client, self.metrics)
        # OpenTelemetry spans, off unless an exporter endpoint is given (tracing.py).
        self.tracer = Tracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
        self.proxy = PDProxy(config, self.pairs, self.legs)
        self.health = HealthChecker(
            self.registry,
            self.metrics,
            client,
            interval_s=config.health_interval_s,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
            generate_interval_s=config.health_generate_interval_s,
            stall_s=config.stream_stall_s,
            report=self.owner.report,
        )
        self.legs.health = self.health  # a worker's 5xx counts against it once a probe confirms it
        self.owner.attach(self.registry, self.health, self._refresh_gauges)
        # Metric children of the hot path, looked up once.
        self._ttft = {e: self.metrics.ttft.labels(e) for e in ENDPOINTS}
        self._e2e = {(e, o): self.metrics.e2e.labels(e, o) for e in ENDPOINTS for o in OUTCOMES}
        self._requests: dict[tuple[str, int], Any] = {}
        self._ttft_parts: dict[tuple[str, str], Any] = {}
        self.fastapi = self._build_fastapi()
        # The one routing table of the inference endpoints.
        self._inference = {e: e for e in ENDPOINTS}
        self.admission = AdmissionMiddleware(
            self._dispatch,
            paths=frozenset(ENDPOINTS),
            max_concurrent=config.max_concurrent_requests,
            max_queued=config.max_queued_requests,
            queue_timeout_s=config.queue_timeout_s,
            metrics=self.metrics,
            on_reject=self._rejected,
        )
        body_limit = BodyLimitMiddleware(
            self.admission,
            max_bytes=config.max_body_bytes,
            max_in_flight=config.max_body_bytes_in_flight,
            on_reject=self._rejected,
        )
        self.asgi: ASGIApp = AuthMiddleware(
            body_limit, api_keys=config.api_keys, admin_key=config.admin_key, on_reject=self._rejected
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[ARRIVED] = time.perf_counter()
        await self.asgi(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The inference endpoints skip FastAPI's routing and its five middleware layers: they
        # were a fifth of the router's CPU per request (py-spy, benchmarks/bench_router.py at c=16).
        endpoint = self._inference.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.fastapi(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _NOT_ALLOWED(scope, receive, send)
            return
        timing = Timing(scope.get(ARRIVED) or time.perf_counter(), scope.get(QUEUED, 0.0), wanted=timing_wanted(scope))
        ids = request_ids(scope)
        # Every log line of the request, its relayed stream's included, carries both ids.
        tokens = request_id_var.set(ids.router), client_request_id_var.set(ids.client)
        client = client_var.set(client_identity(scope, keyed=bool(self.config.api_keys)))  # the fair share's
        pin = pinned_revision.set(scope.get(PIN_SCOPE_KEY))  # the admin's x-sglpd-revision (rollout.py)
        trace = self.tracer.request(endpoint, scope["headers"], ids.router) if self.tracer is not None else None
        traced = current_trace.set(trace)
        try:
            try:
                response = await self.serve(endpoint, scope, receive, ids, timing)
            except Exception as exc:
                response = await _internal_error(None, exc)
                response.headers.update(ids.headers)
            try:
                await response(scope, receive, send)  # a relayed stream returns once it has ended
            finally:
                # A stream the client left is a 499 (nginx's "client closed request"), not a 200.
                status = 499 if isinstance(response, RelayResponse) and response.abandoned else response.status_code
                self._observe(endpoint, status, timing, response)
                if trace is not None:
                    trace.ended(status, outcome(status))
        finally:
            current_trace.reset(traced)
            request_id_var.reset(tokens[0])
            client_request_id_var.reset(tokens[1])
            client_var.reset(client)
            pinned_revision.reset(pin)

    @property
    def draining(self) -> bool:
        return self.admission.draining

    def start_draining(self) -> None:
        self.admission.draining = True

    # -- lifespan -------------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        await self.owner.start()
        await self.health.start()
        logger.info(
            "router started",
            extra={
                "prefill": [w.url for w in self.registry.prefill],
                "decode": [w.url for w in self.registry.decode],
            },
        )
        try:
            yield
        finally:
            await self.health.aclose()
            await self.legs.aclose()
            await self.owner.aclose()
            if self.tracer is not None:
                await asyncio.to_thread(self.tracer.shutdown)  # the spans still batched leave now

    # -- routes ---------------------------------------------------------------------------------

    def _build_fastapi(self) -> FastAPI:
        app = FastAPI(
            title="sglang-pd router",
            lifespan=self.lifespan,
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/health", self.health_route, methods=["GET"])
        app.add_api_route("/readiness", self.readiness, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_route, methods=["GET"])
        app.add_api_route("/openapi.json", self.openapi, methods=["GET"])
        app.add_api_route("/workers", self.list_workers, methods=["GET"])
        app.add_api_route("/workers", self.add_worker, methods=["POST"])
        app.add_api_route("/workers", self.remove_worker, methods=["DELETE"])
        app.add_api_route("/admin/revisions", self.list_revisions, methods=["GET"])
        app.add_api_route("/admin/revisions/approve", self.approve_revision, methods=["POST"])
        app.add_exception_handler(ApiError, _api_error)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
        app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, _internal_error)
        return app

    async def serve(self, endpoint: str, scope: Scope, receive: Receive, ids: RequestIds, timing: Timing) -> Response:
        """Validate the body and hand it to the proxy; errors become OpenAI-shaped answers."""
        try:
            raw = await _read_body(receive)
            admin = scope.get(ADMIN_SCOPE_KEY, False)
            if len(raw) > _PARSE_ON_LOOP_BYTES:
                payload = await asyncio.to_thread(self._checked_body, endpoint, raw, admin)
            else:
                payload = self._checked_body(endpoint, raw, admin)
            if payload.get("stream"):
                return await self.proxy.stream(endpoint, payload, ids, ClientWatch(scope, receive), timing)
            return await self.proxy.unary(endpoint, payload, ids, ClientWatch(scope, receive), timing)
        except ApiError as exc:
            response = exc.response()
            response.headers.update(ids.headers)
            return response
        except ClientGone:
            return Response(status_code=499, headers=ids.headers)

    def _checked_body(self, endpoint: str, raw: bytes, admin: bool) -> dict[str, Any]:
        payload = parse_body(raw)
        validate(endpoint, payload, self.registry.models(), admin=admin)
        return payload

    def _observe(self, endpoint: str, status: int, timing: Timing, response: Response) -> None:
        elapsed = time.perf_counter() - timing.arrived
        self._count(endpoint, status)
        result = outcome(status)
        stream = response.outcome if isinstance(response, RelayResponse) else None
        parts: dict[str, float] = {}
        if isinstance(stream, PairStreamOutcome):
            if stream.ending == "failed":  # broke after its 200: the client got an error event
                result = "upstream_error"
            self._ttft[endpoint].observe(timing.answered - timing.arrived)
            if (per_chunk := stream.time_per_chunk()) is not None:
                self.metrics.tpot.labels(endpoint, result).observe(per_chunk)
            parts = timing.parts()
            for part in TTFT_PARTS:
                self._ttft_part(part, timing).observe(parts[part])
        elif timing.answered:
            parts = timing.parts()
        self._e2e[endpoint, result].observe(elapsed)
        cut = isinstance(response, RelayResponse) and response.cut
        level = logging.WARNING if status >= 500 or result == "upstream_error" or cut else logging.INFO
        if logger.isEnabledFor(level):
            extra: dict[str, Any] = {
                "endpoint": endpoint,
                "status": status,
                "outcome": result,
                "duration_ms": round(elapsed * 1000, 3),
            }
            if parts:  # unary: the parts of the whole answer; streamed: of its first token
                extra["timing_ms"] = {name: round(seconds * 1000, 3) for name, seconds in parts.items()}
            if cut:
                assert isinstance(response, RelayResponse)
                extra["cut"] = f"slow reader: one chunk waited {response.slow_reader_s:g} s to be taken"
            logger.log(level, "request finished", extra=extra)

    def _count(self, endpoint: str, status: int) -> None:
        counter = self._requests.get((endpoint, status))
        if counter is None:
            counter = self._requests[endpoint, status] = self.metrics.requests.labels(endpoint, str(status))
        counter.inc()

    def _ttft_part(self, part: str, timing: Timing) -> Any:
        worker = timing.prefill if part in ("prefill", "transfer") else timing.decode if part == "decode" else None
        key = (part, worker.url if worker is not None else "")
        child = self._ttft_parts.get(key)
        if child is None:
            role = worker.role if worker is not None else ""
            child = self._ttft_parts[key] = self.metrics.ttft_part.labels(part, role, key[1])
        return child

    def _rejected(self, scope: Scope, status: int) -> None:
        """A middleware answered the request itself (401, 403, 413, 429, 503): counted by its
        endpoint (inference endpoints and /workers; "other" for any other path) and, for the
        inference endpoints, timed under its outcome."""
        path = scope["path"]
        endpoint = self._inference.get(path)
        self._count(endpoint or (path if path == "/workers" else "other"), status)
        if endpoint is not None:
            arrived = scope.get(ARRIVED)
            if arrived is not None:
                self._e2e[endpoint, outcome(status)].observe(time.perf_counter() - arrived)

    async def models(self) -> Response:
        created = 0
        data = [{"id": m, "object": "model", "created": created, "owned_by": "sglang"} for m in self.registry.models()]
        return _json({"object": "list", "data": data})

    async def openapi(self) -> Response:
        return Response(_OPENAPI_BODY, media_type="application/json")

    async def health_route(self) -> Response:
        return _json({"status": "ok"})

    async def readiness(self) -> Response:
        # Ready whenever it serves, with or without a healthy worker: taking the router out of its
        # Service would turn a clear 503 + Retry-After (no healthy worker, see GET /workers) into
        # refused connections. The body says what it can serve now.
        if self.draining:
            return error_response(503, "The router is draining and takes no new requests.", code="draining")
        return _json(
            {
                "status": "ready",
                "prefill": len(self.registry.available("prefill")),
                "decode": len(self.registry.available("decode")),
            }
        )

    async def metrics_route(self) -> Response:
        self._refresh_gauges()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def _refresh_gauges(self) -> None:
        # Per-worker gauges are read from the registry at scrape time, not kept per request.
        for w in self.registry.all():
            self.metrics.in_flight.labels(w.role, w.url).set(w.in_flight)
            self.metrics.breaker_state.labels(w.role, w.url).set(int(w.breaker.state))
            self.metrics.worker_healthy.labels(w.role, w.url).set(int(w.healthy))

    async def list_workers(self) -> Response:
        return _json(
            {
                "prefill": [w.to_json() for w in self.registry.prefill],
                "decode": [w.to_json() for w in self.registry.decode],
            }
        )

    async def add_worker(self, request: Request) -> Response:
        payload = parse_body(await request.body())
        url, role, port = payload.get("url"), payload.get("role"), payload.get("bootstrap_port")
        if not isinstance(url, str):
            raise ApiError(400, "'url' is required: the worker's http://HOST:PORT.", param="url", code="invalid_value")
        if role not in ("prefill", "decode"):
            raise ApiError(400, "'role' must be 'prefill' or 'decode'.", param="role", code="invalid_value")
        if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
            raise ApiError(
                400, "'bootstrap_port' must be an integer port.", param="bootstrap_port", code="invalid_type"
            )
        revision = payload.get("revision")
        if revision is not None and (not isinstance(revision, str) or revision_problem(revision) is not None):
            problem = revision_problem(revision) if isinstance(revision, str) else "it must be a string"
            raise ApiError(400, f"'revision': {problem}", param="revision", code="invalid_value")
        status, shown = await self.owner.add(url, role, port, revision)
        return _json(shown, status=status)

    async def list_revisions(self) -> Response:
        return _json(self.rollout.describe())

    async def approve_revision(self, request: Request) -> Response:
        """Client requests go to `revision` from now on; the revision approved before drains (rollout.py)."""
        payload = parse_body(await request.body())
        revision = payload.get("revision")
        if not isinstance(revision, str):
            raise ApiError(
                400, "'revision' is required: the revision to approve, as GET /admin/revisions lists it.",
                param="revision", code="invalid_value",
            )  # fmt: skip
        if (problem := revision_problem(revision)) is not None:
            raise ApiError(400, f"'revision': {problem}", param="revision", code="invalid_value")
        await self.owner.approve(revision)  # a process group's control process approves it for every process
        return _json(self.rollout.describe())

    async def remove_worker(self, request: Request) -> Response:
        url = request.query_params.get("url")
        given_role = request.query_params.get("role")
        role = as_role(given_role)
        if not url:
            raise ApiError(
                400,
                "Query parameter 'url' is required: DELETE /workers?url=http://HOST:PORT[&role=...].",
                param="url",
                code="invalid_value",
            )
        if given_role is not None and role is None:
            raise ApiError(400, "'role' must be 'prefill' or 'decode'.", param="role", code="invalid_value")
        return _json({"removed": await self.owner.remove(url, role)})


_OPENAPI_BODY = orjson.dumps(OPENAPI)
# Bodies larger than this are parsed and validated in a thread, so that other requests keep being
# served meanwhile (parsing 8 MiB of JSON takes tens of milliseconds).
_PARSE_ON_LOOP_BYTES = 256 * 1024


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (BodyLimitMiddleware has read it already and replays it whole)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_NOT_ALLOWED = error_response(
    405, "This method is not allowed on this endpoint; send POST.", code="http_error", headers={"allow": "POST"}
)


async def _api_error(_: Request, exc: ApiError) -> Response:
    return exc.response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
    messages = {
        404: "No such endpoint. See the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models.",
        405: "This method is not allowed on this endpoint.",
    }
    return error_response(exc.status_code, messages.get(exc.status_code, str(exc.detail)), code="http_error")


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    return error_response(400, f"Invalid request: {exc.errors()}", code="invalid_request")


async def _internal_error(_: Request | None, exc: Exception) -> Response:
    logger.error("internal router error", exc_info=exc)
    return error_response(500, "Internal router error; see the router's logs for the request id.", code="internal")


def create_app(config: RouterConfig, **kwargs: Any) -> RouterApp:
    return RouterApp(config, **kwargs)
