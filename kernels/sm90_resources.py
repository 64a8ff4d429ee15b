"""Compile the signal GEMM for sm_90a without a GPU and read its registers and spills from ptxas.

A tile whose live state needs more than 255 registers per thread spills to local memory, and a
spilling tile runs about twice as long (kernels/README.md). Whether it spills is decided at compile time,
so it can be checked here, on a CPU-only machine, before any GPU time is spent: Triton compiles
the kernel for an sm_90a target, and the ptxas that ships with Triton reports the resources.
On the H200 the figures matched the loaded kernel's ``n_regs`` for every tile checked. The SASS
(disassembled with Triton's nvdisasm) also shows where a K step's wgmma issue waits for a load
(``wgmma_waits_on_loads``).

    python -m sglang_pd.kernels.sm90_resources    # every configuration pick_config chooses, both kernels

This reaches into Triton internals: the active driver (``driver._active``, replaced for the call by
one that names an sm_90 target and never touches CUDA) and ``JITFunction.run(warmup=True)``
(compile, do not launch). Checked with Triton 3.6 and 3.8.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

from . import signal_gemm as sg

#: DeepSeek-V3's down projection, the shape the benchmark uses (E = 16 local experts).
SHAPE = {"E": 16, "M_max": 2048, "N": 7168, "K": 2048}


@dataclasses.dataclass(frozen=True)
class Resources:
    registers: int  # per thread
    spill_bytes: int  # local-memory stores per thread (0: nothing spills)
    shared_bytes: int  # per program
    loads_in_wgmma: tuple[str, ...] = ()  # see wgmma_waits_on_loads


_REGISTER = re.compile(r"\bR(\d+)\b")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")  # e.g. "@!P0 " before a predicated instruction


def wgmma_waits_on_loads(sass: str) -> list[str]:
    """The SASS instructions between a ``WARPGROUP.ARRIVE`` and its ``WARPGROUP.DEPBAR`` that read a
    register an ``LDG`` wrote after the previous ``DEPBAR`` (in text order).

    Such an instruction can wait for the load (an L2 round trip) while the step's wgmmas are being
    issued, and hold the rest of them up: a weight-scale select placed there cost 8 % on the H200
    (kernels/README.md). Text order does not follow the loop, so a hit is either a load of the same
    K step (it waits every step) or one of the tile's prologue before the K loop (it waits in the
    tile's first step only); a load a step earlier, behind a ``DEPBAR``, has arrived by then."""
    fresh: set[str] = set()
    between = False
    found = []
    for line in sass.splitlines():
        code = line.split("*/", 1)[-1].strip().rstrip(";").strip()
        if not code or code.startswith((".", "//")):
            continue
        opcode, _, operands = _PREDICATE.sub("", code).partition(" ")
        if opcode.startswith("WARPGROUP.ARRIVE"):
            between = True
        elif opcode.startswith("WARPGROUP.DEPBAR"):
            between, fresh = False, set()
            continue
        registers = _REGISTER.findall(operands)
        destination, sources = (registers[0], registers[1:]) if registers else (None, [])
        if between and not opcode.startswith(("QGMMA", "HGMMA")) and fresh.intersection(sources):
            found.append(code)
        if destination is not None:
            if opcode.startswith("LDG"):
                fresh.add(destination)
            else:
                fresh.discard(destination)
    return found


class _Sm90CompileOnly(CudaDriver):
    """A driver that reports an sm_90 device and stream 0 and loads nothing (no CUDA needed)."""

    def __init__(self) -> None:  # CudaDriver's own __init__ builds its launcher against libcuda
        self.utils = None

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _tool(name: str) -> str:
    """ptxas or nvdisasm as Triton's wheel ships them."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} not found at {path}: this needs a Triton wheel with the NVIDIA backend")
    return path


def compile_resources(
    config: sg.GemmConfig | sg.WsConfig, signal_mode: int = sg.SIGNAL_NONE, **shape: int
) -> Resources:
    """Registers, spills and shared memory of ``config`` compiled for sm_90a (FP8, MN-major
    activation scales as sglang passes them). For the warp-specialized kernel ptxas reports the
    launch's register count; ``setmaxnreg`` then moves registers from the producer to the math."""
    E, M_max, N, K = (shape.get(k, v) for k, v in SHAPE.items())
    # CPU tensors stand in for the arguments: only dtypes, strides and 16-byte alignment matter.
    a = torch.empty(E, M_max, K, dtype=torch.float8_e4m3fn)
    b = torch.empty(E, N, K, dtype=torch.float8_e4m3fn)
    a_scale = torch.empty(E, K // sg.SCALE_BLOCK, M_max).transpose(1, 2)
    b_scale = torch.empty(E, triton.cdiv(N, sg.SCALE_BLOCK), K // sg.SCALE_BLOCK)
    out = torch.empty(E, M_max, N, dtype=torch.bfloat16)
    masked_m = torch.empty(E, dtype=torch.int32)
    signal = torch.empty(E * triton.cdiv(M_max, config.block_m), dtype=torch.int32)

    if isinstance(config, sg.WsConfig):
        from . import signal_gemm_ws

        kernel_fn = signal_gemm_ws._masked_grouped_gemm_ws_kernel
    else:
        kernel_fn = sg._masked_grouped_gemm_kernel
    compiled = []
    launch = kernel_fn.run
    previous = driver._active  # None until something asked for the default driver
    driver.set_active(_Sm90CompileOnly())
    kernel_fn.run = lambda *args, **kwargs: compiled.append(launch(*args, **{**kwargs, "warmup": True}))
    try:
        sg.masked_grouped_gemm(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal,
            signal_mode=signal_mode, num_sms=129, config=config,
        )  # fmt: skip
    finally:
        kernel_fn.run = launch
        driver._active = previous
    (kernel,) = compiled
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run(
            [_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True, check=True
        ).stderr
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert registers and spills, f"unexpected ptxas report:\n{report}"
    return Resources(
        int(registers.group(1)), int(spills.group(1)), kernel.metadata.shared, tuple(wgmma_waits_on_loads(sass))
    )


def main() -> None:
    modes = {"none": sg.SIGNAL_NONE, "sglang": sg.SIGNAL_SGLANG, "deepep": sg.SIGNAL_DEEPEP}
    print(f"triton {triton.__version__}, sm_90a, E={SHAPE['E']} N={SHAPE['N']} K={SHAPE['K']}")
    print(f"{'m':>4} {'signals':>7} {'regs':>5} {'spill B':>7} {'smem KiB':>8} {'ld>mma':>6}  configuration")
    for m in (8, 16, 32, 64, 128):
        for name, mode in modes.items():
            for config in dict.fromkeys(sg.pick_config(m, signal_mode=mode, warp_specialized=w) for w in (False, True)):
                r = compile_resources(config, mode)
                print(
                    f"{m:>4} {name:>7} {r.registers:>5} {r.spill_bytes:>7} {r.shared_bytes / 1024:>8.0f}"
                    f" {len(r.loads_in_wgmma):>6}  {config}"
                )


if __name__ == "__main__":
    main()
