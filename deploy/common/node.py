"""What the node gives a process that does RDMA: its locked-memory limit, its capabilities and the
NVIDIA driver options DeepEP needs across nodes.

`launch`'s pod checks, `kv-probe` and `doctor` read them here, and give the same advice.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path
from typing import Any

__all__ = [
    "CAP_IPC_LOCK",
    "DRIVER_FIX",
    "MEMLOCK_FIX",
    "MIN_MEMLOCK_BYTES",
    "PROC_STATUS",
    "deepep_driver",
    "has_capability",
    "memlock_limit",
]

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


NVIDIA_PARAMS = Path("/proc/driver/nvidia/params")
GDRDRV_DEVICE = Path("/dev/gdrdrv")
DRIVER_FIX = (
    "on every GPU node: echo 'options nvidia NVreg_EnableStreamMemOPs=1 "
    'NVreg_RegistryDwords="PeerMappingOverride=1;"\' > /etc/modprobe.d/nvidia-deepep.conf, '
    "then update-initramfs -u and reboot (or reload the nvidia modules); or install GDRCopy (gdrdrv)"
)


def deepep_driver(params: Path = NVIDIA_PARAMS, gdrdrv: Path = GDRDRV_DEVICE) -> dict[str, Any]:
    """Whether the NVIDIA driver lets DeepEP (NVSHMEM over InfiniBand GPUDirect Async) work across nodes.

    DeepEP's inter-node kernels need the driver options NVreg_EnableStreamMemOPs=1 and
    PeerMappingOverride=1 (DeepEP's README, "Network configurations"), or GDRCopy's gdrdrv.
    """
    try:
        text = params.read_text()
    except OSError:
        return {"ok": None, "driver": False, "detail": f"no NVIDIA driver here ({params} is absent)"}
    stream = re.search(r"^EnableStreamMemOPs:\s*(\d+)", text, re.MULTILINE)
    stream_mem_ops = stream is not None and stream.group(1) == "1"
    peer_mapping = re.search(r"PeerMappingOverride\s*=\s*1", text) is not None
    gdrcopy = gdrdrv.exists()
    ok = (stream_mem_ops and peer_mapping) or gdrcopy
    found = (
        f"EnableStreamMemOPs={'1' if stream_mem_ops else 'not 1'}, "
        f"PeerMappingOverride={'1' if peer_mapping else 'unset'}, GDRCopy {'loaded' if gdrcopy else 'absent'}"
    )
    return {
        "ok": ok,
        "driver": True,
        "stream_mem_ops": stream_mem_ops,
        "peer_mapping_override": peer_mapping,
        "gdrcopy": gdrcopy,
        "detail": found if ok else f"{found}; DeepEP across nodes will fail: {DRIVER_FIX}",
    }
