"""The worker registry: who the router may forward to, and how each worker is doing.

Every way in (flags, the topology, `POST /workers`, Kubernetes discovery, a process group's
control process) registers through `WorkerRegistry.add`, which refuses a worker on a link-local
or cloud metadata address unless the router allows them (`refused_address`): a worker URL makes
the router send requests there, the worker API key included. The admin API's registrations must
also point at an allowed host (`hosts.WorkerHosts`, `--worker-hosts`).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sglang_pd.deploy.common.contract import DEFAULT_BOOTSTRAP_PORT
from sglang_pd.deploy.spec.revision import revision_problem, split_revision

from ..exceptions import WorkerRegistrationError
from ..types import Role, WorkerURL
from .breaker import CircuitBreaker

if TYPE_CHECKING:
    from ..config import RouterConfig
    from ..pd.legs import PairStreamOutcome
    from .hosts import WorkerHosts

__all__ = ["Worker", "WorkerRegistry", "add_configured", "normalize_url", "refused_address"]


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


# Cloud instance metadata services (instance credentials among their answers): 169.254.169.254
# (AWS, GCP, Azure, OCI and others), fd00:ec2::254 (AWS over IPv6) and GCP's name for its own.
# Alibaba Cloud's 100.100.100.200 is not refused: it lies in 100.64.0.0/10, which some clusters
# give their pods.
_METADATA_ADDRESSES = frozenset(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254")))
_METADATA_NAMES = frozenset({"metadata.google.internal"})


def _literal_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address `host` is written as, or None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            # The short and numeric IPv4 forms (2852039166, 0xa9.0xfe.0xa9.0xfe, 169.254.43518)
            # name an address too: getaddrinfo, and so connect, reads them as inet_aton does.
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def refused_address(url: str) -> str | None:
    """Why a worker URL may not be registered unless link-local workers are allowed: its host is
    a link-local address (169.254.0.0/16, fe80::/10) or a cloud metadata address or name. None
    when it may.

    Only literal addresses and the metadata services' known names are checked: no DNS lookup on
    the admin path (a lookup here could block it, and would prove nothing about the address the
    name resolves to when the router connects)."""
    host = (urlsplit(url if "://" in url else f"http://{url}").hostname or "").rstrip(".")
    if host in _METADATA_NAMES:
        what = f"{host}, a cloud metadata service"
    else:
        address = _literal_address(host)
        if address is None:
            return None
        written = "" if str(address) == host else f" (written {host})"
        if address in _METADATA_ADDRESSES:
            what = f"{address}{written}, a cloud metadata address"
        elif address.is_link_local:
            what = f"the link-local address {address}{written}"
        else:
            return None
    return (
        f"Worker URL {url!r} names {what}, which the router sends no requests to "
        "unless it is started with --allow-link-local-workers."
    )


@dataclass(eq=False)
class Worker:
    """One worker and how it is doing. Its fields change only through its methods: the health
    authority's verdicts and reports (`record_probe`, `eject`, `take_*`, `apply_state`) and the
    request path's books (`dispatched`/`ended`, `admit`/`release`, the stream methods)."""

    url: WorkerURL
    role: Role
    breaker: CircuitBreaker
    bootstrap_port: int | None = None
    source: str = "static"  # static | api | kubernetes
    # The deployment revision (deploy/spec/revision.py; "" unknown): pairs form within one (revisions.py).
    revision: str = ""
    healthy: bool = False
    dp_size: int = 1
    models: list[str] = field(default_factory=list)
    in_flight: int = 0
    dp_in_flight: list[int] = field(default_factory=lambda: [0])
    consecutive_health_failures: int = 0
    consecutive_health_successes: int = 0
    last_error: str = ""
    checked: bool = False
    # Relayed streams open on this worker (each from its first byte on, with its own stall clock),
    # and when one of them last received bytes: the stall watchdog's input (health.py).
    streams: set[PairStreamOutcome] = field(default_factory=set)
    last_stream_bytes: float = 0.0
    # Capacity as the worker reports it (None: unknown, not enforced), and what the router has
    # sent it that has not ended: requests and estimated tokens (capacity.py).
    max_running: int | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None
    admitted: int = 0
    admitted_tokens: int = 0

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

    # -- the health authority's ----------------------------------------------------------------

    def record_probe(self, ok: bool, error: str, *, generation: bool, admit_after: int, eject_after: int) -> None:
        """Count a probe's outcome (health.py's module docstring has the rules): only a generation
        probe admits, `admit_after` passes in a row readmit an ejected worker; a failed generation
        probe, or `eject_after` failed liveness probes in a row, eject it. A new worker's first
        verdict settles it either way."""
        was_healthy, first = self.healthy, not self.checked
        if ok:
            self.consecutive_health_failures = 0
            if generation and not self.healthy:
                self.consecutive_health_successes += 1
                if first or self.consecutive_health_successes >= admit_after:
                    self.set_healthy(True)
        else:
            self.consecutive_health_successes = 0
            self.consecutive_health_failures += 1
            self.last_error = error
            if first or generation or self.consecutive_health_failures >= eject_after:
                self.set_healthy(False)
        if self.healthy != was_healthy:
            self.consecutive_health_successes = 0
        self.checked = self.checked or generation or not ok

    def eject(self, reason: str) -> None:
        """Out of routing until a generation probe passes again."""
        self.healthy = False
        self.consecutive_health_successes = 0
        self.last_error = reason

    def take_limits(self, max_running: int | None, max_total_tokens: int | None) -> None:
        """The capacity the worker reports (None: unknown, not enforced)."""
        self.max_running, self.max_total_tokens = max_running, max_total_tokens

    def take_context_length(self, context_length: int) -> None:
        self.context_length = context_length

    def take_models(self, models: list[str]) -> None:
        self.models = models

    def apply_state(self, state: dict[str, Any]) -> None:
        """Take what the group's health authority knows (`state()` of its copy)."""
        self.bootstrap_port = state["bootstrap_port"]
        self.revision = state.get("revision", "")
        self.set_healthy(state["healthy"])
        self.set_dp_size(state["dp_size"])
        self.models = list(state["models"])
        self.last_error = state["last_error"]
        self.checked = state["checked"]
        # .get: a state from a control process that predates capacity reports none
        self.max_running = state.get("max_running")
        self.max_total_tokens = state.get("max_total_tokens")
        self.context_length = state.get("context_length")

    # -- the request path's --------------------------------------------------------------------

    def dispatched(self) -> None:
        """A leg is sent to this worker (its breaker books a half-open probe)."""
        self.breaker.on_dispatch()
        self.in_flight += 1

    def ended(self) -> None:
        self.in_flight -= 1

    def failed_with(self, error: str) -> None:
        """A leg to this worker failed: the last error `GET /workers` shows."""
        self.last_error = error

    def admit(self, slots: int, tokens: int) -> None:
        """Count a request's estimated share of this worker's capacity (capacity.py)."""
        self.admitted += slots
        self.admitted_tokens += tokens

    def release(self, slots: int, tokens: int) -> None:
        self.admitted -= slots
        self.admitted_tokens -= tokens

    def stream_opened(self, stream: PairStreamOutcome) -> None:
        """A relayed stream took its first byte: from now on the stall watchdog watches it."""
        self.streams.add(stream)
        self.last_stream_bytes = time.monotonic()

    def stream_progressed(self, now: float) -> None:
        self.last_stream_bytes = now

    def stream_closed(self, stream: PairStreamOutcome) -> None:
        self.streams.discard(stream)

    def state(self) -> dict[str, Any]:
        """What the health authority knows of this worker (a router process group's shared state;
        breaker and in-flight counts stay with each process)."""
        return {name: getattr(self, name) for name in _SHARED}

    def to_json(self) -> dict[str, Any]:
        shown = (
            "url", "role", "bootstrap_port", "source", "revision", "healthy", "dp_size", "in_flight", "models",
            "last_error",
        )  # fmt: skip
        capacity = {
            "max_running_requests": self.max_running,
            "max_total_num_tokens": self.max_total_tokens,
            "context_length": self.context_length,
            "admitted": self.admitted,
            "admitted_tokens": self.admitted_tokens,
        }
        return {
            **{name: getattr(self, name) for name in shown},
            "breaker": self.breaker.state.name.lower(),
            "capacity": capacity,
        }


# Worker fields that `WorkerRegistry.sync` takes from the health authority.
_SHARED = (
    "url", "role", "bootstrap_port", "source", "healthy", "dp_size", "models", "last_error", "checked",
    "max_running", "max_total_tokens", "context_length", "revision",
)  # fmt: skip


class WorkerRegistry:
    """Prefill and decode workers by URL. Single event loop: no locks needed.

    `allow_link_local`: register workers on link-local and cloud metadata addresses too (see
    `refused_address`)."""

    def __init__(
        self,
        *,
        breaker_failure_threshold: int = 3,
        breaker_cooldown_s: float = 10.0,
        allow_link_local: bool = False,
    ) -> None:
        self._breaker_failure_threshold = breaker_failure_threshold
        self._breaker_cooldown_s = breaker_cooldown_s
        self._allow_link_local = allow_link_local
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
        revision: str | None = None,
        default_bootstrap: bool = True,
        hosts: WorkerHosts | None = None,
    ) -> Worker:
        """Register a worker, or update the bootstrap port and revision of one registered (None: kept).
        A new prefill worker without a bootstrap port gets sglang's default (8998), unless not
        `default_bootstrap`: then it has none, and its requests carry `bootstrap_port: null`, which
        each engine replaces with its own `--disaggregation-bootstrap-port` (sglang's scheduler,
        `handle_generate_request`), as smg does for `--prefill URL` without a port. `hosts`: the
        hosts the admin API may register at (`--worker-hosts`), for its registrations."""
        if role not in ("prefill", "decode"):
            raise WorkerRegistrationError(f"Worker role {role!r} is not valid. Use 'prefill' or 'decode'.")
        if revision and (problem := revision_problem(revision)) is not None:
            raise WorkerRegistrationError(f"Worker {url}: {problem}")
        norm = normalize_url(url)
        if not self._allow_link_local and (refusal := refused_address(norm)) is not None:
            raise WorkerRegistrationError(refusal)
        if hosts is not None and (refusal := hosts.refusal(norm, self.all())) is not None:
            raise WorkerRegistrationError(refusal)
        existing = self._workers.get((role, norm))
        if existing is not None:
            if role == "prefill" and bootstrap_port is not None:
                existing.bootstrap_port = int(bootstrap_port)
            if revision is not None:
                existing.revision = revision
            return existing
        if role == "prefill":
            if bootstrap_port is None and default_bootstrap:
                bootstrap_port = DEFAULT_BOOTSTRAP_PORT
            if bootstrap_port is not None and not 0 < int(bootstrap_port) < 65536:
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
            revision=revision or "",
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
                url, role, bootstrap_port=state["bootstrap_port"], source=state["source"],
                revision=state.get("revision"),
            )  # fmt: skip
            worker.apply_state(state)

    def _rebuild(self) -> None:
        self.prefill = [w for (r, _), w in self._workers.items() if r == "prefill"]
        self.decode = [w for (r, _), w in self._workers.items() if r == "decode"]


def add_configured(registry: WorkerRegistry, config: RouterConfig) -> None:
    """Register the workers a router was started with; each URL may end in `@REVISION` (`--prefill`,
    `--decode`; `router --help`)."""
    try:
        for option, bootstrap_port in config.prefill_workers:
            url, revision = split_revision(option)
            registry.add(url, "prefill", bootstrap_port=bootstrap_port, revision=revision, default_bootstrap=False)
        for option in config.decode_workers:
            url, revision = split_revision(option)
            registry.add(url, "decode", revision=revision)
    except ValueError as exc:  # split_revision's, which names the fix
        raise WorkerRegistrationError(str(exc)) from None
