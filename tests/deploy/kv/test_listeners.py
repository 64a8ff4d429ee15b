"""The listener detector against real sockets, and against a real Mooncake engine in a peer process."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from sglang_pd.deploy.kv import get_engine
from sglang_pd.deploy.kv.listeners import (
    EXPOSURE_MARK,
    Listener,
    _address,
    exposure_warning,
    listening_sockets,
    mooncake_port_range,
)
from sglang_pd.deploy.kv.peer import start_peer

pytestmark = pytest.mark.skipif(listening_sockets() is None, reason="needs Linux /proc to list a process's sockets")


def _non_loopback_ipv4() -> str | None:
    """This host's address on its default route (no packet is sent), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") else addr


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def _listen(made: list[socket.socket], family: socket.AddressFamily, host: str, *, listen: bool = True) -> int:
    s = socket.socket(family, socket.SOCK_STREAM)
    made.append(s)
    s.bind((host, 0))
    if listen:
        s.listen()
    return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("hex_addr", "address"),
    [
        ("0100007F", "127.0.0.1"),
        ("00000000", "0.0.0.0"),
        ("0202000A", "10.0.2.2"),
        ("00000000000000000000000000000000", "::"),
        ("0000000000000000FFFF00000100007F", "::ffff:127.0.0.1"),
        ("00000000000000000000000001000000", "::1"),
    ],
)
def test_proc_addresses_decode(hex_addr: str, address: str) -> None:
    assert _address(hex_addr) == address


def test_finds_this_process_listeners_with_their_address(sockets: list[socket.socket]) -> None:
    loopback = _listen(sockets, socket.AF_INET, "127.0.0.1")
    every_ipv4 = _listen(sockets, socket.AF_INET, "0.0.0.0")
    every_ipv6 = _listen(sockets, socket.AF_INET6, "::")
    bound_only = _listen(sockets, socket.AF_INET, "0.0.0.0", listen=False)

    found = listening_sockets()

    assert found is not None
    assert {Listener("127.0.0.1", loopback), Listener("0.0.0.0", every_ipv4), Listener("::", every_ipv6)} <= found
    assert not any(x.port == bound_only for x in found)  # bound but not listening: not a listener
    assert not Listener("127.0.0.1", loopback).wildcard
    assert Listener("0.0.0.0", every_ipv4).wildcard and Listener("::", every_ipv6).wildcard


def test_another_process_listeners_are_its_own(sockets: list[socket.socket]) -> None:
    mine = _listen(sockets, socket.AF_INET, "127.0.0.1")
    with start_peer(4096) as peer:
        theirs = listening_sockets(peer.proc.pid)
    assert theirs is not None and theirs
    assert all(x.port != mine for x in theirs)


def test_real_mooncake_peer_listens_on_every_interface() -> None:
    """Mooncake binds its handshake and data ports to every interface although the engine's host
    name is 127.0.0.1; the detector sees both, and a connection through another interface works."""
    low, high = mooncake_port_range()
    with start_peer(4096) as peer:
        host, rpc = peer.info.session_id.rsplit(":", 1)
        found = listening_sockets(peer.proc.pid)
        assert found is not None
        mooncake = sorted(x for x in found if low <= x.port <= high)
        outside = _non_loopback_ipv4()
        if outside is not None:  # the proof by behaviour: reachable through a non-loopback address
            with socket.create_connection((outside, int(rpc)), timeout=5):
                pass
        assert peer.get("/info")["session_id"] == peer.info.session_id  # still serving

    assert host == "127.0.0.1"
    assert Listener("0.0.0.0", int(rpc)) in mooncake, found
    data = [x for x in mooncake if x.port != int(rpc)]
    assert len(data) == 1 and data[0].wildcard, found  # the TCP transport's data port ("::", dual-stack)


def test_this_process_engine_records_what_mooncake_opened() -> None:
    engine = get_engine()
    rpc = int(engine.session_id.rsplit(":", 1)[1])
    assert Listener("0.0.0.0", rpc) in engine.listeners
    assert len(engine.listeners) == 2 and all(x.wildcard for x in engine.listeners), engine.listeners
    assert set(engine.listeners) <= (listening_sockets() or set())  # still open, as /proc says now
    warning = exposure_warning(engine.listeners, hostname=engine.config.hostname, handshake_port=rpc)
    assert warning is not None and warning.startswith(EXPOSURE_MARK)
    for x in engine.listeners:
        assert str(x) in warning


def test_exposure_warning_names_ports_roles_and_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    listeners = [Listener("0.0.0.0", 15038), Listener("::", 16930)]
    monkeypatch.setenv("MC_MIN_RPC_PORT", "20000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "20099")
    warning = exposure_warning(listeners, hostname="127.0.0.1", handshake_port=15038)
    assert warning is not None
    assert "0.0.0.0:15038 (handshake), [::]:16930 (data)" in warning
    assert "host name is 127.0.0.1" in warning
    assert "firewall TCP 20000-20099" in warning
    assert "\n" not in warning


@pytest.mark.parametrize(
    ("listeners", "hostname"),
    [
        ([Listener("127.0.0.1", 15038)], "127.0.0.1"),  # bound where asked: nothing to say
        ([Listener("0.0.0.0", 15038)], "0.0.0.0"),  # every interface was asked for
        ([], "127.0.0.1"),  # nothing detected
    ],
)
def test_no_warning_when_nothing_is_exposed_beyond_the_host_name(listeners: list[Listener], hostname: str) -> None:
    assert exposure_warning(listeners, hostname=hostname, handshake_port=15038) is None
