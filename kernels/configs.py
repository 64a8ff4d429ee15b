"""The signal GEMM's launch configurations (the Triton kernel's `GemmConfig`, the Gluon kernel's
`WsConfig`) and the FP8 scale block both kernels share; the two kernel modules import them here."""

from __future__ import annotations

import dataclasses

__all__ = ["SCALE_BLOCK", "GemmConfig", "WsConfig"]

#: DeepSeek-V3's quantization granularity: one activation scale per token per 128 channels, one
#: weight scale per 128×128 block.
SCALE_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of the kernel (all compile-time)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_stages: int = 4
    num_warps: int = 4
    swap_ab: bool = False
    use_tma: bool = False
    flatten: bool = True
    signal_asm: bool = False

    def smem_bytes(self, elem_bytes: int = 1) -> int:
        """Shared memory the K pipeline needs (A and B stages), ignoring the epilogue."""
        return self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """A launch configuration of the warp-specialized Gluon kernel (``signal_gemm_ws.py``): FP8
    only, no swap-AB; two math warpgroups (a 64-row or 128-column half of the tile each), a
    producer warp and storer warps (the tile out to D, then its signal)."""

    block_m: int = 64
    block_n: int = 256
    num_stages: int = 4
    math_regs: int = 232  # registers per thread of the math warpgroups (setmaxnreg)
    producer_regs: int = 40  # per thread of the producer warp
    storer_warps: int = 2  # warps that copy finished tiles out and release their signals
    storer_regs: int = 40  # per thread of the storer warps

    #: The tiles whose halves fit a math warpgroup's registers: a half's accumulator and its K
    #: step's product, 64×128 (or 64×192 as a 128- and a 64-column wgmma) float32s.
    TILES = ((64, 256), (128, 128), (128, 192))

    def __post_init__(self) -> None:
        registers = 256 * self.math_regs + 32 * self.producer_regs + 32 * self.storer_warps * self.storer_regs
        assert registers <= 65536, (
            f"{self} needs {registers} registers, more than an SM's 65536: lower storer_warps or the per-thread counts"
        )
        assert self.storer_warps in (1, 2, 4), (
            f"storer_warps must be 1, 2 or 4, got {self.storer_warps}: "
            "a storer pass must cover whole 8-row swizzle patterns"
        )
        assert (self.block_m, self.block_n) in self.TILES, (
            f"unsupported configuration {self}: the tile is 64x256, 128x128 or 128x192, split in two "
            "halves for the two math warpgroups (a half's accumulator and its K step's product fill a "
            "thread's registers)"
        )
