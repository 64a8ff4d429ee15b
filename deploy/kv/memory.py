"""The memory a KV pre-flight registers with Mooncake: host memory, or GPU memory as sglang's KV pool is.

    buf = allocate("gpu", 64 << 20)      # a CUDA buffer on the current device (torch)
    engine.register(buf.base, buf.size)  # Mooncake registers the address either way
    buf.write(0, data); buf.read(0, 16)

Mooncake tells host from GPU memory by the address itself. With rdma, a GPU buffer registers only
where the NIC can reach GPU memory (GPUDirect RDMA: DMA-BUF or nvidia-peermem), which is what sglang's
GPU KV pool needs on a cluster; host memory proves nothing about it. A GPU buffer needs torch with
CUDA and Mooncake's CUDA wheel (`mooncake-transfer-engine`, in the GPU image): the non-CUDA wheel
would copy from the GPU address as if it were host memory.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
from typing import Any, Literal, Protocol

from .exceptions import GpuMemoryUnavailable

__all__ = ["MEMORY_KINDS", "GpuBuffer", "HostBuffer", "KVBuffer", "MemoryKind", "allocate"]

MemoryKind = Literal["host", "gpu"]
MEMORY_KINDS: tuple[MemoryKind, ...] = ("host", "gpu")
NON_CUDA_MOONCAKE = "mooncake-transfer-engine-non-cuda"
GPU_FIX = (
    "run the probe in the GPU image (torch with CUDA, Mooncake's CUDA wheel) on a node with a GPU, in a pod "
    "that requests one (nvidia.com/gpu: 1), or pass --memory host to check host memory only"
)


class KVBuffer(Protocol):
    """A registered region's memory: its address, its size, and byte access from the host."""

    kind: MemoryKind
    base: int
    size: int

    def describe(self) -> str: ...
    def read(self, offset: int, length: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...


class HostBuffer:
    """Zeroed host memory (ctypes)."""

    kind: MemoryKind = "host"

    def __init__(self, size: int) -> None:
        self._buf = (ctypes.c_char * size)()
        self._view = memoryview(self._buf).cast("B")
        self.base = ctypes.addressof(self._buf)
        self.size = size

    def describe(self) -> str:
        return "host memory"

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self._view[offset : offset + length])

    def write(self, offset: int, data: bytes) -> None:
        self._view[offset : offset + len(data)] = data


class GpuBuffer:
    """Zeroed memory on the current CUDA device, held by a torch uint8 tensor."""

    kind: MemoryKind = "gpu"

    def __init__(self, size: int, torch: Any) -> None:
        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._tensor = torch.zeros(size, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        self.base = int(self._tensor.data_ptr())
        self.size = size

    def describe(self) -> str:
        return f"GPU memory ({self.device}, {self._torch.cuda.get_device_name(self.device)})"

    def read(self, offset: int, length: int) -> bytes:
        host = self._tensor[offset : offset + length].cpu()
        return ctypes.string_at(host.data_ptr(), length)

    def write(self, offset: int, data: bytes) -> None:
        src = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        self._tensor[offset : offset + len(data)].copy_(src)
        self._torch.cuda.synchronize(self.device)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise GpuMemoryUnavailable(
            f"--memory gpu needs torch with CUDA, but torch does not import ({exc}); {GPU_FIX}."
        ) from exc
    return torch


def _mooncake_wheels() -> set[str]:
    names = set()
    for dist in (NON_CUDA_MOONCAKE, "mooncake-transfer-engine"):
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        names.add(dist)
    return names


def allocate(kind: str, size: int) -> KVBuffer:
    """A zeroed buffer of `size` bytes of `kind` memory; GpuMemoryUnavailable (naming the fix) when GPU memory
    is asked for where there is none to register."""
    if kind == "host":
        return HostBuffer(size)
    if kind != "gpu":
        raise ValueError(f"--memory has value {kind!r}. Use one of {', '.join(MEMORY_KINDS)}.")
    torch = _import_torch()
    if torch.version.cuda is None:
        raise GpuMemoryUnavailable(
            f"--memory gpu needs torch with CUDA, but torch {torch.__version__} is a CPU-only build; {GPU_FIX}."
        )
    if not torch.cuda.is_available():
        raise GpuMemoryUnavailable(
            f"--memory gpu needs a visible CUDA GPU, but torch {torch.__version__} finds none (no GPU granted to "
            f"this container, or NVIDIA_VISIBLE_DEVICES/CUDA_VISIBLE_DEVICES hide it); {GPU_FIX}."
        )
    if _mooncake_wheels() == {NON_CUDA_MOONCAKE}:
        raise GpuMemoryUnavailable(
            f"--memory gpu needs Mooncake's CUDA wheel, but only {NON_CUDA_MOONCAKE} is installed, which reads GPU "
            f"addresses as host memory; {GPU_FIX}."
        )
    return GpuBuffer(size, torch)
