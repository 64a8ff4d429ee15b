"""This machine's network interfaces and their addresses, and which interface holds a given address."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["interface_addresses", "interface_of"]

# linux/sockios.h: the interface's (primary) IPv4 address, as `ifconfig` reads it.
SIOCGIFADDR = 0x8915
# The kernel lists every IPv6 address here, one a line: address (32 hex digits), index, prefix length,
# scope, flags, interface name (proc(5), /proc/net/if_inet6).
IF_INET6 = Path("/proc/net/if_inet6")


def _ipv4_of(sock: socket.socket, name: str) -> str | None:
    request = struct.pack("256s", name.encode()[:15])
    try:
        reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
    except OSError:  # EADDRNOTAVAIL: no IPv4 address on it
        return None
    return socket.inet_ntoa(reply[20:24])


def interface_addresses() -> dict[str, list[str]]:
    """Each interface's name and its addresses, IPv4 (the primary one: SIOCGIFADDR does not report the
    secondary addresses `ip addr add` gives) and IPv6, read from the kernel."""
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name, addresses in found.items():
            v4 = _ipv4_of(sock, name)
            if v4 is not None:
                addresses.append(v4)
    try:
        lines = IF_INET6.read_text().splitlines()
    except OSError:  # a kernel without IPv6
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[5] in found:
            found[fields[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found


def interface_of(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The interface that holds `address` (compared as addresses, so `::1` and `0::1` are one), or None.
    ValueError when `address` is not an IP address."""
    wanted = ipaddress.ip_address(address)
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None
