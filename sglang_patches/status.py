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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sglang_pd.deploy.common.contract import ENV_SBO_MODE, SBOMode

__all__ = [
    "COMBINE_KWARGS_DEEPEP",
    "COMBINE_KWARGS_SGLANG",
    "COMBINE_SEND_SMS_ENV",
    "DEEPEP_LAYOUT_SEND_SMS",
    "KERNEL_MODULE",
    "LAYOUT_FIX",
    "SBO_MODES",
    "SBO_MODE_ENV",
    "Availability",
    "LayoutDecision",
    "SignalLayout",
    "assume_capability",
    "assumed_capability",
    "combine_half",
    "deepep_layout",
    "device_capability",
    "distribution_version",
    "kernel_status",
    "layout_contract",
    "layout_for_params",
    "sbo_mode",
    "sglang_combine_send_sms",
    "shared_half",
]

#: The environment variable the renderer sets from the topology's `decode.sbo` (deploy/common/contract.py).
SBO_MODE_ENV = ENV_SBO_MODE
#: Its values; the same words as `sglang_pd.deploy.spec.topology.SBOMode`.
SBO_MODES = tuple(mode.value for mode in SBOMode)

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


_assumed: list[tuple[int, int]] = []


def assume_capability(cap: tuple[int, int] | None) -> None:
    """Answer `cap` for the device from now on (`doctor --capability`, where no GPU is visible); None: undo."""
    _assumed[:] = [] if cap is None else [cap]


def assumed_capability() -> tuple[int, int] | None:
    return _assumed[0] if _assumed else None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one (tests patch this)."""
    if _assumed:
        return _assumed[0]
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


# %%
# The DeepEP contract of full SBO on sm_90.

#: sglang's environment variable for the SMs its low-latency combine sends on while the down GEMM runs
#: (`srt/batch_overlap/single_batch_overlap.py`, `compute_overlap_args`); the GEMM gets the rest.
COMBINE_SEND_SMS_ENV = "SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS"
#: sglang's value without it on sm_90 (32 on Blackwell): 3 send SMs, 129 GEMM programs on an H200's 132.
SM90_DEFAULT_SEND_SMS = 3
#: The send SMs sgl-deep-ep 0.1.2.post1's `combine_overlappable` (the "deepep" layout) launches whatever
#: sglang asks: sglang's `num_sms` has no counterpart in that contract (combine.py drops it).
DEEPEP_LAYOUT_SEND_SMS = 32
#: What makes full SBO safe on sm_90: a DeepEP whose combine takes sglang's own sm_90 signals.
LAYOUT_FIX = (
    "build DeepEP's antgroup-opt branch (DeepEP PR #483; scripts/gpu/build_deepep.sh, the image's DEEPEP_REF), "
    "whose low_latency_combine takes sglang's sm_90 comp_signal/block_m/threshold/num_sms, "
    "or set decode.sbo: shared-only"
)


def sglang_combine_send_sms(env: Mapping[str, str] | None = None) -> int:
    """The SMs sglang's sm_90 combine sends on during the down GEMM (its `compute_overlap_args`)."""
    value = (os.environ if env is None else env).get(COMBINE_SEND_SMS_ENV, "").strip()
    return int(value) if value else SM90_DEFAULT_SEND_SMS


def layout_contract(layout: SignalLayout, *, ep_nodes: int = 1, send_sms: int | None = None) -> Availability:
    """Whether full SBO may run on sm_90 with this signal layout, for a decode EP spanning `ep_nodes` nodes.

    The "sglang" layout (DeepEP antgroup-opt) takes sglang's row-block signals, block_m, threshold and
    send SMs as they are. The "deepep" layout (sgl-deep-ep 0.1.2.post1) is refused where it would trap or
    hang: its `combine_overlappable` sends the finish flag over NVLink only (`if (dst_p2p_ptr == 0)
    EP_DEVICE_ASSERT(0)`), so a peer on another node traps; and it spins on 32 send SMs with no timeout
    while our persistent GEMM keeps all but sglang's send SMs, so unless sglang also gives the combine 32
    (`SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS=32`) the two do not fit on the GPU at once: a deadlock, or no
    overlap. (It also asserts `mask_buffer_ptr == nullptr`, so sglang's elastic-EP masks cannot be on.)
    """
    if layout == "sglang":
        return Availability(True, detail={"layout": layout})
    send = sglang_combine_send_sms() if send_sms is None else send_sms
    problems: list[str] = []
    if ep_nodes > 1:
        problems.append(
            f"its combine_overlappable sends the finish flag over NVLink only and traps on a peer across nodes, "
            f"and decode EP here spans {ep_nodes} nodes"
        )
    if send != DEEPEP_LAYOUT_SEND_SMS:
        problems.append(
            f"it sends on {DEEPEP_LAYOUT_SEND_SMS} SMs while sglang leaves {send} to combine-send "
            f"({COMBINE_SEND_SMS_ENV}={send}) and gives our persistent down GEMM all the others, so the two "
            "cannot run at once (its waits have no timeout: a deadlock, or no overlap)"
        )
    if not problems:
        return Availability(True, detail={"layout": layout, "send_sms": send})
    return Availability(
        False,
        'full SBO on sm_90 with sgl-deep-ep\'s per-expert signal layout ("deepep") is unsafe here: '
        + "; ".join(problems)
        + f". Fix: {LAYOUT_FIX}",
        detail={"layout": layout, "send_sms": send, "ep_nodes": ep_nodes},
    )


def combine_half(ep_nodes: int = 1) -> Availability:
    """The down GEMM signalling combine-send: our kernel and a DeepEP signal layout safe for this decode EP."""
    kernel = kernel_status()
    if not kernel.ok:
        return kernel
    decision = deepep_layout()
    if decision.layout is None:
        return Availability(False, decision.reason)
    contract = layout_contract(decision.layout, ep_nodes=ep_nodes)
    if not contract.ok:
        return contract
    return Availability(True, detail={"layout": decision.layout, "source": decision.source})
