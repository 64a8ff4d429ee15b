"""What the node gives a process that pins memory for RDMA: its locked-memory limit and capabilities.

`launch`'s pod check and `kv-probe`'s diagnosis both read them here, and give the same advice.
"""

from __future__ import annotations

import resource
from pathlib import Path

__all__ = ["CAP_IPC_LOCK", "MEMLOCK_FIX", "MIN_MEMLOCK_BYTES", "PROC_STATUS", "has_capability", "memlock_limit"]

# Mooncake pins every registered KV region; a container's default 64 KiB limit fails registration.
MIN_MEMLOCK_BYTES = 1 << 30
# linux/capability.h: with CAP_IPC_LOCK the kernel lets a process lock (and an RDMA NIC pin) memory
# past RLIMIT_MEMLOCK, which Kubernetes has no field to raise.
CAP_IPC_LOCK = 14
PROC_STATUS = Path("/proc/self/status")
MEMLOCK_FIX = (
    "add the IPC_LOCK capability (the chart does), or raise the container runtime's memlock limit "
    "(memlock=-1; `ulimit -l unlimited` outside a container)"
)


def memlock_limit() -> tuple[bool, str]:
    """Whether the soft locked-memory limit is enough for Mooncake's KV regions, and the limit as shown."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return True, "unlimited"
    return soft >= MIN_MEMLOCK_BYTES, f"{soft} bytes"


def has_capability(bit: int, status: Path = PROC_STATUS) -> bool:
    """Whether this process holds capability `bit` in its effective set (CapEff in /proc/self/status)."""
    try:
        text = status.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False
