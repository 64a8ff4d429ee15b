"""Every Mooncake error code maps to a specific KV error; binding exceptions are translated."""

from __future__ import annotations

import pytest

from sglang_pd.deploy import kv
from sglang_pd.deploy.kv.exceptions import (
    MOONCAKE_ERROR_CODES,
    BadAddress,
    KVError,
    PeerUnreachable,
    TransferError,
    TransportUnavailable,
    error_for_code,
    map_mooncake_exceptions,
)

# Every code in Mooncake's mooncake-transfer-engine/include/error.h (the P2P engine we ship).
MOONCAKE_ERROR_H = [
    -1,
    -2,
    -3,
    -4,
    -6,
    -7,
    -101,
    -102,
    -103,
    -104,
    -200,
    -201,
    -202,
    -203,
    -204,
    -300,
    -301,
    -302,
    -303,
]


def test_every_known_mooncake_code_is_mapped() -> None:
    assert sorted(MOONCAKE_ERROR_CODES) == sorted(MOONCAKE_ERROR_H)
    for code in MOONCAKE_ERROR_H:
        exc = error_for_code(code, op="batch_transfer_sync_write", peer="127.0.0.1:1")
        assert type(exc) not in (KVError, TransferError), f"code {code} maps only to a base class"
        assert str(code) in str(exc) and MOONCAKE_ERROR_CODES[code][0] in str(exc)
        if isinstance(exc, TransferError):
            assert exc.code == code and exc.peer == "127.0.0.1:1"


def test_dead_peer_code_is_peer_unreachable() -> None:
    # send_probe answers -102 for a dead peer (docs/upstream-facts.md).
    assert isinstance(error_for_code(-102, op="send_probe"), PeerUnreachable)


def test_unknown_code_keeps_its_number() -> None:
    exc = error_for_code(-999, op="x")
    assert type(exc) is TransferError and exc.code == -999 and "-999" in str(exc)


def test_binding_exceptions_are_chained() -> None:
    with pytest.raises(BadAddress) as info, map_mooncake_exceptions(op="write", peer="p"):
        raise TypeError("incompatible function arguments")
    assert isinstance(info.value.__cause__, TypeError)
    with pytest.raises(TransportUnavailable), map_mooncake_exceptions(op="import"):
        raise ImportError("no module named mooncake")
    with pytest.raises(KeyError), map_mooncake_exceptions(op="write"):
        raise KeyError("unrelated errors pass through unchanged")


def test_exported_members() -> None:
    public = {n for n in dir(kv) if (not n.startswith("_") and n[0].isupper()) or n in ("get_engine",)}
    public -= {"annotations"}
    assert set(kv.__all__) >= public - {"config", "engine", "exceptions", "metrics", "pages"}
    assert len(set(kv.__all__)) == len(kv.__all__)
    for name in kv.__all__:
        assert hasattr(kv, name)
