"""The data the estimate runs on: GPU profiles, kernel efficiencies, DeepEP's tables, assumptions.

All of it lives in `hardware.yaml` beside this module, each number with its source; this module
only reads it into typed values and interpolates DeepEP's per-EP-size tables.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

__all__ = ["GPUProfile", "HardwareData", "UnknownGPU", "load_hardware"]

HARDWARE_FILE = Path(__file__).with_name("hardware.yaml")


class UnknownGPU(ValueError):
    """The topology names a GPU type without a profile."""


@dataclass(frozen=True)
class GPUProfile:
    """Peak figures of one GPU type (dense FLOPs, per-direction bandwidths)."""

    key: str
    name: str
    memory_gib: float
    hbm_gbps: float
    bf16_tflops: float
    fp8_tflops: float
    sms: int
    nvlink_gbps: float
    nic_gbit: float
    source: str
    assumed: tuple[str, ...] = ()

    @property
    def nic_gbps(self) -> float:
        """NIC line rate in GB/s."""
        return self.nic_gbit / 8


def _interpolate_log2(table: dict[int, float], x: int) -> float:
    """Linear in log2(x) between the measured sizes; clamped at both ends."""
    sizes = sorted(table)
    if x <= sizes[0]:
        return table[sizes[0]]
    if x >= sizes[-1]:
        return table[sizes[-1]]
    for lo, hi in itertools.pairwise(sizes):
        if lo <= x <= hi:
            w = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return table[lo] + w * (table[hi] - table[lo])
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class HardwareData:
    """Everything `hardware.yaml` holds."""

    gpus: dict[str, GPUProfile]
    efficiency: dict[str, float]
    efficiency_sources: dict[str, str]
    ll_tokens: int
    ll_hidden: int
    ll_topk: int
    ll_nic_gbit: float
    ll_dispatch_us: dict[int, float]
    ll_combine_us: dict[int, float]
    ll_sm_fraction: float
    normal_nic_gbit: float
    normal_rdma_gbps: dict[int, float]
    normal_nvlink_gbps: dict[int, float]
    normal_sms: int
    deepep_sources: dict[str, str]
    sbo_send_gbps_per_sm: float
    sbo_fixed_us: float
    sbo_sources: dict[str, str]
    assumptions: dict[str, float]
    assumption_texts: dict[str, str]

    def gpu(self, name: str) -> GPUProfile:
        key = name.strip().upper()
        if key not in self.gpus:
            known = ", ".join(sorted(self.gpus))
            raise UnknownGPU(
                f"hardware.gpu: no performance profile for {name!r}; profiles exist for {known}. "
                f"Add one to {HARDWARE_FILE.name} (peaks with their source) or use one of these."
            )
        return self.gpus[key]

    def ll_call_us(self, kind: str, ep: int) -> float:
        """DeepEP low-latency dispatch or combine time (µs) at `ll_tokens` tokens per rank."""
        table = self.ll_dispatch_us if kind == "dispatch" else self.ll_combine_us
        return _interpolate_log2(table, ep)

    def normal_rdma(self, ep: int) -> float:
        return _interpolate_log2(self.normal_rdma_gbps, ep)


def _int_keys(table: dict[Any, Any]) -> dict[int, float]:
    return {int(k): float(v) for k, v in table.items()}


@cache
def load_hardware(path: Path = HARDWARE_FILE) -> HardwareData:
    """Read and type `hardware.yaml` (cached; the file ships with the package)."""
    raw = yaml.safe_load(path.read_text())
    gpus = {
        key.upper(): GPUProfile(key=key.upper(), **{**g, "assumed": tuple(g.get("assumed", ()))})
        for key, g in raw["gpus"].items()
    }
    ll, normal, sbo = raw["deepep"]["low_latency"], raw["deepep"]["normal"], raw["sbo"]
    return HardwareData(
        gpus=gpus,
        efficiency={k: float(v["value"]) for k, v in raw["efficiency"].items()},
        efficiency_sources={k: str(v["source"]) for k, v in raw["efficiency"].items()},
        ll_tokens=int(ll["tokens"]),
        ll_hidden=int(ll["hidden"]),
        ll_topk=int(ll["topk"]),
        ll_nic_gbit=float(ll["nic_gbit"]),
        ll_dispatch_us=_int_keys(ll["dispatch_us"]),
        ll_combine_us=_int_keys(ll["combine_us"]),
        ll_sm_fraction=float(ll["sm_fraction"]),
        normal_nic_gbit=float(normal["nic_gbit"]),
        normal_rdma_gbps=_int_keys(normal["rdma_gbps"]),
        normal_nvlink_gbps=_int_keys(normal["nvlink_gbps"]),
        normal_sms=int(normal["sms"]),
        deepep_sources={"low_latency": str(ll["source"]), "normal": str(normal["source"])},
        sbo_send_gbps_per_sm=float(sbo["send_gbps_per_sm"]["value"]),
        sbo_fixed_us=float(sbo["fixed_us"]["value"]),
        sbo_sources={k: str(v["source"]) for k, v in sbo.items()},
        assumptions={k: float(v["value"]) for k, v in raw["assumptions"].items()},
        assumption_texts={k: str(v["text"]) for k, v in raw["assumptions"].items()},
    )
