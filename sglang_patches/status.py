"""What this machine can do for single-batch overlap (SBO) on Hopper, and why not.

One place answers "is our kernel usable", "which signal layout does the installed DeepEP take"
and "which SBO halves can run"; the hooks and `sglang-pd doctor` both ask it.

Nothing here initialises CUDA at import or plugin-load time: sglang loads plugins in every
process, including the launcher that forks the schedulers, so device queries happen only when a
hook runs inside a scheduler (or when `doctor` asks).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sglang_pd.deploy.common.contract import ENV_SBO_MODE

__all__ = [
    "COMBINE_KWARGS_DEEPEP",
    "COMBINE_KWARGS_SGLANG",
    "KERNEL_MODULE",
    "SBO_MODES",
    "SBO_MODE_ENV",
    "Availability",
    "LayoutDecision",
    "SignalLayout",
    "combine_half",
    "deepep_layout",
    "device_capability",
    "distribution_version",
    "kernel_status",
    "layout_for_params",
    "sbo_mode",
    "shared_half",
]

#: The environment variable the renderer sets from the topology's `decode.sbo` (deploy/common/contract.py).
SBO_MODE_ENV = ENV_SBO_MODE
#: Its values; the same words as `sglang_pd.deploy.spec.topology.SBOMode`.
SBO_MODES = ("off", "full", "shared-only")

#: Our sm_90 signal down-GEMM (kernels/README.md) and its DeepGEMM-compatible entry point.
KERNEL_MODULE = "sglang_pd.kernels.signal_gemm"
KERNEL_ENTRY = "fp8_m_grouped_gemm_nt_masked"

#: `low_latency_combine` keywords of the two DeepEP signal contracts: sglang's sm_90 row-block counters
#: (sgl-project/DeepGEMM PR #14, DeepGEMM PR #183) and the per-expert counters sglang uses on Blackwell
#: (sglang's `srt/batch_overlap/single_batch_overlap.py`); kernels/README.md compares them.
COMBINE_KWARGS_SGLANG = ("comp_signal", "block_m", "threshold")  # sm_90 row-block counters
COMBINE_KWARGS_DEEPEP = ("overlap", "src_signals", "src_signal_expect_value")  # per-expert counters

SignalLayout = Literal["sglang", "deepep"]


@dataclass(frozen=True)
class Availability:
    """Whether something can be used here; `reason` says why not (empty when it can)."""

    ok: bool
    reason: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def sbo_mode() -> str:
    """The SBO mode asked for by `SGLANG_PD_SBO_MODE` (unset: off)."""
    value = os.environ.get(SBO_MODE_ENV, "").strip().lower() or "off"
    if value not in SBO_MODES:
        raise ValueError(
            f"{SBO_MODE_ENV} has value {value!r}. Not one of {', '.join(SBO_MODES)} "
            "(sglang-pd renders it from the topology's decode.sbo)."
        )
    return value


def distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one (tests patch this)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return int(major), int(minor)
    except Exception:
        return None


def kernel_status() -> Availability:
    """Our signal down-GEMM is usable: its module imports and the device is sm_90."""
    try:
        module = importlib.import_module(KERNEL_MODULE)
    except Exception as exc:  # torch/triton missing or broken: any import error means unusable
        return Availability(False, f"our kernel {KERNEL_MODULE} does not import ({type(exc).__name__}: {exc})")
    if not callable(getattr(module, KERNEL_ENTRY, None)):
        return Availability(False, f"our kernel module {KERNEL_MODULE} has no {KERNEL_ENTRY}()")
    cap = device_capability()
    if cap is None:
        return Availability(False, "no CUDA device is visible, and our kernel needs an sm_90 GPU")
    if cap[0] != 9:
        return Availability(False, f"our kernel targets sm_90 (Hopper); this GPU is sm_{cap[0]}{cap[1]}")
    # The entry point runs the warp-specialized Gluon kernel when it can.
    return Availability(True, detail={"capability": f"sm_{cap[0]}{cap[1]}", "warp_specialized": module.ws_usable()})


# %%
# DeepEP's combine signature, read once.


def _params_from_source(path: Path, cls: str, method: str) -> list[str] | None:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                    return names[1:] if names and names[0] == "self" else names
    return None


def deepep_method_params(method: str) -> tuple[list[str] | None, str]:
    """Parameter names of `deep_ep.Buffer.<method>` and where they were read from.

    An imported `deep_ep` is inspected directly; otherwise its Python sources are parsed, so
    that this works where `deep_ep` cannot import (its import checks for a CUDA driver and
    initialises its JIT, which the plugin loader must not do).
    """
    module = sys.modules.get("deep_ep")
    buffer = getattr(module, "Buffer", None) if module is not None else None
    if buffer is not None and hasattr(buffer, method):
        params = list(inspect.signature(getattr(buffer, method)).parameters)
        return [p for p in params if p != "self"], f"inspect.signature(deep_ep.Buffer.{method})"
    spec = importlib.util.find_spec("deep_ep")
    if spec is None or not spec.submodule_search_locations:
        return None, "deep_ep is not installed"
    for root in spec.submodule_search_locations:
        for path in sorted(Path(root).rglob("*.py")):
            found = _params_from_source(path, "Buffer", method)
            if found is not None:
                return found, str(path)
    return None, f"no class Buffer with {method}() in the deep_ep sources"


def layout_for_params(params: Sequence[str]) -> SignalLayout | None:
    """The down-GEMM signal layout a `low_latency_combine` with these parameters consumes."""
    if all(k in params for k in COMBINE_KWARGS_SGLANG):
        return "sglang"
    if all(k in params for k in COMBINE_KWARGS_DEEPEP):
        return "deepep"
    return None


@dataclass(frozen=True)
class LayoutDecision:
    """The signal layout chosen from the installed DeepEP, or why none could be."""

    layout: SignalLayout | None
    source: str
    params: tuple[str, ...] = ()
    reason: str = ""


@functools.cache
def deepep_layout() -> LayoutDecision:
    """Decided once per process from the installed `deep_ep.Buffer.low_latency_combine`."""
    params, source = deepep_method_params("low_latency_combine")
    version = distribution_version("sgl-deep-ep") or distribution_version("deep-ep") or "unknown version"
    if params is None:
        return LayoutDecision(None, source, reason=f"DeepEP's low_latency_combine was not found ({source})")
    layout = layout_for_params(params)
    if layout is None:
        return LayoutDecision(
            None,
            source,
            tuple(params),
            reason=f"DeepEP {version}'s low_latency_combine takes neither {'/'.join(COMBINE_KWARGS_SGLANG)} "
            f"nor {'/'.join(COMBINE_KWARGS_DEEPEP)}, so the down GEMM cannot signal it",
        )
    return LayoutDecision(layout, source, tuple(params))


# %%
# The two SBO halves.


def shared_half() -> Availability:
    """Shared experts overlapping dispatch-recv: needs only DeepEP's receive hook."""
    params, source = deepep_method_params("low_latency_dispatch")
    if params is None:
        return Availability(False, f"DeepEP's low_latency_dispatch was not found ({source})")
    if "return_recv_hook" not in params:
        return Availability(False, "DeepEP's low_latency_dispatch has no return_recv_hook")
    return Availability(True, detail={"source": source})


def combine_half() -> Availability:
    """The down GEMM signalling combine-send: needs our kernel and a DeepEP signal layout."""
    kernel = kernel_status()
    if not kernel.ok:
        return kernel
    decision = deepep_layout()
    if decision.layout is None:
        return Availability(False, decision.reason)
    return Availability(True, detail={"layout": decision.layout, "source": decision.source})
