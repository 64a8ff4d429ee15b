"""Where workers registered through the admin API may point (`--worker-hosts`).

A worker URL makes the router send requests there, the worker API key in each probe's
`Authorization` header, and `GET /workers` tells what answered. So `POST /workers` takes a URL
only when its host is allowed:

- the hosts of the workers the router was started with (`--prefill`/`--decode`, the topology),
  even after one of them is removed: re-registering it, or another port of its host, works;
- the hosts of the workers Kubernetes discovery has registered, while it holds them;
- the `--worker-hosts` entries: host names (matched exactly, case-insensitive), IP addresses and
  CIDR ranges.

Nothing else, loopback included: a router started with no workers and no discovery refuses every
`POST /workers` until `--worker-hosts` names where its workers run. Host names are compared as
written, with no DNS lookup (a lookup could block the admin path, and would prove nothing about
the address the router connects to later). Workers given at start and discovered ones are not
checked: they are not admin input.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sglang_pd.deploy.spec.revision import split_revision

from .registry import _HOST, Worker, _literal_address, normalize_url

if TYPE_CHECKING:
    from ..config import RouterConfig

__all__ = ["WorkerHosts", "parse_worker_hosts"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Entries that can only mean an address: digits and dots (a DNS name may be all digits, but
# `300.1.1.1` is a typo, not a name), or a colon (IPv6).
_ADDRESS_LIKE = re.compile(r"^[0-9.]+$|:")


def parse_worker_hosts(entries: Iterable[str]) -> tuple[frozenset[str], tuple[Network, ...]]:
    """`--worker-hosts` entries as (host names, lower-case; networks); ValueError naming a bad one."""
    names: set[str] = set()
    networks: list[Network] = []
    for raw in entries:
        entry = raw.strip()
        if "/" in entry or _ADDRESS_LIKE.search(entry):
            try:
                networks.append(ipaddress.ip_network(entry))
            except ValueError as exc:
                example = "e.g. 10.0.0.7, 10.0.0.0/16 or fd00::/64"
                with contextlib.suppress(ValueError):  # host bits set: the range meant is likely this one
                    example = str(ipaddress.ip_network(entry, strict=False))
                raise ValueError(
                    f"Config 'worker_hosts' has entry {raw!r}, which is not a valid IP address or CIDR range "
                    f"({exc}). Write {example}."
                ) from None
        elif entry and _HOST.match(entry):
            names.add(entry.rstrip(".").lower())
        else:
            raise ValueError(
                f"Config 'worker_hosts' has entry {raw!r}, which is not a host name, IP address or CIDR range. "
                "Write e.g. decode-0.engines, 10.0.0.7 or 10.0.0.0/16."
            )
    return frozenset(names), tuple(networks)


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").rstrip(".").lower()


class WorkerHosts:
    """The hosts `POST /workers` may register workers at (the module docstring says which).

    `allowed`: the `--worker-hosts` entries; `configured`: the URLs of the workers the router
    was started with."""

    def __init__(self, allowed: Iterable[str], configured: Iterable[str]) -> None:
        self._names, self._networks = parse_worker_hosts(allowed)
        self._configured = frozenset(_host(normalize_url(url)) for url in configured)

    @classmethod
    def of(cls, config: RouterConfig) -> WorkerHosts:
        """The router's: its `worker_hosts` and the workers it was started with (checked by
        `add_configured` before)."""
        options = [option for option, _ in config.prefill_workers] + list(config.decode_workers)
        return cls(config.worker_hosts, [split_revision(option)[0] for option in options])

    def refusal(self, url: str, workers: Iterable[Worker]) -> str | None:
        """Why the admin API may not register a worker at `url` (normalized), given the workers
        registered now; None when it may."""
        host = _host(url)
        known = self._configured | {_host(w.url) for w in workers if w.source in ("static", "kubernetes")}
        if host in known or host in self._names:
            return None
        address = _literal_address(host)
        if address is not None:
            if any(address in network for network in self._networks):
                return None
            # Another spelling of a known host's address (2130706433 for 127.0.0.1) is that host.
            if any(_literal_address(k) == address for k in known):
                return None
        shown = host if address is None else str(address)
        fix = f"--worker-hosts {shown}" + ("" if address is None else " (or a CIDR range that holds it)")
        return (
            f"Worker URL {url!r} points at host {host}, which POST /workers may not register: the router sends "
            "the worker API key only to the hosts of the workers it was started with or discovered, and to those "
            f"--worker-hosts allows. Start the router with {fix} to allow it."
        )
