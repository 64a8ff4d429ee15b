"""The router's configuration: one keyword-only value class with documented defaults.

The settings a topology's `router:` section holds take their defaults from `RouterSpec`, so the
router has one default set whether it starts from a topology or from flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sglang_pd.deploy.common.contract import (
    ANNOTATION_BOOTSTRAP_PORT,
    ANNOTATION_PORT,
    DEFAULT_PREFILL_PORT,
    policy_problem,
    worker_selector,
)
from sglang_pd.deploy.common.http_limits import ConnectionLimits
from sglang_pd.deploy.spec.revision import revision_problem
from sglang_pd.deploy.spec.topology import RouterSpec

from .transport.client import Timeouts
from .workers.hosts import parse_worker_hosts

__all__ = ["KubernetesDiscoveryConfig", "RouterConfig"]

_SPEC = RouterSpec()
_LIMITS = ConnectionLimits()
# RouterConfig fields a topology's RouterSpec sets (same names).
SPEC_FIELDS = (
    "host",
    "port",
    "prefill_policy",
    "decode_policy",
    "max_concurrent_requests",
    "max_queued_requests",
    "queue_timeout_s",
    "request_timeout_s",
)

# RouterConfig fields that must be > 0.
_POSITIVE = (
    "max_body_bytes",
    "max_body_bytes_in_flight",
    "header_timeout_s",
    "body_timeout_s",
    "body_grace_s",
    "keep_alive_timeout_s",
    "queue_timeout_s",
    "request_timeout_s",
    "connect_timeout_s",
    "health_interval_s",
    "health_timeout_s",
    "health_generate_interval_s",
    "health_generate_timeout_s",
)


@dataclass(frozen=True, kw_only=True)
class KubernetesDiscoveryConfig:
    """Find workers by pod label selectors (`key=value,...`) in one namespace; the defaults select
    the leader pods of every sglang-pd release, labelled as the chart labels them."""

    namespace: str = "default"
    prefill_selector: str = worker_selector("prefill")
    decode_selector: str = worker_selector("decode")
    port: int = DEFAULT_PREFILL_PORT
    port_annotation: str = ANNOTATION_PORT
    bootstrap_port_annotation: str = ANNOTATION_BOOTSTRAP_PORT


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    host: str = _SPEC.host
    port: int = _SPEC.port
    prefill_policy: str = _SPEC.prefill_policy
    decode_policy: str = _SPEC.decode_policy
    # Admission: 0 disables the limit. Requests beyond max_concurrent wait in a queue of
    # max_queued for at most queue_timeout_s, then get 429.
    max_concurrent_requests: int = _SPEC.max_concurrent_requests
    max_queued_requests: int = _SPEC.max_queued_requests
    queue_timeout_s: float = _SPEC.queue_timeout_s
    # The share of the decodes' request slots and KV tokens no one client may hold, even alone: kept
    # for the next client to arrive (workers/capacity.py). 0: a client alone may take them all.
    client_reserve: float = 0.0
    # A request body's bytes (413 beyond), and the bytes of all bodies the router holds at once
    # (503 + Retry-After beyond): 8 MiB holds a 160k-token prompt even JSON-escaped, and the
    # whole-router bound keeps many large bodies from taking the router's memory.
    max_body_bytes: int = 8 * 1024 * 1024
    max_body_bytes_in_flight: int = 256 * 1024 * 1024
    # Per connection (deploy/common/http_limits.py), checked while bytes arrive, before auth: the request
    # head (414 / 431 beyond), the time to send a head and a body (408: all of it within
    # body_timeout_s, and after body_grace_s at least body_min_rate bytes/s on average; 0: no rate),
    # the connections held open at once (503 beyond; 0: as many as descriptors allow) and one source
    # address's share of them (503 beyond), the idle keep-alive time.
    max_request_line_bytes: int = _LIMITS.max_request_line_bytes
    max_header_bytes: int = _LIMITS.max_head_bytes
    max_header_count: int = _LIMITS.max_header_count
    header_timeout_s: float = _LIMITS.header_timeout_s
    body_timeout_s: float = _LIMITS.body_timeout_s
    body_grace_s: float = _LIMITS.body_grace_s
    body_min_rate: int = _LIMITS.body_min_rate
    max_connections: int = _LIMITS.max_connections
    source_share: float = _LIMITS.source_share
    keep_alive_timeout_s: float = 30.0
    # Timeouts towards workers. request_timeout_s bounds a whole non-streaming request and the
    # time to a stream's first byte; stream_idle_timeout_s bounds the gap between two chunks.
    connect_timeout_s: float = 3.0
    request_timeout_s: float = _SPEC.request_timeout_s
    stream_idle_timeout_s: float = 120.0
    # A streamed answer whose client has taken none of the router's bytes for this long (its socket
    # and the router's buffer full) is cut, and its engines' work aborted: a slow reader would hold
    # a decode slot while the decode generates on. 0: off.
    slow_reader_timeout_s: float = 30.0
    max_retries: int = 2
    # Moves of one stream to another pair when its decode fails mid-stream (pd/migration.py); 0: off.
    migration_limit: int = 1
    retry_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    # Health checks (health.py says how they fit sglang's /health, a one-token generation that
    # answers after 1 s at best and 20 s at worst), the stall watchdog and the circuit breaker.
    # Liveness (GET /v1/models, answered by sglang's HTTP process in milliseconds however busy its
    # scheduler) every health_interval_s with health_timeout_s, and health_failure_threshold
    # failures in a row eject: a frozen worker is out within 2 x 0.5 + 1 = 2 s. The generation
    # probe (GET /health) admits a worker (every health_interval_s until it passes) and checks an
    # admitted one every health_generate_interval_s; health_generate_timeout_s is sglang's own 20 s
    # limit plus margin.
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    health_generate_interval_s: float = 30.0
    health_generate_timeout_s: float = 25.0
    stream_stall_s: float = 5.0  # open streams without bytes this long eject the worker; 0: off
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 10.0
    # Security. API keys guard the inference endpoints and /v1/models; the admin key guards
    # /workers. Empty means off (and /workers then only answers GET).
    api_keys: tuple[str, ...] = ()
    admin_key: str = ""
    # Workers on link-local addresses (169.254.0.0/16, fe80::/10) and cloud metadata addresses
    # are refused, from every source, unless this is set (workers.refused_address).
    allow_link_local_workers: bool = False
    # Host names, IP addresses and CIDR ranges POST /workers may register workers at, besides the
    # hosts of the workers given at start and of discovered ones (workers/hosts.py).
    worker_hosts: tuple[str, ...] = ()
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    # A collector's OTLP/HTTP traces URL; empty: no traces (tracing.py).
    otlp_traces_endpoint: str = ""
    kubernetes: KubernetesDiscoveryConfig | None = None
    # Client requests sent to a candidate revision while another is approved (workers/rollout.py); 0: none.
    canary_share: float = 0.0
    # The revision approved at start ("": the first with a healthy pair), e.g. the last one the gate approved.
    approved_revision: str = ""
    # Static workers: each URL may end in `@REVISION`, the worker's revision (registry.add_configured).
    prefill_workers: tuple[tuple[str, int | None], ...] = field(default=())
    decode_workers: tuple[str, ...] = field(default=())

    @classmethod
    def from_spec(cls, spec: RouterSpec, **fields: Any) -> RouterConfig:
        """A topology's router settings, then `fields` over them."""
        return cls(**{**{name: getattr(spec, name) for name in SPEC_FIELDS}, **fields})

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The limits every client connection is held to."""
        return ConnectionLimits(
            max_request_line_bytes=self.max_request_line_bytes,
            max_head_bytes=self.max_header_bytes,
            max_header_count=self.max_header_count,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            body_grace_s=self.body_grace_s,
            body_min_rate=self.body_min_rate,
            max_connections=self.max_connections,
            source_share=self.source_share,
        )

    @property
    def timeouts(self) -> Timeouts:
        """The timeouts of requests to workers."""
        return Timeouts(
            connect=self.connect_timeout_s,
            request=self.request_timeout_s,
            stream_idle=self.stream_idle_timeout_s,
            health=self.health_timeout_s,
            health_generate=self.health_generate_timeout_s,
        )

    def __post_init__(self) -> None:
        for role, name in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            problem = policy_problem(role, name)
            if problem is not None:
                raise ValueError(f"Config '{role}_policy' has value {name!r}: {problem}")
        for name in ("max_concurrent_requests", "max_queued_requests", "max_retries", "max_connections",
                     "migration_limit", "body_min_rate", "slow_reader_timeout_s"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"Config '{name}' has value {getattr(self, name)}. It must be >= 0.")
        for name in ("health_failure_threshold", "health_success_threshold"):
            if getattr(self, name) < 1:
                raise ValueError(f"Config '{name}' has value {getattr(self, name)}. It must be >= 1.")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ValueError(f"Config '{name}' has value {getattr(self, name)}. It must be > 0.")
        parse_worker_hosts(self.worker_hosts)  # a bad entry is refused here, with the fix
        if self.approved_revision and (problem := revision_problem(self.approved_revision)) is not None:
            raise ValueError(f"Config 'approved_revision': {problem}")
        if not 0 <= self.canary_share <= 1:
            raise ValueError(
                f"Config 'canary_share' has value {self.canary_share}. It must be between 0 and 1 (0: no canary)."
            )
        if not 0 <= self.client_reserve < 1:
            raise ValueError(
                f"Config 'client_reserve' has value {self.client_reserve}. It must be >= 0 and < 1: the share of "
                "the decodes' slots and tokens kept from any one client (0: no reserve)."
            )
        if not 0 < self.source_share <= 1:
            raise ValueError(
                f"Config 'source_share' has value {self.source_share}. It must be > 0 and <= 1: the fraction of "
                "max_connections one client address may hold (1: no share of its own)."
            )

    def __repr__(self) -> str:
        fields = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "api_keys":
                value = tuple("********" for _ in value)
            elif f.name == "admin_key" and value:
                value = "********"
            fields.append(f"{f.name}={value!r}")
        return f"RouterConfig({', '.join(fields)})"
