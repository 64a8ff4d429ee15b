"""The KV-transfer layer's exceptions.

    KVError
    ├── KVSetupError                the transfer engine could not start or register memory
    │   ├── TransportUnavailable    the Mooncake module, protocol or transport cannot be used here
    │   │   └── DeviceMissing       the RDMA device named in the config does not exist
    │   ├── RegistrationRefused     memory registration failed (memlock limit, overlap, no memory)
    │   └── GpuMemoryUnavailable    GPU memory was asked for where there is none (no CUDA torch or GPU)
    └── TransferError               a write to a peer failed (carries the peer and Mooncake's code)
        ├── PeerUnreachable         the peer is down, refused the connection or is unknown
        │   └── HandshakeFailed     the peer answered but the handshake or its metadata was refused
        ├── BadAddress              an address is outside a registered region on one side
        ├── PeerOverloaded          the peer or the local queue refused more work for now
        └── TransferTimeout         the write did not finish within the configured time

Mooncake reports failures as negative integers, never exceptions. `error_for_code()` maps each
known code (`MOONCAKE_ERROR_CODES`) to the most specific class; an unknown code becomes a plain
`TransferError` that still names the code. `map_mooncake_exceptions()` does the same for the
exceptions the bindings themselves raise (bad argument types, a closed engine), chained with
`from exc`; anything else is re-raised unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "MOONCAKE_ERROR_CODES",
    "BadAddress",
    "DeviceMissing",
    "GpuMemoryUnavailable",
    "HandshakeFailed",
    "KVError",
    "KVSetupError",
    "PeerOverloaded",
    "PeerUnreachable",
    "RegistrationRefused",
    "TransferError",
    "TransferTimeout",
    "TransportUnavailable",
    "error_for_code",
    "map_mooncake_exceptions",
]


class KVError(Exception):
    """Base class of every error the KV-transfer layer raises on purpose."""


class KVSetupError(KVError):
    """The transfer engine could not start or register memory."""


class TransportUnavailable(KVSetupError):
    """The Mooncake module, protocol or transport cannot be used on this machine."""


class DeviceMissing(TransportUnavailable):
    """The RDMA device named in the configuration does not exist on this machine."""


class RegistrationRefused(KVSetupError):
    """Registering a memory region failed (locked-memory limit, overlap, or out of memory)."""


class GpuMemoryUnavailable(KVSetupError):
    """GPU memory was asked for, but this process has no CUDA torch, no visible GPU or no CUDA Mooncake."""


class TransferError(KVError):
    """A write to a peer failed."""

    def __init__(self, message: str, *, peer: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code


class PeerUnreachable(TransferError):
    """The peer is down, refused the connection, or is not known."""


class HandshakeFailed(PeerUnreachable):
    """The peer answered, but refused the handshake or sent metadata that could not be read."""


class BadAddress(TransferError):
    """A source or destination address lies outside a registered region."""


class PeerOverloaded(TransferError):
    """The peer or the local transfer queue refused more work for now; retry later."""


class TransferTimeout(TransferError):
    """The write did not finish within the configured time."""


# Mooncake's transfer-engine error codes (mooncake-transfer-engine/include/error.h), with the
# class each maps to and what a user can do about it. -1 is Mooncake's catch-all: the engine
# narrows it down by probing the peer before raising (see KVTransferEngine.write).
MOONCAKE_ERROR_CODES: dict[int, tuple[str, type[KVError], str]] = {
    -1: ("ERR_INVALID_ARGUMENT", BadAddress, "an address or length is invalid, or the peer rejected the write"),
    -2: ("ERR_TOO_MANY_REQUESTS", PeerOverloaded, "too many requests are queued; keep batches at or under 1024"),
    -3: ("ERR_ADDRESS_NOT_REGISTERED", BadAddress, "the address is not inside a registered region"),
    -4: ("ERR_BATCH_BUSY", PeerOverloaded, "the batch is still in use"),
    -6: ("ERR_DEVICE_NOT_FOUND", DeviceMissing, "the RDMA device does not exist; check /sys/class/infiniband"),
    -7: ("ERR_ADDRESS_OVERLAPPED", RegistrationRefused, "the region overlaps one already registered"),
    -101: ("ERR_DNS", PeerUnreachable, "the peer's host name does not resolve"),
    -102: ("ERR_SOCKET", PeerUnreachable, "the peer refused the connection or is down"),
    -103: ("ERR_MALFORMED_JSON", HandshakeFailed, "the peer's handshake could not be parsed (version mismatch?)"),
    -104: ("ERR_REJECT_HANDSHAKE", HandshakeFailed, "the peer rejected the handshake"),
    -200: ("ERR_METADATA", HandshakeFailed, "the peer's segment metadata could not be read"),
    -201: ("ERR_ENDPOINT", PeerUnreachable, "the connection endpoint to the peer failed"),
    -202: ("ERR_CONTEXT", TransportUnavailable, "the transport context (RDMA device) could not be opened"),
    -203: ("ERR_ENDPOINT_NOT_FOUND", PeerUnreachable, "no endpoint to the peer exists"),
    -204: ("ERR_ENDPOINT_ID_MISMATCH", PeerUnreachable, "the peer restarted; its endpoint changed"),
    -300: ("ERR_NUMA", TransportUnavailable, "NUMA binding failed"),
    -301: ("ERR_CLOCK", TransportUnavailable, "the clock could not be read"),
    -302: ("ERR_MEMORY", RegistrationRefused, "memory allocation or registration failed (locked-memory limit?)"),
    -303: ("ERR_NOT_IMPLEMENTED", TransportUnavailable, "the operation is not implemented by this transport"),
}


def error_for_code(code: int, *, op: str, peer: str = "") -> KVError:
    """The most specific exception for Mooncake's return `code` from operation `op`."""
    name, cls, hint = MOONCAKE_ERROR_CODES.get(code, ("unknown", TransferError, "unknown Mooncake error code"))
    where = f" to {peer}" if peer else ""
    message = f"Mooncake {op}{where} failed with {code} ({name}): {hint}."
    if issubclass(cls, TransferError):
        return cls(message, peer=peer, code=code)
    exc = cls(message)
    return exc


@contextmanager
def map_mooncake_exceptions(*, op: str, peer: str = "") -> Iterator[None]:
    """Turn exceptions raised by the Mooncake bindings into KV errors, keeping the cause."""
    try:
        yield
    except KVError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise BadAddress(f"Mooncake {op} got an invalid argument: {exc}.", peer=peer) from exc
    except ImportError as exc:
        raise TransportUnavailable(
            f"The Mooncake transfer engine cannot be imported ({exc}); install "
            "`mooncake-transfer-engine-non-cuda` (no CUDA) or `mooncake-transfer-engine` (CUDA), never both, "
            "and the Debian package libibverbs1."
        ) from exc
    except RuntimeError as exc:
        raise TransferError(f"Mooncake {op} raised: {exc}.", peer=peer) from exc
