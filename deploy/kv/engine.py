"""KVTransferEngine: one Mooncake transfer engine per process (P2P handshake, no metadata server).

    engine = get_engine(KVConfig.from_env())
    engine.register(pool_ptr, pool_bytes)                          # once per region
    engine.write_pages(peer_session, src_layout, dst_layout, src_pages, dst_pages)

Writes go prefill → decode into pages the decode side registered, as sglang does. Every
failure is a typed KVError within `timeout_s`; see exceptions.py for the tree.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from .config import KVConfig
from .exceptions import (
    BadAddress,
    KVError,
    PeerUnreachable,
    RegistrationRefused,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    error_for_code,
    map_mooncake_exceptions,
)
from .listeners import Listener, exposure_warning, listening_sockets, range_held_note
from .metrics import TransferMetrics, TransferResult
from .pages import PagedLayout, TransferItem, plan_page_writes, split_batches

__all__ = ["EngineState", "KVTransferEngine", "get_engine", "reset_engine_for_tests"]

log = logging.getLogger("sglang_pd.kv")


class EngineState(enum.Enum):
    UNOPENED = 1  # constructed; Mooncake not initialised yet
    OPENED = 2  # initialised; can register memory and write
    CLOSED = 3  # closed; every call raises RuntimeError


def _load_mooncake() -> Any:
    with map_mooncake_exceptions(op="import"):
        from mooncake.engine import TransferEngine

    return TransferEngine


class KVTransferEngine:
    """This process's Mooncake engine, its registered regions and its transfer metrics."""

    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.metrics = TransferMetrics()
        self._state = EngineState.UNOPENED
        self._te: Any = None
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.session_id = ""
        # The TCP sockets Mooncake listens on (handshake and data), once open; empty without /proc.
        self.listeners: tuple[Listener, ...] = ()

    def __repr__(self) -> str:
        return f"KVTransferEngine(session_id={self.session_id!r}, state={self._state.name}, config={self.config!r})"

    @property
    def state(self) -> EngineState:
        return self._state

    def open(self) -> KVTransferEngine:
        if self._state is EngineState.CLOSED:
            raise RuntimeError("Cannot open the transfer engine, as it has been closed.")
        if self._state is EngineState.OPENED:
            return self
        if self.config.protocol == "rdma":
            self._check_rdma_devices()
        # Mooncake reads its timeout from the environment when the engine is created.
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, math.ceil(self.config.timeout_s))))
        cls = _load_mooncake()
        te = cls()
        before = listening_sockets()
        with map_mooncake_exceptions(op="initialize"):
            rc = te.initialize(self.config.hostname, "P2PHANDSHAKE", self.config.protocol, self.config.device)
        if rc != 0:
            rdma = " and that the RDMA device exists" if self.config.protocol == "rdma" else ""
            hint = range_held_note() or f"check that the host name is this machine's address{rdma}."
            where = f"a {self.config.protocol} engine on {self.config.hostname}"
            raise TransportUnavailable(f"Mooncake could not start {where} (code {rc}); {hint}")
        self._te = te
        rpc_port = te.get_rpc_port()
        self.session_id = f"{self.config.hostname}:{rpc_port}"
        self._state = EngineState.OPENED
        log.info("kv engine opened", extra={"session_id": self.session_id, "protocol": self.config.protocol})
        self._note_listeners(before, rpc_port)
        return self

    def _note_listeners(self, before: set[Listener] | None, rpc_port: int) -> None:
        # What initialize() opened is Mooncake's: the engine opens before this process serves
        # anything else (the reference engine starts its HTTP servers afterwards).
        after = listening_sockets()
        if before is None or after is None:
            return  # no /proc here: nothing to report
        self.listeners = tuple(sorted(after - before))
        warning = exposure_warning(self.listeners, hostname=self.config.hostname, handshake_port=rpc_port)
        if warning:
            log.warning(warning)

    def _check_rdma_devices(self) -> None:
        from .exceptions import DeviceMissing

        present = set(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else set()
        wanted = [d.split(":")[0] for d in self.config.device.split(",") if d]
        missing = [d for d in wanted if d not in present]
        if not present or missing:
            raise DeviceMissing(
                f"RDMA device {missing or '(any)'} not found in /sys/class/infiniband (present: {sorted(present)}); "
                "set SGLANG_PD_KV_DEVICE to one of them, mount /dev/infiniband into the container, or use tcp."
            )

    def _require_open(self, what: str) -> Any:
        if self._state is EngineState.CLOSED:
            raise RuntimeError(f"Cannot {what}, as the transfer engine has been closed.")
        if self._state is EngineState.UNOPENED:
            self.open()
        return self._te

    def register(self, addr: int, length: int) -> None:
        """Register a memory region once; registering the same region again is a no-op."""
        te = self._require_open("register memory")
        with self._lock:
            if (addr, length) in self._regions:
                return
            for a, n in self._regions:
                if addr < a + n and a < addr + length:
                    raise RegistrationRefused(
                        f"Region [{addr:#x}, +{length}) overlaps the registered region [{a:#x}, +{n}); "
                        "register each KV pool once."
                    )
            with map_mooncake_exceptions(op="register_memory"):
                rc = te.register_memory(addr, length)
            if rc != 0:
                exc = error_for_code(rc, op="register_memory")
                if not isinstance(exc, RegistrationRefused):
                    exc = RegistrationRefused(
                        f"Mooncake refused to register {length} bytes at {addr:#x} (code {rc}); with rdma, raise the "
                        "locked-memory limit (ulimit -l unlimited, or the IPC_LOCK capability in containers)."
                    )
                raise exc
            self._regions.append((addr, length))

    def _check_local(self, items: Sequence[TransferItem]) -> None:
        for src, _, n in items:
            if not any(a <= src and src + n <= a + length for a, length in self._regions):
                raise BadAddress(f"Source [{src:#x}, +{n}) is not inside a region registered with this engine.")

    def probe(self, peer: str) -> None:
        """Raise PeerUnreachable unless `peer` answers Mooncake's probe."""
        te = self._require_open("probe a peer")
        with map_mooncake_exceptions(op="send_probe", peer=peer):
            rc = te.send_probe(peer)
        if rc != 0:
            raise error_for_code(rc, op="send_probe", peer=peer)

    def write(self, peer: str, items: Sequence[TransferItem], *, pages: int = 0) -> TransferResult:
        """Write `items` to `peer` in batches of at most `max_batch_items`; typed errors, bounded time."""
        te = self._require_open("start a transfer")
        self._check_local(items)
        t0 = time.perf_counter()
        batches = split_batches(items, self.config.max_batch_items)
        try:
            for batch in batches:
                srcs = [i[0] for i in batch]
                dsts = [i[1] for i in batch]
                lens = [i[2] for i in batch]
                with map_mooncake_exceptions(op="batch_transfer_sync_write", peer=peer):
                    rc = te.batch_transfer_sync_write(peer, srcs, dsts, lens)
                if rc != 0:
                    raise self._diagnose(rc, peer, time.perf_counter() - t0)
        except KVError as exc:
            self.metrics.record_failure(type(exc).__name__)
            raise
        result = TransferResult(
            peer=peer,
            bytes=sum(i[2] for i in items),
            pages=pages,
            items=len(items),
            batches=len(batches),
            seconds=time.perf_counter() - t0,
        )
        self.metrics.record(result)
        return result

    def _diagnose(self, rc: int, peer: str, elapsed: float) -> KVError:
        # -1 is Mooncake's catch-all (dead peer, rejected address, full queue): narrow it down.
        if rc == -1:
            if elapsed >= self.config.timeout_s:
                return TransferTimeout(
                    f"Write to {peer} did not finish within {self.config.timeout_s:.1f} s (Mooncake code -1).",
                    peer=peer,
                    code=rc,
                )
            try:
                self.probe(peer)
            except PeerUnreachable as exc:
                return PeerUnreachable(
                    f"Write to {peer} failed: the peer does not answer (probe: {exc}); is the decode engine running?",
                    peer=peer,
                    code=rc,
                )
            except TransferError:
                pass
            return BadAddress(
                f"Write to {peer} was rejected (Mooncake code -1) although the peer answers: a destination address "
                "is outside the peer's registered region, or its queue is full.",
                peer=peer,
                code=rc,
            )
        return error_for_code(rc, op="batch_transfer_sync_write", peer=peer)

    def write_pages(
        self,
        peer: str,
        src: PagedLayout,
        dst: PagedLayout,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
    ) -> TransferResult:
        """Write the KV pages `src_pages` (every layer) into the peer's `dst_pages`."""
        try:
            items = plan_page_writes(src, dst, src_pages, dst_pages)
        except (ValueError, IndexError) as exc:
            self.metrics.record_failure(BadAddress.__name__)
            raise BadAddress(str(exc), peer=peer) from exc
        return self.write(peer, items, pages=len(src_pages))

    def close(self) -> None:
        """Drop the engine; Mooncake frees its resources when the process exits."""
        self._state = EngineState.CLOSED
        self._te = None
        self._regions.clear()


_ENGINE: KVTransferEngine | None = None
_ENGINE_LOCK = threading.Lock()


def get_engine(config: KVConfig | None = None) -> KVTransferEngine:
    """This process's one engine, opened on first use (a second config must equal the first)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            _ENGINE = KVTransferEngine(config or KVConfig.from_env()).open()
        elif config is not None and config != _ENGINE.config:
            raise RuntimeError(
                f"Cannot open a second transfer engine with {config!r}; this process already has one with "
                f"{_ENGINE.config!r} (one engine per process)."
            )
        return _ENGINE


def reset_engine_for_tests() -> None:
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is not None:
            _ENGINE.close()
        _ENGINE = None
