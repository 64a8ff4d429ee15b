"""Which TCP ports a process listens on, and on which address, read from Linux's /proc.

The KV layer uses it to see what Mooncake's transfer engine opened: Mooncake (0.3.13, and its
main branch as of August 2026) binds its handshake and TCP data listeners to every interface
whatever host name it is given (docs/mooncake.md), so the engine says so once, naming the ports.

    before = listening_sockets()
    ...open something...
    opened = listening_sockets() - before        # {Listener("0.0.0.0", 15038), ...}
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "EXPOSURE_MARK",
    "Listener",
    "exposure_warning",
    "listening_sockets",
    "mooncake_port_range",
    "range_held_note",
]

_LISTEN = "0A"  # the TCP state column of /proc/net/tcp for LISTEN
WILDCARDS = ("0.0.0.0", "::")
# Mooncake picks its listening ports at random in this range (its config.cpp); the two
# environment variables move it, so a firewall can allow exactly one range.
MOONCAKE_PORT_RANGE = (15000, 17000)
# Every exposure warning starts with this, so `sglang-pd up` can find it in an engine's log.
EXPOSURE_MARK = "sglang-pd: Mooncake listens on all interfaces"


@dataclass(frozen=True, order=True)
class Listener:
    """One listening TCP socket: the address it is bound to and its port."""

    address: str  # "127.0.0.1", "0.0.0.0" (all IPv4), "::" (all IPv6, and IPv4 when dual-stack)
    port: int

    @property
    def wildcard(self) -> bool:
        """True when the socket accepts connections on every interface."""
        return self.address in WILDCARDS

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def _address(hex_addr: str) -> str:
    # /proc prints each 32-bit word of the address in host byte order (little-endian here).
    raw = b"".join(bytes.fromhex(hex_addr[i : i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"  # as ss prints it, not ::ffff:7f00:1
    return str(ip)


def _socket_inodes(pid: int | str) -> set[str]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in os.scandir(fd_dir):
        try:
            target = os.readlink(fd.path)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _listen_rows(net: str) -> Iterator[list[str]]:
    """The LISTEN rows of `net`/tcp and `net`/tcp6 (/proc/net, or one process's /proc/PID/net),
    split into their columns: 1 local address:port (hex), 7 uid, 9 socket inode."""
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"{net}/{table}").read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 in this kernel
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                yield fields


def listening_sockets(pid: int | str = "self") -> set[Listener] | None:
    """The TCP sockets process `pid` listens on; None where /proc cannot say (not Linux, or
    another user's process)."""
    try:
        inodes = _socket_inodes(pid)
    except OSError:
        return None
    found = set()
    for fields in _listen_rows(f"/proc/{pid}/net"):
        if fields[9] in inodes:
            hex_addr, hex_port = fields[1].rsplit(":", 1)
            found.add(Listener(_address(hex_addr), int(hex_port, 16)))
    return found


def mooncake_port_range(environ: dict[str, str] | None = None) -> tuple[int, int]:
    """The range Mooncake draws its ports from: MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, else 15000..17000."""
    env = os.environ if environ is None else environ
    low, high = MOONCAKE_PORT_RANGE
    try:
        low = int(env.get("MC_MIN_RPC_PORT", low))
        high = int(env.get("MC_MAX_RPC_PORT", high))
    except ValueError:
        return MOONCAKE_PORT_RANGE  # Mooncake ignores a value it cannot parse the same way
    return (low, high)


def exposure_warning(listeners: Iterable[Listener], *, hostname: str, handshake_port: int) -> str | None:
    """One line naming the listeners bound to every interface although `hostname` is one address;
    None when there are none (or the host name itself means every interface)."""
    if hostname in WILDCARDS or hostname == "":
        return None
    exposed = sorted(x for x in listeners if x.wildcard)
    if not exposed:
        return None
    named = ", ".join(f"{x} ({'handshake' if x.port == handshake_port else 'data'})" for x in exposed)
    low, high = mooncake_port_range()
    return (
        f"{EXPOSURE_MARK}: {named}, although its host name is {hostname} (Mooncake has no bind-address option); "
        f"anyone reaching these ports can read and write this engine's registered KV memory, so firewall TCP "
        f"{low}-{high} (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT) to the other PD engines only (docs/ports-and-auth.md)."
    )


def _held_ports(low: int, high: int) -> dict[int, set[int]]:
    """Ports in low..high that a socket of this network namespace listens on, each with the uids
    holding it (/proc/net/tcp and tcp6 list every user's sockets)."""
    held: dict[int, set[int]] = {}
    for fields in _listen_rows("/proc/net"):
        port = int(fields[1].rsplit(":", 1)[1], 16)
        if low <= port <= high:
            held.setdefault(port, set()).add(int(fields[7]))
    return held


def range_held_note(environ: dict[str, str] | None = None) -> str | None:
    """What holds Mooncake's port range, when something does: a transfer engine binds its ports
    at random in it and fails to start ("No valid port found for local TCP service") once its
    tries find none free, an error that otherwise reads like a wrong host name. The fence governs
    connections, not listeners, so any local user can hold the range. None when no port is held."""
    low, high = mooncake_port_range(environ)
    held = _held_ports(low, high)
    if not held:
        return None
    by_uid: dict[int, int] = {}
    for uids in held.values():
        for uid in uids:
            by_uid[uid] = by_uid.get(uid, 0) + 1
    holders = ", ".join(f"uid {uid}: {n}" for uid, n in sorted(by_uid.items()))
    return (
        f"{len(held)} of the {high - low + 1} ports of Mooncake's range TCP {low}-{high} are held by listening "
        f"sockets ({holders}); a transfer engine binds a free port of that range at random and fails to start "
        f"when its tries find none. Stop what holds them (ss -ltnp 'sport >= :{low} and sport <= :{high}'), or "
        "move the engines' range with MC_MIN_RPC_PORT and MC_MAX_RPC_PORT."
    )
