"""Prometheus metrics, in a registry per router instance (tests run several routers).

In a router process group (`group.py`) every serving process is started with
PROMETHEUS_MULTIPROC_DIR set: prometheus_client then keeps each process's values in files there,
and a scrape of any process renders all of them (counters and histograms summed; each gauge as its
`multiprocess_mode` says, over the live processes). The files cannot drop a series: the
per-worker gauges of a removed worker stay, at 0, until the group restarts.
"""

from __future__ import annotations

import contextlib
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["CONTENT_TYPE_LATEST", "RouterMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # prometheus_client reads it at import
        self.registry = r = CollectorRegistry(auto_describe=True)
        ns = "sglang_pd_router"
        by_worker = ["role", "worker"]
        self.requests = Counter(f"{ns}_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.latency = Histogram(f"{ns}_request_duration_seconds", "Time from request to the last byte of the answer.",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttfb = Histogram(f"{ns}_time_to_first_byte_seconds",
                              "Time from request to the first byte of the answer body.", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.in_flight = Gauge(f"{ns}_worker_in_flight", "Requests in flight per worker.", by_worker, registry=r,
                               multiprocess_mode="livesum")  # fmt: skip
        self.retries = Counter(f"{ns}_retries", "Requests retried on another worker pair, by the failing role.",
                               ["role"], registry=r)  # fmt: skip
        self.upstream_errors = Counter(f"{ns}_upstream_errors", "Failed worker legs, by role and kind.",
                                       ["role", "kind"], registry=r)  # fmt: skip
        self.upstream_status_errors = Counter(f"{ns}_upstream_status_errors",
                                              "Worker 5xx answers, by role and whether a health probe of the worker "
                                              "confirmed them (true: counted against its breaker; false: "
                                              "request-caused, not counted).", ["role", "confirmed"],
                                              registry=r)  # fmt: skip
        self.breaker_state = Gauge(f"{ns}_worker_breaker_state",
                                   "Circuit breaker state per worker: 0 closed, 1 half-open, 2 open (the worst of the "
                                   "router's processes).", by_worker, registry=r,
                                   multiprocess_mode="livemax")  # fmt: skip
        self.worker_healthy = Gauge(f"{ns}_worker_healthy", "1 when the worker passes its health checks.", by_worker,
                                    registry=r, multiprocess_mode="livemax")  # fmt: skip
        self.queue_depth = Gauge(f"{ns}_queue_depth", "Requests waiting for an admission slot.", registry=r,
                                 multiprocess_mode="livesum")  # fmt: skip
        self.capacity_queue_depth = Gauge(f"{ns}_capacity_queue_depth",
                                          "Requests waiting for a worker pair with room (capacity.py).", registry=r,
                                          multiprocess_mode="livesum")  # fmt: skip
        self.active = Gauge(f"{ns}_active_requests", "Requests admitted and not finished.", registry=r,
                            multiprocess_mode="livesum")  # fmt: skip
        self.aborts = Counter(f"{ns}_aborts", "abort_request calls sent to workers, by role.", ["role"], registry=r)

    def render(self) -> bytes:
        if not self.shared_dir:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.shared_dir)
        return generate_latest(merged)

    def forget_worker(self, role: str, url: str) -> None:
        for gauge in (self.in_flight, self.breaker_state, self.worker_healthy):
            if self.shared_dir:
                # The shared files cannot drop a series: a removed worker reads 0 in each.
                gauge.labels(role, url).set(0)
                continue
            with contextlib.suppress(KeyError):
                gauge.remove(role, url)
