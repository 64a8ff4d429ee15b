"""
The signal down GEMM, warp-specialized, in Gluon: a producer warp for the loads, consumer warps for the math
=============================================================================================================

``signal_gemm.py`` computes the same thing in Triton. There, every warp waits for its K step's
wgmma, scales the partial product, and only then issues the TMA load that refills the stage, so
the fixed cost of a step delays the weight stream (kernels/README.md measured it: 0.78–1.01× of
DeepGEMM at 32–128 rows per expert). Triton 3.6 cannot split that loop across warps on sm_90, but
Gluon (``triton.experimental.gluon``, shipped with Triton 3.6) can:

* the **producer** partition (one warp, few registers) walks the program's tiles and issues the
  TMA loads of A and B into a ring of ``NUM_STAGES`` shared-memory stages, each guarded by a
  ``ready`` and an ``empty`` mbarrier;
* the **consumer** partition (the kernel's 8 warps, two warpgroups) waits on ``ready``, runs the
  wgmma, hands the stage back on ``empty`` as soon as the wgmma is done (before the scaling), and
  applies the FP8 scales, stores the tile and releases its signal.

The loads therefore run ``NUM_STAGES`` steps ahead of the math whatever the math costs. Same
arguments, tile order, scale recipe and signal layouts as the Triton kernel (FP8 only, no swap-AB);
``signal_gemm.masked_grouped_gemm`` launches it when its config is a ``WsConfig``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .signal_gemm import SCALE_BLOCK, WsConfig

__all__ = ["launch"]

_SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)  # the kernels read module constants only as constexprs
# Gluon is experimental and renames things: Triton 3.6's `thread_barrier` is 3.8's `barrier`.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


# %%
# The tile list
# -------------
# Both partitions walk the same tiles, g = pid, pid + W, ... (W workers, see _first_tile): tile g
# lies in the first expert whose running tile count exceeds g; inside an expert, the row-blocks
# of one column-block are adjacent (their weight tile is read once from HBM and once more from
# L2). Each partition keeps a cursor (expert, tiles before it) that only moves forward, so
# finding a tile costs a few scalar loads of masked_m.


@gluon.jit
def _expert_tiles(masked_m_ptr, e, M_MAX, num_n_blocks, BLOCK_M: gl.constexpr):
    """Expert e's tile count and rows (masked_m clamped to M_MAX)."""
    rows = gl.minimum(gl.load(masked_m_ptr + e), M_MAX)
    return gl.cdiv(rows, BLOCK_M) * num_n_blocks, rows


@gluon.jit
def _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M: gl.constexpr):
    """All experts' tiles: the length of the tile list."""
    total = 0
    for e in range(E):
        tiles, _ = _expert_tiles(masked_m_ptr, e, M_MAX, num_n_blocks, BLOCK_M)
        total += tiles
    return total


@gluon.jit
def _advance(g, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M: gl.constexpr):
    """Move the cursor (e, tiles before e, tiles of e, rows of e) to the expert holding tile g."""
    while g >= before_e + tiles_e:
        before_e += tiles_e
        e += 1
        tiles_e, rows_e = _expert_tiles(masked_m_ptr, e, M_MAX, num_n_blocks, BLOCK_M)
    return e, before_e, tiles_e, rows_e


@gluon.jit
def _first_tile(num_tiles, num_workers):
    """This program's first tile. Programs at or past ``num_workers`` get none: the launcher may
    ask for fewer workers than programs so that the tiles split evenly (each worker then has the
    same count), while DeepEP's expected value stays the number of programs."""
    pid = gl.program_id(0)
    return gl.where(pid < num_workers, pid, num_tiles)


@gluon.jit
def _row_and_column_block(t, rows_e, BLOCK_M: gl.constexpr):
    """Row-block and column-block of an expert's tile t (its row-blocks of a column are adjacent)."""
    m_blocks = gl.cdiv(rows_e, BLOCK_M)
    return t % m_blocks, t // m_blocks


# %%
# The producer: TMA loads into the ring
# -------------------------------------


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, masked_m_ptr, E, M_MAX, N, K, num_workers):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    num_n_blocks = gl.cdiv(N, BLOCK_N)
    num_tiles = _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M)
    first = _first_tile(num_tiles, num_workers)
    e = 0
    before_e = 0
    tiles_e, rows_e = _expert_tiles(masked_m_ptr, 0, M_MAX, num_n_blocks, BLOCK_M)
    step = 0  # K steps issued so far: the ring slot is step % NUM_STAGES
    for g in range(first, num_tiles, num_workers):
        e, before_e, tiles_e, rows_e = _advance(
            g, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
        )
        mb, nb = _row_and_column_block(g - before_e, rows_e, BLOCK_M)
        for k in range(0, K, BLOCK_K):
            slot = step % NUM_STAGES
            # mbarriers start in phase 1 complete: the first pass over the ring does not wait.
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                a_desc, [e * M_MAX + mb * BLOCK_M, k], ready.index(slot), a_bufs.index(slot)
            )
            tma.async_copy_global_to_shared(b_desc, [e * N + nb * BLOCK_N, k], ready.index(slot), b_bufs.index(slot))
            step += 1


# %%
# The consumer: wgmma, scales, stores, signals
# --------------------------------------------


@gluon.jit
def _consumer(
    a_bufs, b_bufs, ready, empty,
    a_scale_ptr, b_scale_ptr, d_ptr, masked_m_ptr, signal_ptr,
    E, M_MAX, N, K, num_workers,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_de, stride_dm,
    SIGNAL_MODE: gl.constexpr, E_POW2: gl.constexpr, MMA_LAYOUT: gl.constexpr, STORE_LAYOUT: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    gl.static_assert(BLOCK_K == _SCALE_BLOCK, "one scale pair per K step")
    gl.static_assert(BLOCK_N <= 2 * _SCALE_BLOCK, "at most two weight-scale blocks per tile")
    num_n_blocks = gl.cdiv(N, BLOCK_N)
    num_tiles = _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M)
    first = _first_tile(num_tiles, num_workers)
    num_m_blocks_max = gl.cdiv(M_MAX, BLOCK_M)
    last_scale_block = gl.cdiv(N, _SCALE_BLOCK) - 1

    rows_in_tile = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA_LAYOUT))
    cols_in_tile = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA_LAYOUT))
    store_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, STORE_LAYOUT))
    store_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE_LAYOUT))
    experts_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    experts = gl.arange(0, E_POW2, layout=experts_layout)
    ones = gl.full([E_POW2], 1, gl.int32, experts_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA_LAYOUT)

    e = 0
    before_e = 0
    tiles_e, rows_e = _expert_tiles(masked_m_ptr, 0, M_MAX, num_n_blocks, BLOCK_M)
    if SIGNAL_MODE == 2:
        # DeepEP layout: experts before this program's first tile (all, if it has none) are done.
        first_e = E
        if first < num_tiles:
            first_e, _, _, _ = _advance(first, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M)
        gl.atomic_add(signal_ptr + experts, ones, mask=experts < first_e, sem="release", scope="gpu")
    step = 0
    for g in range(first, num_tiles, num_workers):
        e, before_e, tiles_e, rows_e = _advance(
            g, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
        )
        mb, nb = _row_and_column_block(g - before_e, rows_e, BLOCK_M)
        row_ok = mb * BLOCK_M + rows_in_tile < rows_e
        sa_ptrs = a_scale_ptr + e * stride_ase + (mb * BLOCK_M + rows_in_tile) * stride_asm
        sb_row = b_scale_ptr + e * stride_bse + gl.minimum(nb * BLOCK_N // _SCALE_BLOCK, last_scale_block) * stride_bsn
        sb_row_hi = (
            b_scale_ptr + e * stride_bse + gl.minimum(nb * BLOCK_N // _SCALE_BLOCK + 1, last_scale_block) * stride_bsn
        )
        acc = zero
        for k in range(0, K, BLOCK_K):
            slot = step % NUM_STAGES
            ks = k // _SCALE_BLOCK
            # The scales' loads go out first, to be in flight while the tensor cores work.
            sa = gl.load(sa_ptrs + ks * stride_ask, mask=row_ok, other=0.0)
            sb = gl.load(sb_row + ks * stride_bsk)
            if BLOCK_N > _SCALE_BLOCK:
                sb_cols = gl.where(cols_in_tile < _SCALE_BLOCK, sb, gl.load(sb_row_hi + ks * stride_bsk))
            mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
            a_tile = a_bufs.index(slot)
            b_tile = b_bufs.index(slot)
            partial = warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)
            partial, a_tile, b_tile = warpgroup_mma_wait(num_outstanding=0, deps=(partial, a_tile, b_tile))
            mbarrier.arrive(empty.index(slot), count=1)  # the stage is free: the producer refills it
            if BLOCK_N > _SCALE_BLOCK:
                acc += partial * gl.expand_dims(sa, 1) * gl.expand_dims(sb_cols, 0)
            else:
                acc += partial * gl.expand_dims(sa * sb, 1)
            step += 1

        out = gl.convert_layout(acc.to(gl.bfloat16), STORE_LAYOUT)  # 16-byte stores per thread
        rows = mb * BLOCK_M + store_rows
        cols = nb * BLOCK_N + store_cols
        d_ptrs = d_ptr + e * stride_de + gl.expand_dims(rows, 1) * stride_dm + gl.expand_dims(cols, 0)
        gl.store(d_ptrs, out, mask=gl.expand_dims(rows < rows_e, 1) & gl.expand_dims(cols < N, 0))
        if SIGNAL_MODE != 0:
            _barrier()  # every consumer thread's stores of the tile come before the release
        if SIGNAL_MODE == 1:
            gl.atomic_add(signal_ptr + e * num_m_blocks_max + mb, 1, sem="release", scope="gpu")
        if SIGNAL_MODE == 2:
            next_e = E
            if g + num_workers < num_tiles:
                next_e, _, _, _ = _advance(
                    g + num_workers, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
                )
            gl.atomic_add(
                signal_ptr + experts, ones, mask=(experts >= e) & (experts < next_e), sem="release", scope="gpu"
            )


@gluon.jit
def _masked_grouped_gemm_ws_kernel(
    a_desc, b_desc, a_scale_ptr, b_scale_ptr, d_ptr, masked_m_ptr, signal_ptr,
    E, M_MAX, N, K, num_workers,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_de, stride_dm,
    SIGNAL_MODE: gl.constexpr, NUM_STAGES: gl.constexpr, E_POW2: gl.constexpr,
    MMA_LAYOUT: gl.constexpr, STORE_LAYOUT: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):  # fmt: skip
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)  # noqa: RUF005 (jit AST)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)  # noqa: RUF005
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _consumer,
                (
                    a_bufs, b_bufs, ready, empty, a_scale_ptr, b_scale_ptr, d_ptr, masked_m_ptr, signal_ptr,
                    E, M_MAX, N, K, num_workers,
                    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_de, stride_dm,
                    SIGNAL_MODE, E_POW2, MMA_LAYOUT, STORE_LAYOUT,
                ),
            ),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, masked_m_ptr, E, M_MAX, N, K, num_workers)),
        ],
        [1],
        [PRODUCER_REGS],
    )  # fmt: skip


# %%
# The launcher
# ------------


def _layouts(config: WsConfig) -> tuple:
    """The accumulator's wgmma layout and the store layout, for 8 consumer warps (two warpgroups):
    one warpgroup per 64 rows for 128-row tiles, else one per half of the columns."""
    warps = [8, 1] if config.block_m == 128 else [4, 2]
    instr_shape = [16, config.block_n // warps[1], 32]  # m16 × (columns per warpgroup) × k32 for FP8
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=instr_shape)
    store = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 8 bf16 = 16 bytes per thread
    return mma, store


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    masked_m: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    signal: torch.Tensor,
    signal_mode: int,
    num_programs: int,
    config: WsConfig,
    expected_m: int,
) -> None:
    """Launch on arguments ``signal_gemm.masked_grouped_gemm`` has checked (``signal`` as int32;
    ``masked_m`` itself when there are no signals). With ``expected_m`` rows per expert the tiles
    are split over the fewest programs that leave none a tile more than the others (448 tiles on
    129 programs: 112 workers of 4 tiles; measured 1–2 % faster at E = 16, kernels/README.md)."""
    E, M_max, K = a.shape
    N = b.shape[1]
    assert a.is_contiguous() and b.is_contiguous(), "TMA needs contiguous A and B"
    assert out.stride(2) == 1, "D must be contiguous along N"
    a_layout = gl.NVMMASharedLayout.get_default_for([config.block_m, SCALE_BLOCK], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([config.block_n, SCALE_BLOCK], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a.view(E * M_max, K), [config.block_m, SCALE_BLOCK], a_layout)
    b_desc = TensorDescriptor.from_tensor(b.view(E * N, K), [config.block_n, SCALE_BLOCK], b_layout)
    mma_layout, store_layout = _layouts(config)
    tiles = E * triton.cdiv(min(expected_m, M_max), config.block_m) * triton.cdiv(N, config.block_n)
    num_workers = triton.cdiv(tiles, triton.cdiv(tiles, num_programs)) if tiles else num_programs
    _masked_grouped_gemm_ws_kernel[(num_programs,)](
        a_desc, b_desc, a_scale, b_scale, out, masked_m, signal,
        E, M_max, N, K, num_workers,
        a_scale.stride(0), a_scale.stride(1), a_scale.stride(2),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out.stride(0), out.stride(1),
        SIGNAL_MODE=signal_mode, NUM_STAGES=config.num_stages, E_POW2=triton.next_power_of_2(E),
        MMA_LAYOUT=mma_layout, STORE_LAYOUT=store_layout, PRODUCER_REGS=config.producer_regs,
        num_warps=8,
    )  # fmt: skip
