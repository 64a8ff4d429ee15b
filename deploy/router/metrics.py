"""Prometheus metrics, in a registry per router instance (tests run several routers)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ns = "sglang_pd_router"
        self.requests = Counter(
            f"{ns}_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"{ns}_request_duration_seconds",
            "Time from request to the last byte of the answer.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttfb = Histogram(
            f"{ns}_time_to_first_byte_seconds",
            "Time from request to the first byte of the answer body.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{ns}_worker_in_flight",
            "Requests in flight per worker.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.retries = Counter(
            f"{ns}_retries",
            "Requests retried on another worker pair, by the failing role.",
            ["role"],
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            f"{ns}_upstream_errors",
            "Failed worker legs, by role and kind.",
            ["role", "kind"],
            registry=self.registry,
        )
        self.breaker_state = Gauge(
            f"{ns}_worker_breaker_state",
            "Circuit breaker state per worker: 0 closed, 1 half-open, 2 open.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.worker_healthy = Gauge(
            f"{ns}_worker_healthy",
            "1 when the worker passes its health checks.",
            ["role", "worker"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(f"{ns}_queue_depth", "Requests waiting for an admission slot.", registry=self.registry)
        self.active = Gauge(f"{ns}_active_requests", "Requests admitted and not finished.", registry=self.registry)
        self.aborts = Counter(
            f"{ns}_aborts", "abort_request calls sent to workers, by role.", ["role"], registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_worker(self, role: str, url: str) -> None:
        for gauge in (self.in_flight, self.breaker_state, self.worker_healthy):
            with contextlib.suppress(KeyError):
                gauge.remove(role, url)
