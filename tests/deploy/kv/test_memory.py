"""The memory kv-probe registers: host buffers, and the refusals of GPU memory where none can be had."""

from __future__ import annotations

import sys
import types

import pytest

from sglang_pd.deploy.kv import GpuMemoryUnavailable, KVSetupError, memory


def test_a_host_buffer_reads_back_what_was_written_at_its_address() -> None:
    buf = memory.allocate("host", 64)
    assert buf.kind == "host" and buf.size == 64 and buf.base != 0
    assert buf.read(0, 64) == bytes(64)
    buf.write(8, b"kv-page")
    assert buf.read(6, 10) == b"\0\0kv-page\0"


def test_an_unknown_memory_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"--memory has value 'disk'\. Use one of host, gpu\."):
        memory.allocate("disk", 64)


def _fake_torch(*, cuda: str | None, available: bool) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.__version__ = "2.14.1+test"  # type: ignore[attr-defined]
    torch.version = types.SimpleNamespace(cuda=cuda)  # type: ignore[attr-defined]
    torch.cuda = types.SimpleNamespace(is_available=lambda: available)  # type: ignore[attr-defined]
    return torch


@pytest.mark.parametrize(
    ("torch", "wheels", "problem"),
    [
        (None, {"mooncake-transfer-engine"}, "torch does not import"),
        (_fake_torch(cuda=None, available=False), {"mooncake-transfer-engine"}, "is a CPU-only build"),
        (_fake_torch(cuda="13.0", available=False), {"mooncake-transfer-engine"}, "finds none (no GPU granted"),
        (
            _fake_torch(cuda="13.0", available=True),
            {memory.NON_CUDA_MOONCAKE},
            "only mooncake-transfer-engine-non-cuda is installed",
        ),
    ],
    ids=["no-torch", "cpu-torch", "no-gpu", "non-cuda-mooncake"],
)
def test_gpu_memory_where_there_is_none_is_refused_with_the_fix(monkeypatch, torch, wheels, problem) -> None:
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(memory, "_mooncake_wheels", lambda: wheels)
    with pytest.raises(GpuMemoryUnavailable) as info:
        memory.allocate("gpu", 64)
    assert isinstance(info.value, KVSetupError)
    message = str(info.value)
    assert message.startswith("--memory gpu needs") and problem in message
    assert "requests one (nvidia.com/gpu: 1)" in message and "--memory host" in message
