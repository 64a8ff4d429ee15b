"""The SBO server check's must-fail control: while a flag file exists, SBO's down GEMM drops experts.

sglang-pd's plugin sends every SBO down-GEMM call to `sglang_pd.kernels.signal_gemm.fp8_m_grouped_gemm_nt_masked`,
looked up on the module at each call (`sglang_patches/down_gemm.py`). `install()` replaces that
attribute with a wrapper that first multiplies the activation scales (`lhs[1]`, one slice per local
expert) in place by a gate on the device: 1 for every expert, 0 for FAULTY_EXPERTS while the file
named by SBO_CHECK_GEMM_FAULT_FLAG exists. Those experts' rows then come out of the GEMM as zeros and
the combine sends zeros for them, in every MoE layer: what a combine that read rows the GEMM had not
written yet looks like to the next layer, and what the on/off comparison must catch.

The gate is a device tensor rewritten by a watcher thread, not a Python branch: sglang replays each
decode step as a CUDA graph, so the wrapper runs only while a graph is captured, and the multiply it
adds is replayed with whatever the gate holds at that moment. Every switch, and the first call of
each shape, is a line in the file named by SBO_CHECK_GEMM_FAULT_LOG.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import fault_events  # beside this file
import on_import
import torch

FLAG_ENV = "SBO_CHECK_GEMM_FAULT_FLAG"
LOG_ENV = "SBO_CHECK_GEMM_FAULT_LOG"
MODULE = "sglang_pd.kernels.signal_gemm"
ENTRY = "fp8_m_grouped_gemm_nt_masked"
#: A quarter of the 16 routed experts of the preset's model (top-4 routing): most tokens meet one.
FAULTY_EXPERTS = (0, 1, 2, 3)
#: How often the watcher looks at the flag file; the check waits longer than this after a switch.
POLL_S = 0.05


def log(event: str, **fields: Any) -> None:
    fault_events.append(os.environ.get(LOG_ENV), event, **fields)


def gate_values(num_experts: int, armed: bool) -> torch.Tensor:
    """What the gate holds: ones, with FAULTY_EXPERTS at zero while armed (on the CPU)."""
    values = torch.ones(num_experts, dtype=torch.float32)
    if armed:
        values[[e for e in FAULTY_EXPERTS if e < num_experts]] = 0.0
    return values


class Gates:
    """One gate per (device, expert count), and the thread that keeps them in step with the flag."""

    def __init__(self, flag: str) -> None:
        self.flag = flag
        self.armed = os.path.exists(flag)
        self.gates: dict[tuple[str, int], torch.Tensor] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def get(self, device: torch.device, num_experts: int) -> torch.Tensor:
        key = (str(device), num_experts)
        with self.lock:
            if key not in self.gates:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    # Made inside a capture, the gate's values would be rewritten by every replay.
                    raise RuntimeError(
                        "the SBO check's GEMM fault met its first down GEMM inside a CUDA-graph capture; "
                        "it needs an eager call first (sglang's warm-up runs before each capture)"
                    )
                self.gates[key] = gate_values(num_experts, self.armed).to(device)
                log("gate", device=str(device), experts=num_experts, faulty=list(FAULTY_EXPERTS))
            if self.thread is None:
                self.thread = threading.Thread(target=self.watch, name="sbo-check-gemm-fault", daemon=True)
                self.thread.start()
            return self.gates[key]

    def set(self, armed: bool) -> None:
        with self.lock:
            for (_, n), gate in self.gates.items():
                if gate.is_cuda:
                    with torch.cuda.device(gate.device):
                        stream = torch.cuda.Stream()
                        with torch.cuda.stream(stream):
                            gate.copy_(gate_values(n, armed).to(gate.device))
                        stream.synchronize()
                else:
                    gate.copy_(gate_values(n, armed))
            self.armed = armed
        log("on" if armed else "off")

    def watch(self) -> None:
        while True:
            armed = os.path.exists(self.flag)
            if armed != self.armed:
                self.set(armed)
            time.sleep(POLL_S)


def faulty(entry: Callable[..., Any], gates: Gates) -> Callable[..., Any]:
    """`entry` (our SBO down GEMM) whose activation scales first pass through the gate."""
    shapes: set[tuple[int, ...]] = set()

    @functools.wraps(entry)
    def gemm(lhs: tuple[torch.Tensor, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        scale = lhs[1]
        if not scale.is_floating_point():
            raise RuntimeError(f"the SBO check's GEMM fault gates float activation scales, got {scale.dtype}")
        gate = gates.get(scale.device, scale.shape[0])
        scale.mul_(gate.view(-1, *([1] * (scale.dim() - 1))))
        if tuple(scale.shape) not in shapes:
            shapes.add(tuple(scale.shape))
            capturing = scale.is_cuda and torch.cuda.is_current_stream_capturing()
            log("gated", scale_shape=list(scale.shape), capturing=capturing)
        return entry(lhs, *args, **kwargs)

    gemm.sbo_check_fault = True  # type: ignore[attr-defined]
    return gemm


def patch(module: ModuleType, gates: Gates) -> None:
    original = getattr(module, ENTRY)
    if getattr(original, "sbo_check_fault", False):
        return
    setattr(module, ENTRY, faulty(original, gates))
    log("armed", module=module.__name__, target=ENTRY, faulty=list(FAULTY_EXPERTS))


def install() -> None:
    """Wrap ENTRY now if MODULE is loaded, else as soon as the plugin imports it."""
    gates = Gates(os.environ[FLAG_ENV])
    on_import.when_imported(MODULE, functools.partial(patch, gates=gates))
