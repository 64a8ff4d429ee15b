"""Try to read a Mooncake engine's registered memory as any local process can: the KV-port check.

    python scripts/kv_read_probe.py 127.0.0.1:16637 --bytes 4096 [--secret TEXT] [--hostname ADDR]

Opens a TCP transfer engine of its own (P2P handshake, as sglang-pd's engines do), asks the peer
for its first registered buffer (the handshake port) and reads `--bytes` of it (the data port)
into a buffer filled with 0xA5 beforehand. Prints one JSON line: whether the handshake and the
read succeeded, how many bytes it recovered (the read's length when it succeeded, else how many
bytes of the buffer changed), whether `--secret` is among them, and how long it took to the
answer or to the failure. Exit status 0 when it read the memory, 1 when it could not.

With `sglang-pd up` fencing the KV ports, a process outside the engines' group gets
`"bytes_recovered": 0`; tests/deploy/kv/test_firewall.py runs it both ways inside a network namespace.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

SENTINEL = 0xA5


def probe(peer: str, nbytes: int, secret: bytes | None = None, hostname: str = "127.0.0.1") -> dict[str, object]:
    from mooncake.engine import TransferEngine

    t0 = time.monotonic()
    te = TransferEngine()
    if te.initialize(hostname, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake could not open a TCP engine here")
    buf = (ctypes.c_char * nbytes)()
    ctypes.memset(buf, SENTINEL, nbytes)
    ptr = ctypes.addressof(buf)
    if te.register_memory(ptr, nbytes) != 0:
        raise RuntimeError(f"Mooncake refused to register {nbytes} bytes")
    started = time.monotonic()
    result: dict[str, object] = {"peer": peer, "gid": os.getgid(), "bytes_requested": nbytes}
    try:
        remote = int(te.get_first_buffer_address(peer))
    except Exception as exc:  # whatever Mooncake raises is the answer being measured
        remote, result["error"] = 0, f"{type(exc).__name__}: {exc}"
    result["handshake"] = remote != 0
    rc = te.transfer_sync_read(peer, ptr, remote, nbytes) if remote else None
    result["read_rc"] = rc
    data = bytes(buf)
    result["bytes_recovered"] = nbytes if rc == 0 else sum(b != SENTINEL for b in data)
    if secret is not None:
        result["secret_found"] = secret in data
    result["seconds"] = round(time.monotonic() - started, 4)  # from the first connection to the answer
    result["engine_open_seconds"] = round(started - t0, 4)
    te.unregister_memory(ptr)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer", help="the engine's Mooncake address, host:port (its handshake port)")
    p.add_argument("--bytes", type=int, default=4096, help="how much of its first registered buffer to read")
    p.add_argument("--secret", default=None, help="text to look for in what was read")
    p.add_argument("--hostname", default="127.0.0.1", help="this probe's own address, as its engine advertises it")
    a = p.parse_args(argv)
    result = probe(a.peer, a.bytes, a.secret.encode() if a.secret is not None else None, a.hostname)
    print(json.dumps(result), flush=True)
    return 0 if result["read_rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
