"""A Mooncake port range held by someone else is named as such, not blamed on the host name.

Mooncake binds its handshake and data listeners at random in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT and
gives up with "No valid port found for local TCP service" when its tries find no free port. The
KV fence governs connecting sockets, not listening ones, so any local user can hold the range.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sglang_pd.deploy.kv.listeners import listening_sockets, range_held_note
from tests.support.polling import free_ports

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(listening_sockets() is None, reason="needs Linux /proc to list listening sockets"),
]

WIDTH = 8
OPEN_ENGINE = """
from sglang_pd.deploy.kv.config import KVConfig
from sglang_pd.deploy.kv.engine import KVTransferEngine
try:
    KVTransferEngine(KVConfig.from_env()).open()
    print("opened")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
"""


def _free_range() -> tuple[int, int]:
    """WIDTH consecutive ports free now (IPv4 and IPv6)."""
    for _ in range(50):
        low = free_ports(1)[0]
        if low + WIDTH > 65000:
            continue
        try:
            with _held(low, low + WIDTH - 1):
                return low, low + WIDTH - 1
        except OSError:
            continue
    pytest.skip(f"no {WIDTH} consecutive free ports found")


class _held:
    """Every port of low..high listened on, IPv4 and IPv6, as a squatter would."""

    def __init__(self, low: int, high: int) -> None:
        self.socks: list[socket.socket] = []
        try:
            for port in range(low, high + 1):
                for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                    s = socket.socket(family, socket.SOCK_STREAM)
                    self.socks.append(s)
                    if family == socket.AF_INET6:
                        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    s.bind((host, port))
                    s.listen()
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        for s in self.socks:
            s.close()

    def __enter__(self) -> _held:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@pytest.fixture
def port_range() -> Iterator[dict[str, str]]:
    low, high = _free_range()
    yield {"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(high)}


def _open_engine(env: dict[str, str]) -> str:
    p = subprocess.run(
        [sys.executable, "-c", OPEN_ENGINE],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-2000:]


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MC_")} | {"SGLANG_PD_KV_HOSTNAME": "127.0.0.1"}


def test_a_held_range_is_named_with_its_holders_and_the_fix(port_range: dict[str, str]) -> None:
    low, high = int(port_range["MC_MIN_RPC_PORT"]), int(port_range["MC_MAX_RPC_PORT"])
    # The control: the same range free, a real Mooncake engine opens in it.
    assert _open_engine(port_range) == "opened"
    assert range_held_note(port_range) is None
    with _held(low, high):
        note = range_held_note(port_range)
        got = _open_engine(port_range)
    assert note is not None and note.startswith(f"{WIDTH} of the {WIDTH} ports of Mooncake's range TCP {low}-{high}")
    assert got.startswith("TransportUnavailable: Mooncake could not start a tcp engine"), got
    assert f"{WIDTH} of the {WIDTH} ports" in got and "MC_MIN_RPC_PORT" in got
    assert "host name" not in got  # what it said before: a wrong host name


def test_up_names_the_held_range_when_an_engines_log_shows_mooncakes_port_error(port_range: dict[str, str]) -> None:
    # sglang's engines log Mooncake's own line and then blame the transfer engine; `up` adds what holds the range.
    from sglang_pd.deploy.ops import up

    low, high = int(port_range["MC_MIN_RPC_PORT"]), int(port_range["MC_MAX_RPC_PORT"])
    engine = up.ChildSpec("decode-0", ["true"], "http://127.0.0.1:1/health", port_range, kv=True)
    tail = "E1207 transfer_engine_impl.cpp:144] P2P: No valid port found for local TCP service."
    with _held(low, high):
        note = up._port_range_note(engine, tail)
        assert note.startswith(f"\ndecode-0: {WIDTH} of the {WIDTH} ports of Mooncake's range TCP {low}-{high}")
        # Not for another failure, nor for a child without a transfer engine.
        assert up._port_range_note(engine, "RuntimeError: CUDA out of memory") == ""
        assert up._port_range_note(up.ChildSpec("router", ["true"], "http://127.0.0.1:1/", port_range), tail) == ""
    assert up._port_range_note(engine, tail) == ""  # nothing holds it any more
