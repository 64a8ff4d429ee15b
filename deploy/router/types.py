"""Short type aliases shared by the router's modules."""

from __future__ import annotations

from sglang_pd.deploy.common.contract import Role

__all__ = ["BootstrapRoom", "Role", "WorkerURL"]

WorkerURL = str
"""A worker's base URL, `http://host:port`, without a trailing slash."""

BootstrapRoom = int
"""A random integer in 0..2**63-1 naming one KV hand-off between a prefill and a decode worker."""
