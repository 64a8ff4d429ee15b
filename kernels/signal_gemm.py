"""
Masked grouped GEMM with completion signals: the MoE down projection for single-batch overlap
==============================================================================================

Why this exists
---------------
Single-batch overlap (SBO; DeepGEMM PR #183, sgl-project/DeepGEMM PR #14) lets DeepEP's
combine-send start sending a group of tokens as soon as the down projection has finished *those*
tokens, instead of after the whole GEMM. It needs a down GEMM that says, while it runs, which rows are done. The
sgl-deep-gemm wheels that sglang ships have no such kernel for sm_90 (H100, H200, H20), so sglang
refuses ``--enable-single-batch-overlap`` there. This file is that kernel, in Triton, and the entry
points; ``signal_gemm_ws.py`` is the same GEMM warp-specialized in Gluon, which they pick for FP8
on sm_90 GPUs.

What it computes
----------------
For every local expert ``e`` (``E`` of them) and its first ``masked_m[e]`` received tokens::

    D[e, :masked_m[e], :] = A[e, :masked_m[e], :] @ B[e].T          (fp32 accumulate, bf16 out)

* ``A`` is ``[E, M_max, K]`` FP8 e4m3 with DeepSeek-V3's activation scales: one float32 per token
  per 128 channels, ``a_scale[E, M_max, K // 128]`` (any strides: DeepEP hands them over MN-major).
* ``B`` is ``[E, N, K]`` FP8 e4m3 with 128×128 block scales ``b_scale[E, ceil(N/128), K // 128]``.
* Rows at or beyond ``masked_m[e]`` are never written (the combine never reads them, and writing
  them would waste bandwidth on up to ``M_max`` rows per expert).
* A bf16 variant takes bf16 ``A`` and ``B`` and no scales.

The scales are applied per 128-wide K step in fp32 (``acc += (a_k @ b_k.T) * sa * sb``), the same
recipe as DeepGEMM's sm_90 1D2D kernel, so the result matches it to rounding.

How the work is split
---------------------
The kernel is persistent: ``num_sms`` programs (sglang leaves a few SMs to the communication
kernel that runs beside it) walk one global list of output tiles. The list is ordered expert by
expert; inside an expert, the ``block_m`` row-blocks of one ``block_n`` column-block are adjacent,
so tiles that share weights run at the same time and the second read hits L2. Tile ``g`` of the
list goes to program ``g % num_programs``. Only row-blocks that hold tokens (``< masked_m[e]``)
are in the list, so an expert with no tokens costs nothing.

Decode is weight-bound: at ``m <= 64`` tokens per expert every weight byte is read once and used
for at most 64 rows, so the kernel's job is to keep enough weight bytes in flight. ``num_stages``
deep software pipelining over K does that. With few tokens, ``SWAP_AB`` computes ``D.T = B @ A.T``
so that the weights fill wgmma's 64-row side and a tile needs only 16 or 32 token rows.

Signals (the point of the exercise)
-----------------------------------
Two layouts, because sglang and DeepEP each have one (kernels/README.md, "The signal contract"):

a. ``SIGNAL_SGLANG`` – sglang's sm_90 contract: ``int32 signal[E * ceil(M_max / block_m)]``. When a
   ``block_m × block_n`` tile is stored, its row-block's counter gets +1. A row-block is complete
   when its counter reaches ``threshold = ceil(N / block_n)``; the entry returns
   ``(block_m, threshold)`` so that DeepEP's combine knows what to wait for.
b. ``SIGNAL_DEEPEP`` – DeepEP's ``src_signals`` contract: ``uint32 signal[E]``. Each persistent
   program adds 1 to ``signal[e]`` once it has no more tiles of expert ``e`` – also when it had none
   – so the expert is complete when ``signal[e] == num_programs``.

Ordering: a signal must never become visible before the rows it announces. Every thread of the
program stores its part of the tile; ``tl.debug_barrier()`` (``bar.sync``) orders all those stores
before the one thread that then does the ``atomic_add`` with ``sem="release", scope="gpu"``; the
release is cumulative, so a consumer that reads the counter with an acquire load and then reads
the rows sees the rows. ``tests/kernels/test_signal_gemm.py`` checks this with a polling consumer
over 1000 randomized runs.

DeepEP's combine then reads the rows with TMA (``cp.async.bulk``), which is the *async proxy*,
while our stores and the release are generic-proxy operations. PTX orders accesses of two proxies
only through a proxy fence, so every storing thread issues ``fence.proxy.async.global`` after its
stores and before the barrier that precedes the release (the writer-side pattern of CUTLASS's
``fence_view_async_shared``, here for global memory; kernels/README.md, "A consumer that reads by
TMA").
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .configs import SCALE_BLOCK, GemmConfig, WsConfig

__all__ = [
    "SIGNAL_DEEPEP",
    "SIGNAL_NONE",
    "SIGNAL_SGLANG",
    "GemmConfig",
    "WsConfig",
    "bf16_m_grouped_gemm_nt_masked",
    "fp8_m_grouped_gemm_nt_masked",
    "masked_grouped_gemm",
    "pick_config",
    "reference_deepep_signal",
    "reference_masked_grouped_gemm",
    "reference_sglang_signal",
    "ws_usable",
]

# %%
# Constants
# ---------

#: Signal layouts (the kernel's ``SIGNAL_MODE``). 0: no signals, the plain masked GEMM.
SIGNAL_NONE = 0
#: sglang sm_90: one int32 counter per (expert, row-block), +1 per finished tile.
SIGNAL_SGLANG = 1
#: DeepEP ``src_signals``: one uint32 counter per expert, +1 per program once done with it.
SIGNAL_DEEPEP = 2

#: SMs sglang leaves to the DeepEP communication kernel on Hopper (`communicate_num_sms` in sglang's
#: `srt/batch_overlap/single_batch_overlap.py`, unless SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS is
#: set); the default ``num_sms`` is the device's count minus these when signals are on.
SMS_KEPT_FOR_COMMUNICATION = 3


# %%
# Releasing a signal
# ------------------
# Both helpers make every thread of the program fence its stores for the async proxy (the consumer
# reads them by TMA), wait at a barrier (so all of the tile's stores are done), then let chosen
# threads do one releasing add at GPU scope. `_fence_for_tma_readers()`, `tl.debug_barrier()` and
# `tl.atomic_add(..., sem="release")` say the same in Triton; these say it in one opaque PTX block
# (GemmConfig.signal_asm chooses; the benchmark times both).


#: Triton's CPU interpreter runs programs one after another and has no inline PTX (nor proxies).
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _fence_for_tma_readers():
    """fence.proxy.async.global: this thread's generic stores before any later async-proxy (TMA) read."""
    if not _INTERPRETED:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def _release_add_one(ptr):
    """fence.proxy.async.global and bar.sync, then thread 0 adds 1 to *ptr (release, GPU scope)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred %p0;
        .reg .b32 %t;
        fence.proxy.async.global;
        bar.sync 0;
        mov.u32 %t, %tid.x;
        setp.eq.u32 %p0, %t, 0;
        @%p0 red.release.gpu.global.add.s32 [$1], 1;
        mov.u32 $0, 0;
        }
        """,
        "=r,l",
        [ptr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _release_add_one_range(base, lo, hi):
    """fence.proxy.async.global and bar.sync, then thread t adds 1 to base[t] for lo <= t < hi (release, GPU scope)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred %p<3>;
        .reg .b32 %t;
        .reg .b64 %a;
        fence.proxy.async.global;
        bar.sync 0;
        mov.u32 %t, %tid.x;
        setp.ge.u32 %p0, %t, $2;
        setp.lt.u32 %p1, %t, $3;
        and.pred %p2, %p0, %p1;
        mul.wide.u32 %a, %t, 4;
        add.s64 %a, %a, $1;
        @%p2 red.release.gpu.global.add.s32 [%a], 1;
        mov.u32 $0, 0;
        }
        """,
        "=r,l,r,r",
        [base, lo, hi],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _signal_experts(signal_ptr, experts, lo, hi, SIGNAL_ASM: tl.constexpr):
    """DeepEP layout: add 1 to signal[x] for lo <= x < hi, after all of the program's stores."""
    if SIGNAL_ASM:
        _release_add_one_range(signal_ptr, lo, hi)
    else:
        _fence_for_tma_readers()
        tl.debug_barrier()
        tl.atomic_add(signal_ptr + experts, 1, mask=(experts >= lo) & (experts < hi), sem="release", scope="gpu")


@triton.jit
def _weight_scales(row_ptr, nb, N, stride_bsn, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """The weight scales of column-block ``nb`` at one K step: a scalar when the tile lies in one
    128-column scale block, else a ``[BLOCK_N]`` vector built from two scalar loads. (A vector of
    per-column pointers costs BLOCK_N / 4 registers per thread and made 128-row tiles spill.)"""
    tl.static_assert(BLOCK_N <= 2 * SCALE_BLOCK, "at most two weight-scale blocks per tile")
    first = nb * BLOCK_N // SCALE_BLOCK
    sb = tl.load(row_ptr + first * stride_bsn)
    if BLOCK_N > SCALE_BLOCK:
        second = tl.minimum(first + 1, tl.cdiv(N, SCALE_BLOCK) - 1)
        sb = tl.where(tl.arange(0, BLOCK_N) < SCALE_BLOCK, sb, tl.load(row_ptr + second * stride_bsn))
    return sb


@triton.jit
def _add_scaled(acc, partial, sa, sb, SWAP_AB: tl.constexpr, PER_COLUMN: tl.constexpr):
    """``acc + partial * sa (per token) * sb (per column if PER_COLUMN, else one for the tile)``;
    with SWAP_AB the tile is transposed: weights' columns down, tokens across."""
    if PER_COLUMN:
        if SWAP_AB:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
            scale = sb[:, None] * sa[None, :]
        else:
            scale = sa[:, None] * sb[None, :]
    elif SWAP_AB:
        scale = (sa * sb)[None, :]
    else:
        scale = (sa * sb)[:, None]
    return acc + partial * scale


# %%
# The kernel
# ----------


@triton.jit
def _masked_grouped_gemm_kernel(
    # Pointers (or TMA descriptors for A and B when USE_TMA).
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    d_ptr,
    masked_m_ptr,
    signal_ptr,
    # Problem size: E experts, up to M_MAX rows each, D is M_MAX × N per expert, K the reduction.
    E,
    M_MAX,
    N,
    K,
    # Strides: how far the pointer moves when that index grows by one.
    stride_ae,
    stride_am,
    stride_ak,
    stride_ase,
    stride_asm,
    stride_ask,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bse,
    stride_bsn,
    stride_bsk,
    stride_de,
    stride_dm,
    stride_dn,
    # Meta-parameters.
    FP8: tl.constexpr,  # A and B are e4m3 with DeepSeek scales; else bf16 without scales
    SIGNAL_MODE: tl.constexpr,  # SIGNAL_NONE / SIGNAL_SGLANG / SIGNAL_DEEPEP
    SWAP_AB: tl.constexpr,  # compute D.T = B @ A.T: weights fill the 64-row wgmma side
    USE_TMA: tl.constexpr,  # a_ptr / b_ptr are host TensorDescriptors over [E*M_MAX, K] / [E*N, K]
    BLOCK_M: tl.constexpr,  # tokens per tile = the signal's row-block (>= 64 for sglang's buffer)
    BLOCK_N: tl.constexpr,  # output channels per tile
    BLOCK_K: tl.constexpr,  # reduction step; divides SCALE_BLOCK so one scale pair per step
    SCALE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the K loop
    SIGNAL_ASM: tl.constexpr,  # release signals through one inline-PTX block (see above)
    FLATTEN: tl.constexpr,  # pipeline across tiles (one flattened loop over tile and K)
    E_POW2: tl.constexpr,  # E rounded up to a power of two (the per-expert vectors' length)
    FP8_AS_BYTES: tl.constexpr,  # A and B arrive as uint8 (Triton's CPU interpreter only)
):
    tl.static_assert(SCALE_BLOCK % BLOCK_K == 0, "BLOCK_K must divide the 128-channel scale block")
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    num_m_blocks_max = tl.cdiv(M_MAX, BLOCK_M)  # the signal buffer's row-blocks per expert
    tl.static_assert(E_POW2 >= 1, "E_POW2 is E rounded up to a power of two")

    # The tile list, computed without loops: per expert its rows, row-blocks and tiles, and the
    # inclusive running sum of tiles. Tile g belongs to the first expert whose running sum
    # exceeds g.
    experts = tl.arange(0, E_POW2)
    rows_e = tl.minimum(tl.load(masked_m_ptr + experts, mask=experts < E, other=0), M_MAX)
    m_blocks_e = tl.cdiv(rows_e, BLOCK_M)
    tiles_e = m_blocks_e * num_n_blocks
    tiles_through_e = tl.cumsum(tiles_e, 0)
    num_tiles = tl.sum(tiles_e, 0)

    if SIGNAL_MODE == 2:
        # DeepEP layout. A program counts itself in for expert x once it has stored its last tile
        # of x, or, for experts with none of its tiles, once it is past them. Experts before its
        # first tile (all of them if it has none) are counted in now; the others right after
        # the tile stores below, in the same place as those stores: the pipeliner may run the
        # start of the next tile before the end of this one, so a signal at a tile's start could
        # overtake the previous tile's stores (seen on the H200 with the flattened loop).
        first_e = tl.where(pid < num_tiles, tl.sum((tiles_through_e <= pid).to(tl.int32), 0), E)
        _signal_experts(signal_ptr, experts, 0, first_e, SIGNAL_ASM)
    # `flatten` lets Triton's pipeliner run one loop over (tile, k): the next tile's first loads
    # are in flight while this tile finishes, instead of the pipeline draining at every tile.
    for g in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN):
        e = tl.sum((tiles_through_e <= g).to(tl.int32), 0)
        is_e = experts == e
        t = g - tl.sum(tl.where(is_e, tiles_through_e - tiles_e, 0), 0)
        num_m_blocks = tl.sum(tl.where(is_e, m_blocks_e, 0), 0)
        m_e = tl.sum(tl.where(is_e, rows_e, 0), 0)
        # Row-blocks of one column-block are adjacent, so they share the weight tile in L2.
        mb = t % num_m_blocks
        nb = t // num_m_blocks
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < m_e
        # Wrapping the column index keeps the weight loads unmasked (and vectorized); the
        # wrapped columns are never stored.
        offs_n_ld = offs_n % N
        if not USE_TMA:
            a_ptrs = a_ptr + e * stride_ae + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + e * stride_be + offs_n_ld[:, None] * stride_bn + offs_k[None, :] * stride_bk
        as_ptrs = a_scale_ptr + e * stride_ase + offs_m * stride_asm

        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K):
            if USE_TMA:
                a = a_ptr.load([e * M_MAX + mb * BLOCK_M, k])
                b = b_ptr.load([e * N + nb * BLOCK_N, k])
            else:
                # Rows past masked_m load as zeros: they may hold anything, NaN included.
                a = tl.load(a_ptrs + k * stride_ak, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs + k * stride_bk)
            if FP8_AS_BYTES:
                a = a.to(tl.float8e4nv, bitcast=True)
                b = b.to(tl.float8e4nv, bitcast=True)
            if FP8:
                # Scales first: their loads are then in flight while the tensor cores work.
                ks = k // SCALE_BLOCK
                sa = tl.load(as_ptrs + ks * stride_ask, mask=row_ok, other=0.0)
                sb_ptr = b_scale_ptr + e * stride_bse + ks * stride_bsk
                sb = _weight_scales(sb_ptr, nb, N, stride_bsn, BLOCK_N, SCALE_BLOCK)
            if SWAP_AB:  # noqa: SIM108 (a constexpr branch, resolved at compile time)
                partial = tl.dot(b, tl.trans(a))
            else:
                partial = tl.dot(a, tl.trans(b))
            if FP8:
                acc = _add_scaled(acc, partial, sa, sb, SWAP_AB, BLOCK_N > SCALE_BLOCK)
            else:
                acc += partial

        out = acc.to(d_ptr.dtype.element_ty)
        if SWAP_AB:
            d_ptrs = d_ptr + e * stride_de + offs_n[:, None] * stride_dn + offs_m[None, :] * stride_dm
            tl.store(d_ptrs, out, mask=(offs_n < N)[:, None] & row_ok[None, :])
        else:
            d_ptrs = d_ptr + e * stride_de + offs_m[:, None] * stride_dm + offs_n[None, :] * stride_dn
            tl.store(d_ptrs, out, mask=row_ok[:, None] & (offs_n < N)[None, :])

        if SIGNAL_MODE == 1:
            # Every thread's part of the tile is stored before the one releasing add.
            if SIGNAL_ASM:
                _release_add_one(signal_ptr + e * num_m_blocks_max + mb)
            else:
                _fence_for_tma_readers()
                tl.debug_barrier()
                tl.atomic_add(signal_ptr + e * num_m_blocks_max + mb, 1, sem="release", scope="gpu")
        if SIGNAL_MODE == 2:
            # Done with experts [e, expert of this program's next tile): its tiles are ordered.
            g_next = g + num_programs
            next_e = tl.where(g_next < num_tiles, tl.sum((tiles_through_e <= g_next).to(tl.int32), 0), E)
            _signal_experts(signal_ptr, experts, e, next_e, SIGNAL_ASM)


# %%
# Configurations
# --------------


#: Configurations measured best on the H200 (kernels/README.md, ``benchmarks/sweep_sbo_gemm.py``), by
#: expected rows per expert. Up to 32 rows, swap-AB puts the weights on wgmma's 64-row side and
#: the tokens on its narrow side, so a tile loads 16 or 32 token rows instead of 64. At 128 rows a
#: 128×128 tile reads each weight tile once (128×256 would need more than 255 registers a thread).
_TUNED: dict[int, GemmConfig] = {
    16: GemmConfig(block_m=16, block_n=256, num_stages=4, num_warps=8, swap_ab=True, use_tma=True),
    32: GemmConfig(block_m=32, block_n=256, num_stages=3, num_warps=8, swap_ab=True, use_tma=True),
    64: GemmConfig(block_m=64, block_n=256, num_stages=3, num_warps=8, use_tma=True),
    128: GemmConfig(block_m=128, block_n=128, num_stages=3, num_warps=8, use_tma=True),
}
#: sglang's row-block signals, Triton kernel: a 64-row tile, one row-block per counter of the buffer
#: sglang sizes (ceil(T / 64) per expert). The Gluon kernel's 128-row tiles use the first
#: ceil(T / 128) of them; the combine reads the block_m the entry point returns either way.
_TUNED_ROW_BLOCKS: dict[int, GemmConfig] = {64: _TUNED[64]}
#: FP8 on sm_90: the warp-specialized kernel, whose loads never wait for the math, at every m.
#: Up to 64 rows the 64×256 tile: within 2 % of the best configuration and ahead of every Triton
#: tile, swap-AB included. Above, 128×192: each weight tile is read once, and 1.5× the outputs of
#: 128×128 per activation tile loaded (kernels/README.md, benchmarks/sweep_sbo_gemm.py).
_WS = WsConfig(block_m=64, block_n=256, num_stages=4)
_WS_TALL = WsConfig(block_m=128, block_n=192, num_stages=4)
_WS_TALL_ABOVE_ROWS = 64
#: Under a ``max_block_n`` below 192 (sglang passes 160 or 256), 128 columns: above 64 rows the
#: Gluon kernel's 128×128 tile, below it the Triton tables.
_WS_NARROW = WsConfig(block_m=128, block_n=128, num_stages=4)


def pick_config(
    expected_m: int, max_block_n: int = 256, signal_mode: int = SIGNAL_NONE, warp_specialized: bool = False
) -> GemmConfig | WsConfig:
    """The configuration for ``expected_m`` rows per expert and this signal layout, with
    ``block_n <= max_block_n``; with ``warp_specialized`` (FP8 on an sm_90 GPU with Gluon: see
    ``ws_usable``) the Gluon kernel's. The Triton kernel releases signals through the inline-PTX
    block: Triton's own atomic in the flattened loop costs 120 % (kernels/README.md)."""
    if warp_specialized and expected_m > _WS_TALL_ABOVE_ROWS:
        for tall in (_WS_TALL, _WS_NARROW):
            if tall.block_n <= max_block_n:
                return tall
    if warp_specialized and _WS.block_n <= max_block_n:
        return _WS
    table = _TUNED_ROW_BLOCKS if signal_mode == SIGNAL_SGLANG else _TUNED
    config = table[min((k for k in table if k >= expected_m), default=max(table))]
    if signal_mode != SIGNAL_NONE:
        config = dataclasses.replace(config, signal_asm=True)
    if config.block_n > max_block_n:
        block_n = 1 << (max_block_n.bit_length() - 1)  # largest power of two not above the cap
        config = dataclasses.replace(config, block_n=block_n)
    return config


@functools.cache
def ws_usable(device_index: int = 0) -> bool:
    """Whether the warp-specialized Gluon kernel can run here: an sm_90 GPU (wgmma, setmaxnreg),
    Triton with Gluon, and not Triton's CPU interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device_index)[0] != 9:
        return False
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return False
    return True


# %%
# The launcher
# ------------


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def masked_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    signal: torch.Tensor | None = None,
    signal_mode: int = SIGNAL_NONE,
    num_sms: int | None = None,
    config: GemmConfig | WsConfig | None = None,
    expected_m: int | None = None,
    max_block_n: int = 256,
) -> tuple[int, int]:
    """Launch the kernel; returns ``(block_m, threshold)`` for sglang's layout, or
    ``(num_programs, num_programs)`` for DeepEP's (the value each expert's counter reaches)."""
    fp8 = a.dtype == torch.float8_e4m3fn
    assert a.dim() == 3 and b.dim() == 3 and out.dim() == 3, "A, B and D must be [E, rows, cols]"
    E, M_max, K = a.shape
    _, N, _ = b.shape
    assert b.shape == (E, N, K), f"B must be [E={E}, N, K={K}], got {tuple(b.shape)}"
    assert out.shape == (E, M_max, N), f"D must be [E={E}, M_max={M_max}, N={N}], got {tuple(out.shape)}"
    assert out.dtype == torch.bfloat16, "D must be bf16"
    assert a.dtype == b.dtype, f"A and B must share a dtype, got {a.dtype} and {b.dtype}"
    assert fp8 or a.dtype == torch.bfloat16, f"A must be float8_e4m3fn or bfloat16, got {a.dtype}"
    assert a.stride(2) == 1 and b.stride(2) == 1, "A and B must be contiguous along K"
    assert K % SCALE_BLOCK == 0, f"K must be a multiple of {SCALE_BLOCK}, got {K}"
    assert masked_m.shape == (E,) and masked_m.dtype == torch.int32, "masked_m must be int32 [E]"
    if fp8:
        assert a_scale is not None and b_scale is not None, "FP8 inputs need a_scale and b_scale"
        assert a_scale.shape == (E, M_max, K // SCALE_BLOCK), (
            f"a_scale must be [E, M_max, K/128] = {(E, M_max, K // SCALE_BLOCK)}, got {tuple(a_scale.shape)}"
        )
        assert b_scale.shape == (E, triton.cdiv(N, SCALE_BLOCK), K // SCALE_BLOCK), (
            f"b_scale must be [E, ceil(N/128), K/128], got {tuple(b_scale.shape)}"
        )
        assert a_scale.dtype == b_scale.dtype == torch.float32, "scales must be float32"
    else:
        assert a_scale is None and b_scale is None, "bf16 inputs take no scales"
        a_scale = b_scale = out  # unused by the kernel; any tensor will do

    if config is None:
        ws = fp8 and ws_usable(a.device.index or 0)
        config = pick_config(expected_m or M_max, max_block_n, signal_mode, warp_specialized=ws)
    assert config.block_n <= max_block_n, f"block_n {config.block_n} exceeds max_block_n {max_block_n}"
    if num_sms is None:
        num_sms = _num_sms(a.device.index or 0)
        if signal_mode != SIGNAL_NONE:
            num_sms -= SMS_KEPT_FOR_COMMUNICATION
    assert num_sms >= 1, f"num_sms must be positive, got {num_sms}"

    num_m_blocks = triton.cdiv(M_max, config.block_m)
    threshold = triton.cdiv(N, config.block_n)
    if isinstance(config, GemmConfig) and config.signal_asm and signal_mode == SIGNAL_DEEPEP:
        assert 32 * config.num_warps >= E, f"inline-PTX DeepEP signals need E <= threads, got E={E}"
    if signal_mode == SIGNAL_SGLANG:
        assert signal is not None and signal.dtype == torch.int32, "sglang's signal must be int32"
        assert signal.numel() >= E * num_m_blocks, (
            f"signal needs E*ceil(M_max/block_m) = {E * num_m_blocks} counters, has {signal.numel()}"
        )
    elif signal_mode == SIGNAL_DEEPEP:
        assert signal is not None and signal.dtype in (torch.int32, torch.uint32), "DeepEP's signal is uint32"
        assert signal.numel() >= E, f"signal needs E = {E} counters, has {signal.numel()}"
        signal = signal.view(torch.int32)  # same bits; Triton's atomics want a signed type
    else:
        signal = masked_m  # unused by the kernel

    if isinstance(config, WsConfig):
        assert fp8 and a_scale is not None and b_scale is not None, "the warp-specialized kernel is FP8 only"
        from .signal_gemm_ws import launch  # Gluon: imported only where it runs

        launch(a, b, out, masked_m, a_scale, b_scale, signal, signal_mode, num_sms, config, expected_m or M_max)
        return (num_sms, num_sms) if signal_mode == SIGNAL_DEEPEP else (config.block_m, threshold)

    # Triton's CPU interpreter cannot do pointer arithmetic on FP8 pointers; hand it the bytes.
    fp8_as_bytes = fp8 and os.environ.get("TRITON_INTERPRET") == "1"
    if fp8_as_bytes:
        a, b = a.view(torch.uint8), b.view(torch.uint8)

    if config.use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        assert a.is_contiguous() and b.is_contiguous(), "TMA needs contiguous A and B"
        a_arg = TensorDescriptor.from_tensor(a.view(E * M_max, K), [config.block_m, config.block_k])
        b_arg = TensorDescriptor.from_tensor(b.view(E * N, K), [config.block_n, config.block_k])
    else:
        a_arg, b_arg = a, b

    _masked_grouped_gemm_kernel[(num_sms,)](
        a_arg,
        a_scale,
        b_arg,
        b_scale,
        out,
        masked_m,
        signal,
        E,
        M_max,
        N,
        K,
        a.stride(0),
        a.stride(1),
        a.stride(2),
        a_scale.stride(0),
        a_scale.stride(1),
        a_scale.stride(2),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        b_scale.stride(0),
        b_scale.stride(1),
        b_scale.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        FP8=fp8,
        SIGNAL_MODE=signal_mode,
        SWAP_AB=config.swap_ab,
        USE_TMA=config.use_tma,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SCALE_BLOCK=SCALE_BLOCK,
        NUM_STAGES=config.num_stages,
        FLATTEN=config.flatten,
        SIGNAL_ASM=config.signal_asm and not fp8_as_bytes,
        E_POW2=triton.next_power_of_2(E),
        FP8_AS_BYTES=fp8_as_bytes,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if signal_mode == SIGNAL_DEEPEP:
        return num_sms, num_sms
    return config.block_m, threshold


# %%
# DeepGEMM-compatible entry points
# --------------------------------


def _signal_mode(enable_overlap: bool, signal: torch.Tensor | None, signal_layout: str) -> int:
    """The kernel's SIGNAL_MODE for the entry points' (enable_overlap, signal, signal_layout)."""
    assert signal_layout in ("sglang", "deepep"), f"signal_layout must be sglang or deepep, got {signal_layout!r}"
    if not enable_overlap:
        return SIGNAL_NONE
    assert signal is not None, "enable_overlap needs a signal tensor"
    return SIGNAL_SGLANG if signal_layout == "sglang" else SIGNAL_DEEPEP


def _run_entry(
    lhs: tuple[torch.Tensor, torch.Tensor | None],
    rhs: tuple[torch.Tensor, torch.Tensor | None],
    out: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    max_block_n: int,
    overlap: tuple[bool, torch.Tensor | None, str],
    num_sms: int | None,
    config: GemmConfig | WsConfig | None,
) -> tuple[int | None, int | None]:
    """What both entry points do with their DeepGEMM arguments: ``lhs``/``rhs`` are (tensor, scales or
    None), ``overlap`` is (enable_overlap, signal, signal_layout). Launches, and returns DeepGEMM's pair."""
    (a, a_scale), (b, b_scale) = lhs, rhs
    enable_overlap, signal, signal_layout = overlap
    mode = _signal_mode(enable_overlap, signal, signal_layout)
    result = masked_grouped_gemm(
        a,
        b,
        out,
        masked_m,
        a_scale=a_scale,
        b_scale=b_scale,
        signal=signal,
        signal_mode=mode,
        num_sms=num_sms,
        config=config,
        expected_m=expected_m,
        max_block_n=max_block_n,
    )
    return result if enable_overlap else (None, None)


def fp8_m_grouped_gemm_nt_masked(
    lhs: tuple[torch.Tensor, torch.Tensor],
    rhs: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    recipe: tuple[int, int, int] | None = None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    max_block_n: int = 256,
    enable_overlap: bool = False,
    signal: torch.Tensor | None = None,
    *,
    signal_layout: str = "sglang",
    num_sms: int | None = None,
    config: GemmConfig | WsConfig | None = None,
) -> tuple[int | None, int | None]:
    """Drop-in for ``deep_gemm.fp8_m_grouped_gemm_nt_masked`` as sglang calls it on sm_90.

    ``lhs = (a, a_scale)``, ``rhs = (b, b_scale)``. With ``enable_overlap`` the kernel signals in
    ``signal`` and returns ``(block_m, threshold)`` (``signal_layout="sglang"``) or
    ``(num_programs, num_programs)`` (``signal_layout="deepep"``: each expert's counter reaches
    ``num_programs``); without it returns ``(None, None)`` like DeepGEMM.
    """
    assert recipe in (None, (1, 128, 128)), f"only DeepSeek's (1, 128, 128) recipe, got {recipe}"
    del compiled_dims, disable_ue8m0_cast  # DeepGEMM JIT knobs with no meaning here
    assert lhs[0].dtype == torch.float8_e4m3fn, f"lhs must be float8_e4m3fn, got {lhs[0].dtype}"
    overlap = (enable_overlap, signal, signal_layout)
    return _run_entry(lhs, rhs, out, masked_m, expected_m, max_block_n, overlap, num_sms, config)


def bf16_m_grouped_gemm_nt_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    compiled_dims: str = "nk",
    max_block_n: int = 256,
    enable_overlap: bool = False,
    signal: torch.Tensor | None = None,
    *,
    signal_layout: str = "sglang",
    num_sms: int | None = None,
    config: GemmConfig | None = None,
) -> tuple[int | None, int | None]:
    """The bf16-input variant, with the same signals as the FP8 entry point."""
    del compiled_dims
    overlap = (enable_overlap, signal, signal_layout)
    return _run_entry((a, None), (b, None), out, masked_m, expected_m, max_block_n, overlap, num_sms, config)


# %%
# Torch references
# ----------------


def reference_masked_grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    masked_m: torch.Tensor,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``D[e, :m_e] = dequant(A)[e, :m_e] @ dequant(B)[e].T`` in ``dtype``; rows past ``m_e`` are 0."""
    _, M_max, K = a.shape
    N = b.shape[1]
    a_f = a.to(dtype)
    b_f = b.to(dtype)
    if (a_scale is None) != (b_scale is None):
        raise ValueError("a_scale and b_scale come together (FP8 operands) or not at all (bf16).")
    if a_scale is not None and b_scale is not None:
        a_f = a_f * a_scale.to(dtype).repeat_interleave(SCALE_BLOCK, dim=2)[:, :, :K]
        b_s = b_scale.to(dtype).repeat_interleave(SCALE_BLOCK, dim=1).repeat_interleave(SCALE_BLOCK, dim=2)
        b_f = b_f * b_s[:, :N, :K]
    rows = torch.arange(M_max, device=a.device)[None, :] < masked_m.to(a.device)[:, None]
    a_f = torch.where(rows[:, :, None], a_f, torch.zeros((), dtype=dtype, device=a.device))
    return torch.bmm(a_f, b_f.transpose(1, 2))


def reference_sglang_signal(masked_m: torch.Tensor, M_max: int, N: int, block_m: int, block_n: int) -> torch.Tensor:
    """Final sglang-layout counters: ``ceil(N/block_n)`` for row-blocks holding tokens, else 0."""
    num_m_blocks = triton.cdiv(M_max, block_m)
    active = torch.arange(num_m_blocks)[None, :] * block_m < masked_m.cpu().clamp(max=M_max)[:, None]
    return (active.to(torch.int32) * triton.cdiv(N, block_n)).flatten()


def reference_deepep_signal(E: int, num_programs: int) -> torch.Tensor:
    """Final DeepEP-layout counters: every program counts itself in once per expert."""
    return torch.full((E,), num_programs, dtype=torch.int32)
