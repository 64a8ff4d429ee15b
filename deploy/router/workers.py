"""The worker registry: who the router may forward to, and how each worker is doing."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from sglang_pd.deploy.contract import DEFAULT_BOOTSTRAP_PORT

from .breaker import CircuitBreaker
from .exceptions import WorkerRegistrationError
from .types import Role, WorkerURL

__all__ = ["Worker", "WorkerRegistry", "normalize_url"]


# A DNS name (RFC 1123 labels) or an IPv4 address, or an IPv6 address (urlsplit strips its brackets).
_HOST = re.compile(
    r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$|^[0-9A-Fa-f:.]+(?:%[A-Za-z0-9]+)?$"
)


def normalize_url(url: str) -> WorkerURL:
    """`host:port` or `http(s)://host:port[/]` → `http(s)://host:port`; raises on anything else."""
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WorkerRegistrationError(f"Worker URL {url!r} is not valid. Use http://HOST:PORT (or https://HOST:PORT).")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise WorkerRegistrationError(
            f"Worker URL {url!r} has a path, query or credentials. Use http://HOST:PORT only."
        )
    if not _HOST.match(parts.hostname):
        raise WorkerRegistrationError(f"Worker URL {url!r} has no valid host name or IP address. Use http://HOST:PORT.")
    try:
        port = parts.port
    except ValueError as exc:
        raise WorkerRegistrationError(f"Worker URL {url!r} has an invalid port.") from exc
    if port == 0:
        raise WorkerRegistrationError(f"Worker URL {url!r} has port 0. Use the worker's HTTP port.")
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if port is not None:
        netloc += f":{port}"
    return f"{parts.scheme}://{netloc}"


@dataclass(eq=False)
class Worker:
    url: WorkerURL
    role: Role
    breaker: CircuitBreaker
    bootstrap_port: int | None = None
    source: str = "static"  # static | api | kubernetes
    healthy: bool = False
    dp_size: int = 1
    models: list[str] = field(default_factory=list)
    in_flight: int = 0
    dp_in_flight: list[int] = field(default_factory=lambda: [0])
    consecutive_health_failures: int = 0
    consecutive_health_successes: int = 0
    last_error: str = ""
    checked: bool = False
    # Relayed streams open on this worker, and when one of them last received bytes: a worker
    # with open streams and no bytes for the stall time is ejected (health.HealthChecker).
    open_streams: int = 0
    last_stream_bytes: float = 0.0

    def __post_init__(self) -> None:
        self.bootstrap_host: str = urlsplit(self.url).hostname or ""

    def available(self, now: float) -> bool:
        return self.healthy and self.breaker.can_dispatch(now)

    def set_healthy(self, healthy: bool) -> None:
        """Health as the checks see it. A worker coming back also gets its circuit breaker
        closed: the probe has just shown that it answers (health.py says why)."""
        if healthy and not self.healthy and self.breaker.state:
            self.breaker.record_success()
        self.healthy = healthy

    def set_dp_size(self, dp_size: int) -> None:
        dp_size = max(1, int(dp_size))
        if dp_size != self.dp_size:
            self.dp_size = dp_size
            self.dp_in_flight = [0] * dp_size

    def state(self) -> dict[str, Any]:
        """What the health authority knows of this worker (a router process group's shared state;
        breaker and in-flight counts stay with each process)."""
        return {name: getattr(self, name) for name in _SHARED}

    def to_json(self) -> dict[str, Any]:
        shown = ("url", "role", "bootstrap_port", "source", "healthy", "dp_size", "in_flight", "models", "last_error")
        return {**{name: getattr(self, name) for name in shown}, "breaker": self.breaker.state.name.lower()}


# Worker fields that `WorkerRegistry.sync` takes from the health authority.
_SHARED = ("url", "role", "bootstrap_port", "source", "healthy", "dp_size", "models", "last_error", "checked")


class WorkerRegistry:
    """Prefill and decode workers by URL. Single event loop: no locks needed."""

    def __init__(
        self,
        *,
        breaker_failure_threshold: int = 3,
        breaker_cooldown_s: float = 10.0,
    ) -> None:
        self._breaker_failure_threshold = breaker_failure_threshold
        self._breaker_cooldown_s = breaker_cooldown_s
        self._workers: dict[tuple[Role, WorkerURL], Worker] = {}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._listeners: list[Callable[[str, Worker], None]] = []

    def subscribe(self, listener: Callable[[str, Worker], None]) -> None:
        """`listener(event, worker)` is called with event `added` or `removed`."""
        self._listeners.append(listener)

    def add(
        self,
        url: str,
        role: Role,
        *,
        bootstrap_port: int | None = None,
        source: str = "static",
        healthy: bool = False,
    ) -> Worker:
        if role not in ("prefill", "decode"):
            raise WorkerRegistrationError(f"Worker role {role!r} is not valid. Use 'prefill' or 'decode'.")
        norm = normalize_url(url)
        existing = self._workers.get((role, norm))
        if existing is not None:
            if role == "prefill" and bootstrap_port is not None:
                existing.bootstrap_port = int(bootstrap_port)
            return existing
        if role == "prefill":
            if bootstrap_port is None:
                bootstrap_port = DEFAULT_BOOTSTRAP_PORT
            if not 0 < int(bootstrap_port) < 65536:
                raise WorkerRegistrationError(
                    f"Bootstrap port {bootstrap_port!r} of prefill worker {norm} is not a valid port."
                )
        worker = Worker(
            url=norm,
            role=role,
            breaker=CircuitBreaker(
                failure_threshold=self._breaker_failure_threshold,
                cooldown_s=self._breaker_cooldown_s,
                name=f"{role} {norm}",
            ),
            bootstrap_port=int(bootstrap_port) if bootstrap_port is not None else None,
            source=source,
            healthy=healthy,
        )
        self._workers[(role, norm)] = worker
        self._rebuild()
        for listener in self._listeners:
            listener("added", worker)
        return worker

    def remove(self, url: str, role: Role | None = None) -> list[Worker]:
        norm = normalize_url(url)
        removed = [w for (r, u), w in self._workers.items() if u == norm and role in (None, r)]
        for worker in removed:
            del self._workers[(worker.role, worker.url)]
        if removed:
            self._rebuild()
            for worker in removed:
                for listener in self._listeners:
                    listener("removed", worker)
        return removed

    def get(self, url: str, role: Role) -> Worker | None:
        return self._workers.get((role, normalize_url(url)))

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def of(self, role: Role) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode

    def available(self, role: Role, exclude: Iterable[Worker] = ()) -> list[Worker]:
        now = time.monotonic()
        skip = set(map(id, exclude))
        return [w for w in self.of(role) if id(w) not in skip and w.available(now)]

    def ready(self) -> bool:
        return bool(self.available("prefill")) and bool(self.available("decode"))

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for worker in self.decode + self.prefill:
            for model in worker.models:
                seen.setdefault(model, None)
        return list(seen)

    def sync(self, states: list[dict[str, Any]]) -> None:
        """Make the registry hold exactly the workers of `states` (`Worker.state()` dicts, from
        the group's health authority), keeping each kept worker's breaker and in-flight counts."""
        wanted = {(s["role"], s["url"]): s for s in states}
        for role, url in [key for key in self._workers if key not in wanted]:
            self.remove(url, role)
        for (role, url), state in wanted.items():
            worker = self._workers.get((role, url)) or self.add(
                url, role, bootstrap_port=state["bootstrap_port"], source=state["source"]
            )
            worker.bootstrap_port = state["bootstrap_port"]
            worker.set_healthy(state["healthy"])
            worker.set_dp_size(state["dp_size"])
            worker.models = list(state["models"])
            worker.last_error = state["last_error"]
            worker.checked = state["checked"]

    def _rebuild(self) -> None:
        self.prefill = [w for (r, _), w in self._workers.items() if r == "prefill"]
        self.decode = [w for (r, _), w in self._workers.items() if r == "decode"]
