"""`sglang-pd kv-probe`: passes on loopback, fails with an actionable diagnosis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_pd.deploy.kv import RegistrationRefused
from sglang_pd.deploy.kv.cli import diagnose
from tests.support.polling import free_port

PROBE = [sys.executable, "-m", "sglang_pd.deploy.cli", "kv-probe", "--format", "json", "--repeat", "2"]


def test_kv_probe_on_loopback_passes() -> None:
    r = subprocess.run([*PROBE, "--pages", "32", "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"] and {c["check"] for c in report["checks"]} >= {"engine", "register", "probe", "integrity"}
    assert {row["shape"] for row in report["bandwidth"]} == {"contiguous", "fragmented"}
    assert all(row["best_gbps"] > 0 for row in report["bandwidth"])


@pytest.mark.parametrize(
    ("args", "diagnosis"),
    [
        (["--peer", "http://127.0.0.1:{port}"], "start `sglang-pd kv-probe --serve` there"),
        (["--protocol", "rdma", "--device", "mlx5_missing"], "mount /dev/infiniband"),
    ],
)
def test_kv_probe_failures_say_what_to_do(args: list[str], diagnosis: str) -> None:
    args = [a.format(port=free_port()) for a in args]
    r = subprocess.run([*PROBE, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and diagnosis in report["diagnosis"]


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_kv_probe_registers_host_memory_by_default_and_says_so() -> None:
    r = subprocess.run([*PROBE, "--pages", "8", "--layers", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    register = next(c for c in report["checks"] if c["check"] == "register")
    assert report["memory"] == "host"
    assert register["detail"].endswith("bytes of host memory registered; the peer's: host memory"), register


@pytest.mark.skipif(_cuda_visible(), reason="checks the refusal where no CUDA GPU is visible")
def test_kv_probe_asked_for_gpu_memory_without_cuda_names_the_fix() -> None:
    r = subprocess.run([*PROBE, "--memory", "gpu"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and report["error"].startswith("GpuMemoryUnavailable: --memory gpu needs")
    assert "nvidia.com/gpu: 1" in report["error"] and "--memory host" in report["error"]
    assert "--memory host" in report["diagnosis"]
    # Refused before a peer starts or anything is registered.
    assert [c["check"] for c in report["checks"]] == ["deepep-driver"]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_visible(), reason="needs a CUDA GPU and Mooncake's CUDA wheel")
def test_kv_probe_registers_and_writes_gpu_memory() -> None:
    r = subprocess.run([*PROBE, "--memory", "gpu", "--pages", "32"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    register = next(c for c in report["checks"] if c["check"] == "register")
    assert report["memory"] == "gpu" and "bytes of GPU memory (cuda:0" in register["detail"]
    assert "the peer's: GPU memory (cuda:0" in register["detail"]
    assert any(c["check"] == "integrity" and c["ok"] for c in report["checks"])


def test_a_refused_gpu_registration_points_at_gpudirect_rdma() -> None:
    gpu = diagnose(RegistrationRefused("Mooncake refused to register 4718592 bytes (registering GPU memory (cuda:0))"))
    host = diagnose(RegistrationRefused("Mooncake refused to register 4718592 bytes (registering host memory)"))
    assert "GPUDirect RDMA): load nvidia-peermem, or use a kernel and driver with DMA-BUF" in gpu
    assert "nvidia-peermem" not in host and "locked-memory limit" in host
