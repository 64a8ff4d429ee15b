"""OpenTelemetry traces of a request through the router, off by default.

`--otlp-traces-endpoint URL` (a collector's OTLP/HTTP traces URL, e.g.
`http://otel-collector:4318/v1/traces`) turns them on. Each inference request then gets a server
span (`POST /v1/chat/completions`; a child of the client's own W3C `traceparent`, when it sent
one), and each leg a client span under it (`prefill`, `decode`; a retried attempt's legs too),
whose context goes to the engine as the W3C `traceparent` and `tracestate` headers. That is what
sglang 0.5.23 started with `--enable-trace --otlp-traces-endpoint HOST:PORT` reads
(`srt/observability/trace.py`: `TRACE_HEADERS`; `srt/managers/tokenizer_manager.py`:
`extract_trace_headers(request.headers)`, then its request's root span starts in that context),
so one trace holds the router's request, both legs and each engine's own spans. A leg's span ends
with the leg's answer (for a stream, its first chunk); the request's with its last byte.

It needs the `tracing` extra (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http); the
router imports and serves without it, and refuses the flag without it, naming the extra. Spans
leave in batches from a background thread (the SDK's BatchSpanProcessor), never on the request path.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .workers.registry import Worker

__all__ = ["RequestTrace", "Tracer", "check_endpoint", "current_trace", "leg_headers"]

# The request being served's trace (None: tracing off), and the headers of the leg being sent
# (set inside each leg's own task, so the two legs never see each other's).
current_trace: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("sglang_pd_trace", default=None)
leg_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("sglang_pd_leg", default=None)

_INSTALL = "pip install 'sglang-pd[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)"


def check_endpoint(endpoint: str) -> None:
    """Refuse an endpoint that is not an OTLP/HTTP URL, naming the fix."""
    if not endpoint.startswith(("http://", "https://")):
        raise ValueError(
            f"--otlp-traces-endpoint has value {endpoint!r}; it takes a collector's OTLP/HTTP traces URL, "
            "e.g. http://otel-collector:4318/v1/traces (a bare HOST:PORT is how sglang and smg name an OTLP/gRPC "
            "endpoint, which this router does not speak)."
        )


class Tracer:
    """The router process's tracer, exporting over OTLP/HTTP to `endpoint`."""

    def __init__(self, endpoint: str, *, service_name: str = "sglang-pd-router", batch_delay_s: float = 1.0) -> None:
        check_endpoint(endpoint)
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError(
                f"--otlp-traces-endpoint needs OpenTelemetry, which is not installed: {_INSTALL}."
            ) from exc
        self._trace = trace
        self._kinds = trace.SpanKind
        self._propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=10)
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=batch_delay_s * 1000))
        self.tracer = self.provider.get_tracer("sglang_pd.router")

    def request(self, endpoint: str, headers: list[tuple[bytes, bytes]], rid: str) -> RequestTrace:
        """A request's server span, a child of the client's `traceparent` if it sent one."""
        carrier = {}
        for name, value in headers:
            if name in (b"traceparent", b"tracestate"):
                carrier[name.decode()] = value.decode("latin-1")
        parent = self._propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"POST {endpoint}",
            context=parent,
            kind=self._kinds.SERVER,
            attributes={"http.request.method": "POST", "url.path": endpoint, "sglang_pd.request_id": rid},
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Send what is still batched, then stop exporting."""
        self.provider.shutdown()


class RequestTrace:
    """One request's server span and the legs sent under it."""

    __slots__ = ("span", "tracer")

    def __init__(self, tracer: Tracer, span: Any) -> None:
        self.tracer = tracer
        self.span = span

    def leg(self, worker: Worker, path: str, rid: str) -> tuple[Any, dict[str, str]]:
        """A leg's client span and the headers that carry its context to the engine."""
        t = self.tracer
        span = t.tracer.start_span(
            worker.role,
            context=t._trace.set_span_in_context(self.span),
            kind=t._kinds.CLIENT,
            attributes={"server.address": worker.url, "url.path": path, "sglang_pd.role": worker.role,
                        "sglang_pd.rid": rid},
        )  # fmt: skip
        headers: dict[str, str] = {}
        t._propagator.inject(headers, context=t._trace.set_span_in_context(span))
        return span, headers

    def leg_ended(self, span: Any, status: int | None, error: BaseException | None = None) -> None:
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            span.set_status(self.tracer._trace.Status(self.tracer._trace.StatusCode.ERROR, repr(error or status)))
        span.end()

    def ended(self, status: int, outcome: str) -> None:
        self.span.set_attribute("http.response.status_code", status)
        self.span.set_attribute("sglang_pd.outcome", outcome)
        if status >= 500:
            self.span.set_status(self.tracer._trace.Status(self.tracer._trace.StatusCode.ERROR, str(status)))
        self.span.end()
