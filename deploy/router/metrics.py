"""Prometheus metrics, in a registry per router instance (tests run several routers).

In a router process group (`group.py`) every serving process is started with
PROMETHEUS_MULTIPROC_DIR set: prometheus_client then keeps each process's values in files there,
and a scrape of any process renders all of them (counters and histograms summed; each gauge as its
`multiprocess_mode` says, over the live processes). The files cannot drop a series: the
per-worker gauges of a removed worker stay, at 0, until the group restarts.

Names follow Prometheus's conventions (base units, `_seconds`, counters `_total`), and reuse
sglang's where the meaning is the same (sglang 0.5.23 `srt/observability/metrics_collector.py`:
`time_to_first_token_seconds`, `request_time_per_output_token_seconds`,
`e2e_request_latency_seconds`), so a panel can put the router's curve beside the engines'.
Latencies carry an `outcome` label (`outcome()`): an error answer, the router's own (401, 429,
503, ...) included, is never in the `ok` series.
"""

from __future__ import annotations

import contextlib
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["CONTENT_TYPE_LATEST", "OUTCOMES", "TTFT_PARTS", "RouterMetrics", "outcome"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Per output token: sglang's inter-token buckets span 2 ms to 8 s.
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)

OUTCOMES = ("ok", "client_error", "upstream_error", "rejected")
# The parts of a streamed request's time to first token (timing.py), in the order they happen.
TTFT_PARTS = ("queue", "retry", "prefill", "transfer", "decode", "router")


def outcome(status: int) -> str:
    """The `outcome` label of an answer with HTTP `status`: `rejected` for 429 and 503 (the router's
    admission, draining, no healthy worker, or the workers full: retry later), `client_error` for
    other 4xx and 499 (the client left), `upstream_error` for other 5xx (a worker failed or timed
    out; a stream that broke after its 200 is labelled by its caller)."""
    if status < 400:
        return "ok"
    if status in (429, 503):
        return "rejected"
    return "client_error" if status < 500 else "upstream_error"


class RouterMetrics:
    def __init__(self) -> None:
        self.shared_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # prometheus_client reads it at import
        self.registry = r = CollectorRegistry(auto_describe=True)
        ns = "sglang_pd_router"
        by_worker = ["role", "worker"]
        self.requests = Counter(f"{ns}_requests", "Requests answered, by endpoint and HTTP status.",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.e2e = Histogram(f"{ns}_e2e_request_latency_seconds",
                             "Time from the request's arrival to the last byte of its answer, by outcome "
                             "(ok, client_error, upstream_error, rejected).", ["endpoint", "outcome"],
                             buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttft = Histogram(f"{ns}_time_to_first_token_seconds",
                              "Streamed requests only: time from the request's arrival to the decode's first "
                              "chunk (its first token) going to the client.", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram(f"{ns}_request_time_per_output_token_seconds",
                              "Streamed requests of two chunks or more: (last chunk - first chunk) / (chunks - 1) "
                              "of the decode's stream, by outcome. A chunk is one sglang output step (one token "
                              "at sglang's default --stream-interval 1; the final [DONE] may come as a chunk "
                              "of its own).", ["endpoint", "outcome"], buckets=_TOKEN_BUCKETS,
                              registry=r)  # fmt: skip
        self.ttft_part = Histogram(f"{ns}_time_to_first_token_part_seconds",
                                   "Streamed requests: where the time to first token went (part: queue = "
                                   "admission and capacity waits, retry = failed attempts and their backoff, "
                                   "prefill = prefill leg sent to its forward pass done, transfer = from there to "
                                   "the prefill's answer (the KV transfer; 0 where the engine reports no "
                                   "prefill_finished_time), decode = decode's first token after that, "
                                   "router = the rest, the router's own work), by the worker of the part.",
                                   ["part", "role", "worker"], buckets=_LATENCY_BUCKETS,
                                   registry=r)  # fmt: skip
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
        # Pairs within one revision (workers/revisions.py): a cross-revision pair would send KV to a decode
        # that may not read it, so its counter must stay 0.
        self.revision_requests = Counter(f"{ns}_revision_requests",
                                         "Requests sent to a prefill/decode pair, by the pair's revision (a retried "
                                         "request counts once per pair).", ["revision"], registry=r)  # fmt: skip
        self.cross_revision_pairs = Counter(f"{ns}_cross_revision_pairs",
                                            "Pairs whose prefill and decode have different revisions; always 0.",
                                            registry=r)  # fmt: skip
        # Traffic during a rollout (workers/rollout.py): client requests stay on the approved revision.
        self.revision_traffic = Counter(f"{ns}_revision_traffic",
                                        "Pairs picked by revision and route: client (the approved revision), canary "
                                        "(--canary-share) or pinned (x-sglpd-revision with the admin key).",
                                        ["revision", "route"], registry=r)  # fmt: skip
        self.revision_approved = Gauge(f"{ns}_revision_approved",
                                       "1 for the revision client requests go to, 0 for one approved before.",
                                       ["revision"], registry=r, multiprocess_mode="livemax")  # fmt: skip

        # Request migration (pd/migration.py): a stream whose decode failed mid-stream moves to another pair.
        self.migrations = Counter(f"{ns}_migrations",
                                  "Streams whose decode failed mid-stream, by outcome: migrated (the stream went on "
                                  "on another pair), limit (migration_limit reached), not_resumable (prompt ids "
                                  "unknown or token budget spent), failed (no pair took the continuation).",
                                  ["outcome"], registry=r)  # fmt: skip
        self.migration_seconds = Histogram(f"{ns}_migration_latency_seconds",
                                           "Latency a migration adds to its stream: the decode's failure seen to the "
                                           "new decode's first chunk.", buckets=_LATENCY_BUCKETS,
                                           registry=r)  # fmt: skip

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
