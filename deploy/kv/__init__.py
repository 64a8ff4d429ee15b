"""The KV-transfer layer: Mooncake transfer engine, page-run planning, typed errors, metrics."""

from __future__ import annotations

from .config import DEFAULT_KV_CONFIG, MAX_BATCH_ITEMS, KVConfig
from .engine import EngineState, KVTransferEngine, get_engine
from .exceptions import (
    BadAddress,
    DeviceMissing,
    GpuMemoryUnavailable,
    HandshakeFailed,
    KVError,
    KVSetupError,
    PeerOverloaded,
    PeerUnreachable,
    RegistrationRefused,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from .metrics import TransferMetrics, TransferResult
from .pages import PagedLayout, merge_page_runs, plan_page_writes

__all__ = [
    "DEFAULT_KV_CONFIG",
    "MAX_BATCH_ITEMS",
    "BadAddress",
    "DeviceMissing",
    "EngineState",
    "GpuMemoryUnavailable",
    "HandshakeFailed",
    "KVConfig",
    "KVError",
    "KVSetupError",
    "KVTransferEngine",
    "PagedLayout",
    "PeerOverloaded",
    "PeerUnreachable",
    "RegistrationRefused",
    "TransferError",
    "TransferMetrics",
    "TransferResult",
    "TransferTimeout",
    "TransportUnavailable",
    "get_engine",
    "merge_page_runs",
    "plan_page_writes",
]
