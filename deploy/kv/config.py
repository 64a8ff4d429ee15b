"""KVConfig: how this process's transfer engine talks to its peers."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

__all__ = ["DEFAULT_KV_CONFIG", "ENV_PREFIX", "MAX_BATCH_ITEMS", "KVConfig"]

ENV_PREFIX = "SGLANG_PD_KV_"
# Mooncake's TCP lane refuses (-1) batches of more than about 1024 items per peer, and a refused
# batch can poison later ones to that peer (docs/upstream-facts.md).
MAX_BATCH_ITEMS = 1024
PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True, kw_only=True)
class KVConfig:
    """Transfer-engine settings.

    KVConfig(hostname="10.0.0.5", protocol="rdma", device="mlx5_0")
    KVConfig.from_env()   # SGLANG_PD_KV_HOSTNAME, SGLANG_PD_KV_PROTOCOL, ...
    """

    hostname: str = "127.0.0.1"  # the address peers reach this engine at
    protocol: str = "tcp"  # tcp here, rdma in clusters
    device: str = ""  # RDMA device names (comma-separated); empty for tcp
    timeout_s: float = 10.0  # bound on one transfer call, also handed to Mooncake
    max_batch_items: int = MAX_BATCH_ITEMS  # items per batch call to one peer

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"Config '{ENV_PREFIX}PROTOCOL' has value {self.protocol!r}. Use one of {PROTOCOLS}.")
        if not 1 <= self.max_batch_items <= MAX_BATCH_ITEMS:
            raise ValueError(
                f"Config '{ENV_PREFIX}MAX_BATCH_ITEMS' has value {self.max_batch_items}. "
                f"Use 1..{MAX_BATCH_ITEMS} (Mooncake's per-peer queue limit)."
            )
        if self.timeout_s <= 0:
            raise ValueError(f"Config '{ENV_PREFIX}TIMEOUT_S' has value {self.timeout_s}. Use a positive number.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> KVConfig:
        """Read `SGLANG_PD_KV_<FIELD>` variables; keyword overrides win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key not in env:
                continue
            raw = env[key]
            try:
                values[f.name] = float(raw) if f.type == "float" else int(raw) if f.type == "int" else raw
            except ValueError:
                raise ValueError(f"Config '{key}' has value {raw!r}. Not a valid {f.type}.") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


DEFAULT_KV_CONFIG = KVConfig()
