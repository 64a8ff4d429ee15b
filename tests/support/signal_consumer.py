"""
A combine-send stand-in: copy the down GEMM's rows out as soon as their signal says they are done
===============================================================================================

DeepEP's combine-send polls the down GEMM's signals and sends each finished group of tokens to its
source rank while the GEMM is still running. These kernels do the same with a plain copy, so that
tests can prove the GEMM's release ordering (the copy must never see a half-written row) and the
overlap benchmark can measure what early sending saves.

A consumer runs a few programs (the SMs the GEMM leaves free). Each program takes units of work –
a row-block (sglang layout) or an expert (DeepEP layout) – round-robin, spins on the unit's
counter with an acquire load until it reaches its target, then copies the unit's valid rows from
``src`` to ``dst``. ``dst`` may live on a peer GPU (NVLink). ``waited[unit]`` is set to 1 when the
first poll found the unit unfinished, i.e. the copy really overlapped the GEMM, and to 2 when the
unit never completed within ``MAX_POLLS`` polls (then nothing is copied: a bug, not a hang).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["copy_when_signalled"]


@triton.jit
def _copy_rows(
    src_ptr,
    dst_ptr,
    row_start,
    row_end,
    N,
    stride_sm,
    stride_dm,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Copy rows [row_start, row_end) × [0, N) through L2 (``.cg``: never a stale L1 line)."""
    for r in range(row_start, row_end, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        for c in range(0, N, BLOCK_C):
            offs_c = c + tl.arange(0, BLOCK_C)
            mask = (offs_r < row_end)[:, None] & (offs_c < N)[None, :]
            x = tl.load(src_ptr + offs_r[:, None] * stride_sm + offs_c[None, :], mask=mask, cache_modifier=".cg")
            tl.store(dst_ptr + offs_r[:, None] * stride_dm + offs_c[None, :], x, mask=mask)


@triton.jit
def _poll(ptr, ACQUIRE_ASM: tl.constexpr):
    """Read *ptr with acquire semantics at GPU scope. With ACQUIRE_ASM every thread does its own
    ``ld.acquire`` (no value is shared between threads, so none can see a stale one); otherwise
    Triton's scalar atomic (one thread, result broadcast through shared memory)."""
    if ACQUIRE_ASM:
        return tl.inline_asm_elementwise(
            "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _copy_when_signalled_kernel(
    signal_ptr,
    masked_m_ptr,
    src_ptr,
    dst_ptr,
    waited_ptr,
    E,
    M_MAX,
    N,
    target,
    stride_se,
    stride_sm,
    stride_de,
    stride_dm,
    PER_EXPERT: tl.constexpr,  # DeepEP layout: one counter per expert; else one per row-block
    BLOCK_M: tl.constexpr,  # the GEMM's block_m (sglang layout)
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MAX_POLLS: tl.constexpr,  # give up after this many polls (about a second) instead of hanging
    ACQUIRE_ASM: tl.constexpr,  # poll with per-thread inline-PTX acquire loads (not on the CPU)
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    if PER_EXPERT:
        num_units = E
        units_per_expert = 1
    else:
        units_per_expert = tl.cdiv(M_MAX, BLOCK_M)
        num_units = E * units_per_expert
    for unit in range(pid, num_units, num_programs):
        e = unit // units_per_expert
        m_e = tl.minimum(tl.load(masked_m_ptr + e), M_MAX)
        if PER_EXPERT:
            row_start = 0
            row_end = m_e
        else:
            row_start = (unit % units_per_expert) * BLOCK_M
            row_end = tl.minimum(row_start + BLOCK_M, m_e)
        # DeepEP waits on every expert (its counter always reaches the target); sglang's combine
        # only on row-blocks that hold tokens.
        if PER_EXPERT or row_start < row_end:
            seen = _poll(signal_ptr + unit, ACQUIRE_ASM)
            polls = 1
            waited = (seen < target).to(tl.int32)
            while (seen < target) & (polls < MAX_POLLS):
                seen = _poll(signal_ptr + unit, ACQUIRE_ASM)
                polls += 1
            # 2: gave up (the unit never completed; a test failure rather than a hang).
            tl.store(waited_ptr + unit, tl.where(seen < target, 2, waited))
            if seen >= target:
                _copy_rows(
                    src_ptr + e * stride_se,
                    dst_ptr + e * stride_de,
                    row_start,
                    row_end,
                    N,
                    stride_sm,
                    stride_dm,
                    BLOCK_R,
                    BLOCK_C,
                )


def copy_when_signalled(
    signal: torch.Tensor,
    masked_m: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    target: int,
    *,
    per_expert: bool,
    block_m: int = 64,
    num_programs: int = 3,
    waited: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy each unit of ``src [E, M_max, N]`` to ``dst`` once its counter reaches ``target``.

    ``per_expert=False``: sglang layout, ``target`` = the GEMM's threshold; ``True``: DeepEP layout,
    ``target`` = the GEMM's number of programs. Returns ``waited`` (int32, one per unit).
    """
    E, M_max, N = src.shape
    assert dst.shape == src.shape and dst.dtype == src.dtype, "dst must match src"
    assert src.stride(2) == 1 and dst.stride(2) == 1, "rows must be contiguous"
    num_units = E if per_expert else E * triton.cdiv(M_max, block_m)
    if waited is None:
        waited = torch.zeros(num_units, dtype=torch.int32, device=src.device)
    _copy_when_signalled_kernel[(num_programs,)](
        signal.view(torch.int32),
        masked_m,
        src,
        dst,
        waited,
        E,
        M_max,
        N,
        target,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        PER_EXPERT=per_expert,
        BLOCK_M=block_m,
        BLOCK_R=8,
        BLOCK_C=1024,
        MAX_POLLS=1 << 22,
        ACQUIRE_ASM=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=8,
    )
    return waited
