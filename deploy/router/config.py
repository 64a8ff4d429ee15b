"""The router's configuration: one keyword-only value class with documented defaults."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_BOOTSTRAP_PORT",
    "POLICIES",
    "PREFILL_ONLY_POLICIES",
    "KubernetesDiscoveryConfig",
    "RouterConfig",
]

DEFAULT_BOOTSTRAP_PORT = 8998
POLICIES = ("round_robin", "random", "power_of_two", "least_load", "cache_aware")
PREFILL_ONLY_POLICIES = ("cache_aware",)


@dataclass(frozen=True, kw_only=True)
class KubernetesDiscoveryConfig:
    """Find workers by pod label selectors (`key=value,...`) in one namespace."""

    namespace: str = "default"
    prefill_selector: str = "sglang-pd/role=prefill"
    decode_selector: str = "sglang-pd/role=decode"
    port: int = 30000
    port_annotation: str = "sglang-pd/port"
    bootstrap_port_annotation: str = "sglang-pd/bootstrap-port"


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    # Admission: 0 disables the limit. Requests beyond max_concurrent wait in a queue of
    # max_queued for at most queue_timeout_s, then get 429.
    max_concurrent_requests: int = 0
    max_queued_requests: int = 256
    queue_timeout_s: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    # Timeouts towards workers. request_timeout_s bounds a whole non-streaming request and the
    # time to a stream's first byte; stream_idle_timeout_s bounds the gap between two chunks.
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 120.0
    max_retries: int = 2
    retry_backoff_s: float = 0.05
    retry_max_backoff_s: float = 1.0
    # Health checks and the per-worker circuit breaker.
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    health_failure_threshold: int = 2
    health_success_threshold: int = 1
    breaker_failure_threshold: int = 3
    breaker_cooldown_s: float = 10.0
    # Security. API keys guard the inference endpoints and /v1/models; the admin key guards
    # /workers. Empty means off (and /workers then only answers GET).
    api_keys: tuple[str, ...] = ()
    admin_key: str = ""
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    kubernetes: KubernetesDiscoveryConfig | None = None
    prefill_workers: tuple[tuple[str, int | None], ...] = field(default=())
    decode_workers: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for role, name in (("prefill", self.prefill_policy), ("decode", self.decode_policy)):
            if name not in POLICIES:
                raise ValueError(f"Config '{role}_policy' has value {name!r}. Use one of: {', '.join(POLICIES)}.")
        if self.decode_policy in PREFILL_ONLY_POLICIES:
            raise ValueError(
                f"Config 'decode_policy' has value {self.decode_policy!r}, which is for prefill only. "
                "Use round_robin, random, power_of_two or least_load for decode."
            )
        for name in ("max_concurrent_requests", "max_queued_requests", "max_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"Config '{name}' has value {getattr(self, name)}. It must be >= 0.")
        for name in ("queue_timeout_s", "request_timeout_s", "connect_timeout_s", "health_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Config '{name}' has value {getattr(self, name)}. It must be > 0.")

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
