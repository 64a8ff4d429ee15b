"""Run a test scenario in a fresh network namespace, so the netfilter rules it installs never
touch this machine's own.

    reason = netns_unavailable()          # None, or why not (for pytest.skip)
    result = run_in_netns("tests.support.kv_firewall_scenarios:local_form")   # its JSON answer

The scenario runs as `unshare --net -- python -m tests.support.netns MODULE:FUNCTION` in the
repository root: a new namespace whose loopback is brought up first and whose filter tables are
empty. Its function returns a JSON-able dict, printed on the last line after RESULT_MARK; what
the scenario prints before that (and its stderr) comes back in the assertion message on failure.
`peer_namespace` makes a second namespace joined to the first by a veth pair, for clients that
must arrive from another host's address.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT_MARK = "RESULT "
TOOLS = ("unshare", "nsenter", "ip", "iptables-restore", "iptables-save", "ip6tables-restore", "ip6tables-save")
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def netns_unavailable() -> str | None:
    """Why scenarios cannot run here (not root, a tool missing, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "needs root, to create a network namespace and write netfilter rules in it"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install iptables iproute2 util-linux)"
    probe = subprocess.run(["unshare", "--net", "--", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`unshare --net` is refused here: {probe.stderr.strip()}"
    return None


def run_in_netns(target: str, *args: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """Run `target` ("module:function", called with `args`) in a new network namespace; its result."""
    argv = ["unshare", "--net", "--", sys.executable, "-m", "tests.support.netns", target, *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    lines = done.stdout.splitlines()
    found = [ln for ln in lines if ln.startswith(RESULT_MARK)]
    assert done.returncode == 0 and found, f"{target} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(found[-1][len(RESULT_MARK) :])
    result["_output"] = "\n".join(ln for ln in lines if not ln.startswith(RESULT_MARK))
    return result


def loopback_up() -> None:
    """Bring up `lo` in this process's network namespace (a new one starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


def sh(*argv: str) -> str:
    """Run a command; its stdout, or AssertionError with its stderr."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr.strip()}"
    return done.stdout


@dataclass
class PeerNamespace:
    """A second network namespace, reached from this one through a veth pair: `addresses` are its
    own (the sources a pod sees from other pods), `gateway4`/`gateway6` this namespace's side."""

    holder: subprocess.Popen[bytes]
    addresses: tuple[str, ...]
    gateway4: str
    gateway6: str

    def run(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run a command inside the peer namespace."""
        enter = ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]
        return subprocess.run([*enter, *argv], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)


@contextlib.contextmanager
def peer_namespace() -> Iterator[PeerNamespace]:
    """A peer namespace with 10.77.0.2, 10.77.0.3, fd77::2 and fd77::3; this side has .1 and ::1."""
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "600"])
    try:
        sh("ip", "link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
        sh("ip", "addr", "add", "10.77.0.1/24", "dev", "kv0")
        sh("ip", "addr", "add", "fd77::1/64", "dev", "kv0", "nodad")
        sh("ip", "link", "set", "kv0", "up")
        for _ in range(100):  # unshare needs a moment to enter its namespace
            if os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
            subprocess.run(["sleep", "0.05"], check=True)
        sh("ip", "link", "set", "kv1", "netns", str(holder.pid))
        peer = PeerNamespace(holder, ("10.77.0.2", "10.77.0.3", "fd77::2", "fd77::3"), "10.77.0.1", "fd77::1")
        for cmd in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "addr", "add", "10.77.0.2/24", "dev", "kv1"],
            ["ip", "addr", "add", "10.77.0.3/24", "dev", "kv1"],
            ["ip", "addr", "add", "fd77::2/64", "dev", "kv1", "nodad"],
            ["ip", "addr", "add", "fd77::3/64", "dev", "kv1", "nodad"],
            ["ip", "link", "set", "kv1", "up"],
        ):
            done = peer.run(*cmd)
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr.strip()}"
        yield peer
    finally:
        holder.kill()
        holder.wait(timeout=10)


def main(argv: list[str]) -> int:
    target, *args = argv
    loopback_up()
    module, _, function = target.partition(":")
    result = getattr(importlib.import_module(module), function)(*args)
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
