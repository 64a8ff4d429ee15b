"""
The signal down GEMM, warp-specialized, in Gluon: a producer warp for the loads, math partitions, storer warps
=============================================================================================================

``signal_gemm.py`` computes the same thing in Triton. There, every warp waits for its K step's
wgmma, scales the partial product, and only then issues the TMA load that refills the stage, so
the fixed cost of a step delays the weight stream. Triton 3.6 cannot split that loop across warps
on sm_90, but Gluon (``triton.experimental.gluon``, shipped with Triton 3.6) can:

* the **producer** (one warp) walks the program's tiles and fills a ring of ``NUM_STAGES``
  shared-memory stages, each guarded by a ``ready`` and an ``empty`` mbarrier: the TMA loads of A
  and B, and the K step's FP8 scales (activation × weight, per row);
* the **math** (two partitions of one warpgroup each, a half tile each) waits on ``ready``, runs
  the wgmma, hands the stage back on ``empty`` as soon as the wgmma is done, applies the scales,
  and leaves its half of the finished tile in shared memory;
* the **storer** (two warps) copies each finished tile out to D, only the rows below
  ``masked_m``, and releases its completion signal, so neither the global stores nor the
  GPU-scope release stall a math warp.

The loads therefore run ``NUM_STAGES`` steps ahead of the math whatever the math costs, the math
warps issue no global memory access at all, and the tensor cores start the next tile while the
last one is written. Same arguments, tile order, scale recipe and signal layouts as the Triton
kernel (FP8 only, no swap-AB); ``signal_gemm.masked_grouped_gemm`` launches it when its config is
a ``WsConfig``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .configs import SCALE_BLOCK, WsConfig

__all__ = ["launch"]

_SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)  # the kernels read module constants only as constexprs
_PIECE_ROWS = gl.constexpr(64)  # a math warpgroup's rows: wgmma's M
_PIECE_COLS = gl.constexpr(SCALE_BLOCK)  # and columns: one weight-scale block, so one scale a row
# Gluon is experimental and renames things: Triton 3.6's `thread_barrier` is 3.8's `barrier`.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _fence_for_tma_readers():
    """fence.proxy.async.global: this thread's generic stores before any later async-proxy (TMA)
    read. DeepEP's combine reads our rows by TMA once it sees the release (signal_gemm.py)."""
    gl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


# %%
# The tile list
# -------------
# Every partition walks the same tiles, g = pid, pid + W, ... (W workers, see _first_tile): tile g
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


@gluon.jit
def _part_columns(nb, WIDE: gl.constexpr, NARROW: gl.constexpr):
    """First columns of column-block nb's wide part (WIDE columns) and narrow part (NARROW = 64
    columns, 192-wide tiles only). Every 128-column piece a math partition owns must lie inside one
    128-wide weight-scale block, so that a row has one scale per piece: a 192-wide tile starts on a
    block boundary when nb is even (wide part first) and 64 columns into a block when nb is odd
    (narrow part first)."""
    col0 = nb * (WIDE + NARROW)
    wide = col0
    narrow = col0
    if NARROW > 0:
        gl.static_assert(WIDE == _SCALE_BLOCK and NARROW == _SCALE_BLOCK // 2, "the split is 128 + 64 columns")
        odd = nb % 2
        wide = col0 + NARROW * odd
        narrow = col0 + WIDE * (1 - odd)
    return wide, narrow


# %%
# The producer: TMA loads and scales into the ring
# ------------------------------------------------
# A stage holds a K step of the tile's A and B (TMA) and its scales: for each row and each of the
# tile's 128-wide weight-scale blocks, activation scale × weight scale. The producer loads those
# with plain loads and stores them into the stage a step later, when they have long arrived, so
# the math reads its scales from shared memory and never waits on a global load. (Loaded in the
# math warps, a scale whose load ptxas placed inside the wgmma issue held the tensor cores up for
# an L2 round trip: 8 % in one build, kernels/README.md.)


@gluon.jit
def _scale_row(slot, block, chunk, SCALE_BLOCKS: gl.constexpr, ROW_CHUNKS: gl.constexpr):
    """The row of ``scales`` that holds stage slot's 64-row chunk of weight-scale block ``block``."""
    return (slot * SCALE_BLOCKS + block) * ROW_CHUNKS + chunk


@gluon.jit
def _load_scales(
    a_scale_ptr, b_scale_ptr, e, row0, rows_e, block_lo, block_hi, ks, last_scale_block,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    ROW_CHUNKS: gl.constexpr, SCALE_BLOCKS: gl.constexpr, ROWS: gl.constexpr,
):  # fmt: skip
    """K step ks's activation scales of the tile's first and last 64 rows (0 past the expert's
    rows) and the weight scales of its weight-scale blocks ``block_lo`` and ``block_hi`` (the same
    ones again for a 64-row tile or a 128-column one)."""
    rows = row0 + gl.arange(0, _PIECE_ROWS, layout=ROWS)
    sa_ptrs = a_scale_ptr + e * stride_ase + rows * stride_asm + ks * stride_ask
    sa_first = gl.load(sa_ptrs, mask=rows < rows_e, other=0.0)
    sa_last = sa_first
    if ROW_CHUNKS > 1:
        sa_last = gl.load(sa_ptrs + _PIECE_ROWS * stride_asm, mask=rows + _PIECE_ROWS < rows_e, other=0.0)
    sb_row = b_scale_ptr + e * stride_bse + ks * stride_bsk
    scale_lo = gl.load(sb_row + gl.minimum(block_lo, last_scale_block) * stride_bsn)
    scale_hi = scale_lo
    if SCALE_BLOCKS > 1:
        scale_hi = gl.load(sb_row + gl.minimum(block_hi, last_scale_block) * stride_bsn)
    return sa_first, sa_last, scale_lo, scale_hi


@gluon.jit
def _store_scales(
    scales, slot, sa_first, sa_last, scale_lo, scale_hi, ROW_CHUNKS: gl.constexpr, SCALE_BLOCKS: gl.constexpr
):
    """Stage slot's scales: activation scale × weight scale per row chunk and weight-scale block."""
    scales.index(_scale_row(slot, 0, 0, SCALE_BLOCKS, ROW_CHUNKS)).store(sa_first * scale_lo)
    if SCALE_BLOCKS > 1:
        scales.index(_scale_row(slot, 1, 0, SCALE_BLOCKS, ROW_CHUNKS)).store(sa_first * scale_hi)
    if ROW_CHUNKS > 1:
        scales.index(_scale_row(slot, 0, 1, SCALE_BLOCKS, ROW_CHUNKS)).store(sa_last * scale_lo)
        if SCALE_BLOCKS > 1:
            scales.index(_scale_row(slot, 1, 1, SCALE_BLOCKS, ROW_CHUNKS)).store(sa_last * scale_hi)


@gluon.jit
def _producer(
    a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, scales, ready, empty,
    a_scale_ptr, b_scale_ptr, masked_m_ptr, E, M_MAX, N, K, num_workers,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    NARROW: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    WIDE: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = WIDE + NARROW
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW_CHUNKS: gl.constexpr = BLOCK_M // _PIECE_ROWS
    SCALE_BLOCKS: gl.constexpr = (BLOCK_N + _SCALE_BLOCK - 1) // _SCALE_BLOCK  # weight-scale blocks a tile touches
    A_BYTES: gl.constexpr = a_desc.block_type.nbytes
    WIDE_BYTES: gl.constexpr = b_desc.block_type.nbytes
    NARROW_BYTES: gl.constexpr = b2_desc.block_type.nbytes
    ROWS: gl.constexpr = gl.BlockedLayout([_PIECE_ROWS // 32], [32], [1], [0])  # the producer is one warp
    gl.static_assert(BLOCK_K == _SCALE_BLOCK, "one scale per row and weight block per K step")
    num_n_blocks = gl.cdiv(N, BLOCK_N)
    num_tiles = _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M)
    first = _first_tile(num_tiles, num_workers)
    last_scale_block = gl.cdiv(N, _SCALE_BLOCK) - 1
    e = 0
    before_e = 0
    tiles_e, rows_e = _expert_tiles(masked_m_ptr, 0, M_MAX, num_n_blocks, BLOCK_M)
    sa_first = gl.zeros([_PIECE_ROWS], gl.float32, ROWS)
    sa_last = sa_first
    scale_lo = 0.0
    scale_hi = 0.0
    step = 0  # K steps issued so far: the ring slot is step % NUM_STAGES
    for g in range(first, num_tiles, num_workers):
        e, before_e, tiles_e, rows_e = _advance(
            g, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
        )
        mb, nb = _row_and_column_block(g - before_e, rows_e, BLOCK_M)
        wide_col, narrow_col = _part_columns(nb, WIDE, NARROW)
        block_lo = wide_col // _SCALE_BLOCK
        block_hi = block_lo + 1  # a 256-wide tile's second half
        if NARROW > 0:
            block_hi = narrow_col // _SCALE_BLOCK
        for k in range(0, K, BLOCK_K):
            slot = step % NUM_STAGES
            if step > 0:  # the previous step's scales, loaded an iteration ago
                previous = (step - 1) % NUM_STAGES
                _store_scales(scales, previous, sa_first, sa_last, scale_lo, scale_hi, ROW_CHUNKS, SCALE_BLOCKS)
                _barrier()  # every lane's stores before the elected arrive (a CTA-scope release)
                mbarrier.arrive(ready.index(previous), count=1)
            sa_first, sa_last, scale_lo, scale_hi = _load_scales(
                a_scale_ptr, b_scale_ptr, e, mb * BLOCK_M, rows_e, block_lo, block_hi,
                k // _SCALE_BLOCK, last_scale_block,
                stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
                ROW_CHUNKS, SCALE_BLOCKS, ROWS,
            )  # fmt: skip
            # mbarriers start in phase 1 complete: the first pass over the ring does not wait.
            mbarrier.wait(empty.index(slot), ((step // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            if NARROW == 0:
                mbarrier.expect(bar, A_BYTES + WIDE_BYTES)
                tma.async_copy_global_to_shared(b_desc, [e * N + wide_col, k], bar, b_bufs.index(slot))
            else:
                # A 192-wide tile's part past N is not loaded (it would read the next expert's
                # weights, 1.7 % more bytes at N = 7168); the math runs the wgmma on whatever the
                # buffer holds and never stores those columns. Exactly one expect arrives.
                wide_in = wide_col < N
                narrow_in = narrow_col < N
                mbarrier.expect(bar, A_BYTES + WIDE_BYTES + NARROW_BYTES, pred=wide_in & narrow_in)
                mbarrier.expect(bar, A_BYTES + NARROW_BYTES, pred=wide_col >= N)
                mbarrier.expect(bar, A_BYTES + WIDE_BYTES, pred=narrow_col >= N)
                tma.async_copy_global_to_shared(b_desc, [e * N + wide_col, k], bar, b_bufs.index(slot), pred=wide_in)
                tma.async_copy_global_to_shared(
                    b2_desc, [e * N + narrow_col, k], bar, b2_bufs.index(slot), pred=narrow_in
                )
            tma.async_copy_global_to_shared(a_desc, [e * M_MAX + mb * BLOCK_M, k], bar, a_bufs.index(slot))
            step += 1
    if step > 0:
        last = (step - 1) % NUM_STAGES
        _store_scales(scales, last, sa_first, sa_last, scale_lo, scale_hi, ROW_CHUNKS, SCALE_BLOCKS)
        _barrier()
        mbarrier.arrive(ready.index(last), count=1)


# %%
# The math: wgmma and scales
# --------------------------
# Each of the two math partitions (a warpgroup each) owns a 64×128 piece of every tile: the rows
# ROW0.. of a 128×128 tile, or the columns COL0.. of a 64×256 one, so a piece lies in one 128-wide
# weight-scale block and its scale is one number per row. Of a 128×192 tile a partition owns 64
# rows: a 64×128 piece and a 64×64 one (see _part_columns), each with its own wgmma and scale.
# The partitions have barriers over their own 128 threads only, so they run out of phase: while
# one scales its product, the tensor cores run the other's wgmma. (One 8-warp partition over the
# 64×256 tile, both warpgroups in lockstep, measured from 1.5 % faster to 10 % slower, the latter
# at 128 rows; kernels/README.md.) Each K step's product is scaled into a float32 accumulator in
# the registers: the tensor cores keep only about 14 bits when they add FP8 products, so letting
# them accumulate across K steps loses accuracy (measured: 3.5e-2 relative error on all-positive
# data against 1.9e-3, kernels/README.md).


@gluon.jit
def _piece_scales(scales, slot, ROW0: gl.constexpr, BLOCK: gl.constexpr, ROW_CHUNKS: gl.constexpr,
                  SCALE_BLOCKS: gl.constexpr, ROWS: gl.constexpr):  # fmt: skip
    """The rows' scales (activation × weight) of the piece at ROW0 in the tile's weight-scale
    block BLOCK (0 or 1), in stage ``slot``."""
    row = _scale_row(slot, BLOCK, ROW0 // _PIECE_ROWS, SCALE_BLOCKS, ROW_CHUNKS)
    return scales.index(row).load(ROWS)


@gluon.jit
def _math(
    a_bufs, b_bufs, b2_bufs, scales, out_wide, out_narrow, ready, empty, tile_done, tile_free, masked_m_ptr,
    E, M_MAX, N, K, num_workers,
    ROW0: gl.constexpr, COL0: gl.constexpr, NARROW: gl.constexpr,
    MMA_LAYOUT: gl.constexpr, NARROW_MMA_LAYOUT: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    WIDE: gl.constexpr = b_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = WIDE + NARROW
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    NUM_STAGES: gl.constexpr = a_bufs.type.shape[0]
    ROW_CHUNKS: gl.constexpr = BLOCK_M // _PIECE_ROWS
    SCALE_BLOCKS: gl.constexpr = (BLOCK_N + _SCALE_BLOCK - 1) // _SCALE_BLOCK
    ROWS: gl.constexpr = gl.SliceLayout(1, MMA_LAYOUT)
    num_n_blocks = gl.cdiv(N, BLOCK_N)
    num_tiles = _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M)
    first = _first_tile(num_tiles, num_workers)

    PIECE: gl.constexpr = ROW0 // _PIECE_ROWS + COL0 // _PIECE_COLS  # this partition's index, 0 or 1
    zero = gl.zeros([_PIECE_ROWS, _PIECE_COLS], gl.float32, MMA_LAYOUT)
    if NARROW > 0:  # a 192-wide tile's 64-column part: its own wgmma and accumulator
        zero_narrow = gl.zeros([_PIECE_ROWS, NARROW], gl.float32, NARROW_MMA_LAYOUT)
        narrow_rows: gl.constexpr = gl.SliceLayout(1, NARROW_MMA_LAYOUT)

    # Where a tile lies is the producer's and the storer's business: the math only counts them.
    step = 0  # K steps done: the ring slot is step % NUM_STAGES
    done = 0  # tiles done: the phase of tile_done and tile_free
    for _g in range(first, num_tiles, num_workers):
        acc = zero
        if NARROW > 0:
            acc_narrow = zero_narrow
        for _k in range(0, K, BLOCK_K):
            slot = step % NUM_STAGES
            mbarrier.wait(ready.index(slot), (step // NUM_STAGES) & 1)
            scale = _piece_scales(scales, slot, ROW0, COL0 // _SCALE_BLOCK, ROW_CHUNKS, SCALE_BLOCKS, ROWS)
            a_piece = a_bufs.index(slot).slice(ROW0, _PIECE_ROWS)
            b_piece = b_bufs.index(slot).slice(COL0, _PIECE_COLS)
            part = warpgroup_mma(a_piece, b_piece.permute((1, 0)), zero, use_acc=False, is_async=True)
            if NARROW > 0:
                scale_narrow = _piece_scales(scales, slot, ROW0, 1, ROW_CHUNKS, SCALE_BLOCKS, narrow_rows)
                b_narrow = b2_bufs.index(slot)
                part_narrow = warpgroup_mma(
                    a_piece, b_narrow.permute((1, 0)), zero_narrow, use_acc=False, is_async=True
                )
                part, part_narrow, a_piece, b_piece, b_narrow = warpgroup_mma_wait(
                    num_outstanding=0, deps=(part, part_narrow, a_piece, b_piece, b_narrow)
                )
            else:
                part, a_piece, b_piece = warpgroup_mma_wait(num_outstanding=0, deps=(part, a_piece, b_piece))
            mbarrier.arrive(empty.index(slot), count=1)  # this partition is done with the stage
            acc += part * gl.expand_dims(scale, 1)
            if NARROW > 0:
                acc_narrow += part_narrow * gl.expand_dims(scale_narrow, 1)
            step += 1

        # Hand the tile to the storer through shared memory once it has written out the previous
        # one; every thread's shared stores come before the elected arrive (a CTA-scope release).
        mbarrier.wait(tile_free, (done & 1) ^ 1)
        out_wide.index(PIECE).store(acc.to(gl.bfloat16))
        if NARROW > 0:
            out_narrow.index(PIECE).store(acc_narrow.to(gl.bfloat16))
        _barrier()
        mbarrier.arrive(tile_done, count=1)
        done += 1  # noqa: SIM113 (no enumerate in Gluon)


# %%
# The storer: the tile out to global memory, then its completion signal
# ----------------------------------------------------------------------
# The math warps leave the finished tile in shared memory and go on with the next one; the storer
# warps copy it out, only the rows below masked_m, in 16-byte stores. (With the math warps storing
# it themselves, through a layout conversion in shared memory, the tensor cores idled for the
# whole epilogue: the storer made the 128×192 tile 2.5–6.7 % faster at 96 and 128 rows,
# kernels/README.md.) A releasing atomic at GPU scope then waits until the stores are visible
# GPU-wide (about a microsecond); the storer pays that too.


@gluon.jit
def _store_piece(piece, d_tile, row0, col0, rows_e, N, stride_dm, LAYOUT: gl.constexpr):
    """Copy a piece (rows × columns in shared memory) to D's rows row0.. and columns col0..; row
    chunks at or past the expert's rows are not even read."""
    CHUNK: gl.constexpr = LAYOUT.size_per_thread[0] * LAYOUT.threads_per_warp[0] * LAYOUT.warps_per_cta[0]
    ROWS: gl.constexpr = piece.type.shape[0]
    COLS: gl.constexpr = piece.type.shape[1]
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LAYOUT))
    cols = col0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, LAYOUT))
    col_in = gl.expand_dims(cols < N, 0)
    for r in gl.static_range(0, ROWS, CHUNK):
        if row0 + r < rows_e:
            values = piece.slice(r, CHUNK).load(LAYOUT)
            ptrs = d_tile + gl.expand_dims(row0 + r + rows, 1) * stride_dm + gl.expand_dims(cols, 0)
            gl.store(ptrs, values, mask=gl.expand_dims(row0 + r + rows < rows_e, 1) & col_in)


@gluon.jit
def _storer(
    out_wide, out_narrow, tile_done, tile_free, d_ptr, masked_m_ptr, signal_ptr,
    E, M_MAX, N, num_workers, stride_de, stride_dm,
    BLOCK_M: gl.constexpr, ROW_STEP: gl.constexpr, COL_STEP: gl.constexpr, NARROW: gl.constexpr,
    SIGNAL_MODE: gl.constexpr, WIDE_LAYOUT: gl.constexpr, NARROW_LAYOUT: gl.constexpr,
):  # fmt: skip
    WIDE: gl.constexpr = out_wide.type.shape[2] + COL_STEP
    BLOCK_N: gl.constexpr = WIDE + NARROW
    num_n_blocks = gl.cdiv(N, BLOCK_N)
    num_tiles = _num_tiles(masked_m_ptr, E, M_MAX, num_n_blocks, BLOCK_M)
    first = _first_tile(num_tiles, num_workers)
    num_m_blocks_max = gl.cdiv(M_MAX, BLOCK_M)

    e = 0
    before_e = 0
    tiles_e, rows_e = _expert_tiles(masked_m_ptr, 0, M_MAX, num_n_blocks, BLOCK_M)
    if SIGNAL_MODE == 2 and gl.program_id(0) == 0:
        # DeepEP layout: a program counts itself in for an expert once it is done with it, also
        # when it has none of its tiles. Those that have none are known here (the tiles of expert
        # x are consecutive in the list, so min(tiles, workers) programs share them): program 0
        # counts them all in at once (relaxed: they wrote nothing), so that the one counter line
        # gets (programs with tiles + 1) adds per expert instead of one per program.
        for x in range(E):
            tiles_x, _ = _expert_tiles(masked_m_ptr, x, M_MAX, num_n_blocks, BLOCK_M)
            absent = gl.num_programs(0) - gl.minimum(tiles_x, num_workers)
            if absent > 0:
                gl.atomic_add(signal_ptr + x, absent, sem="relaxed", scope="gpu")
    done = 0
    for g in range(first, num_tiles, num_workers):
        e, before_e, tiles_e, rows_e = _advance(
            g, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
        )
        if SIGNAL_MODE == 2:  # the expert of this program's next tile (E: none), looked up while waiting
            next_e = E
            if g + num_workers < num_tiles:
                next_e, _, _, _ = _advance(
                    g + num_workers, e, before_e, tiles_e, rows_e, masked_m_ptr, M_MAX, num_n_blocks, BLOCK_M
                )
        mb, nb = _row_and_column_block(g - before_e, rows_e, BLOCK_M)
        wide_col, narrow_col = _part_columns(nb, WIDE, NARROW)
        d_tile = d_ptr + e * stride_de
        mbarrier.wait(tile_done, done & 1)  # both math partitions left their pieces
        for p in gl.static_range(2):
            row0 = mb * BLOCK_M + p * ROW_STEP
            _store_piece(out_wide.index(p), d_tile, row0, wide_col + p * COL_STEP, rows_e, N, stride_dm, WIDE_LAYOUT)
            if NARROW > 0:
                _store_piece(out_narrow.index(p), d_tile, row0, narrow_col, rows_e, N, stride_dm, NARROW_LAYOUT)
        if SIGNAL_MODE != 0:
            _fence_for_tma_readers()  # the stores are read by TMA once released
        _barrier()  # every storer thread's stores before the one releasing atomic
        if SIGNAL_MODE == 1:
            gl.atomic_add(signal_ptr + e * num_m_blocks_max + mb, 1, sem="release", scope="gpu")
        if SIGNAL_MODE == 2:  # noqa: SIM102 (a compile-time and a run-time condition)
            if next_e > e:  # done with expert e: release its tiles
                gl.atomic_add(signal_ptr + e, 1, sem="release", scope="gpu")
        mbarrier.arrive(tile_free, count=1)  # the math may overwrite the pieces
        done += 1  # noqa: SIM113


@gluon.jit
def _masked_grouped_gemm_ws_kernel(
    a_desc, b_desc, b2_desc, a_scale_ptr, b_scale_ptr, d_ptr, masked_m_ptr, signal_ptr,
    E, M_MAX, N, K, num_workers,
    stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_de, stride_dm,
    SIGNAL_MODE: gl.constexpr, NUM_STAGES: gl.constexpr, ROW_STEP: gl.constexpr, COL_STEP: gl.constexpr,
    NARROW: gl.constexpr,  # columns of a tile's narrow part, loaded through b2_desc: 64 in a 192-wide tile, else 0
    MMA_LAYOUT: gl.constexpr, NARROW_MMA_LAYOUT: gl.constexpr, OUT_LAYOUT: gl.constexpr,
    NARROW_OUT_LAYOUT: gl.constexpr, WIDE_STORE_LAYOUT: gl.constexpr, NARROW_STORE_LAYOUT: gl.constexpr,
    MATH_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, STORER_REGS: gl.constexpr, STORER_WARPS: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] + NARROW
    SCALE_BLOCKS: gl.constexpr = (BLOCK_N + _SCALE_BLOCK - 1) // _SCALE_BLOCK  # weight-scale blocks a tile touches
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)  # noqa: RUF005 (jit AST)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)  # noqa: RUF005
    b2_bufs = b_bufs  # unused without a narrow part
    if NARROW > 0:
        b2_bufs = gl.allocate_shared_memory(b2_desc.dtype, [NUM_STAGES] + b2_desc.block_type.shape, b2_desc.layout)  # noqa: RUF005
    scales = gl.allocate_shared_memory(  # rows of 64 row scales: see _scale_row
        gl.float32,
        [NUM_STAGES * SCALE_BLOCKS * (BLOCK_M // _PIECE_ROWS), _PIECE_ROWS],
        gl.SwizzledSharedLayout(1, 1, 1, [0]),
    )
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # The finished tile, a piece per math partition (one tile: the math writes the next one long
    # after the storer has emptied this one).
    out_wide = gl.allocate_shared_memory(gl.bfloat16, [2, _PIECE_ROWS, _PIECE_COLS], OUT_LAYOUT)
    out_narrow = out_wide  # unused without a narrow part
    if NARROW > 0:
        out_narrow = gl.allocate_shared_memory(gl.bfloat16, [2, _PIECE_ROWS, NARROW], NARROW_OUT_LAYOUT)
    tile_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=2)  # the producer's expect-tx arrive and its scales' arrive
        mbarrier.init(empty.index(i), count=2)  # one arrive per math partition
    mbarrier.init(tile_done, count=2)  # one arrive per math partition
    mbarrier.init(tile_free, count=1)
    # (Gluon takes the partitions' tuples only written out in place.)
    gl.warp_specialize(
        [
            (
                _math,
                (a_bufs, b_bufs, b2_bufs, scales, out_wide, out_narrow, ready, empty, tile_done, tile_free,
                 masked_m_ptr, E, M_MAX, N, K, num_workers,
                 0, 0, NARROW, MMA_LAYOUT, NARROW_MMA_LAYOUT),
            ),
            (
                _math,
                (a_bufs, b_bufs, b2_bufs, scales, out_wide, out_narrow, ready, empty, tile_done, tile_free,
                 masked_m_ptr, E, M_MAX, N, K, num_workers,
                 ROW_STEP, COL_STEP, NARROW, MMA_LAYOUT, NARROW_MMA_LAYOUT),
            ),
            (
                _producer,
                (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, scales, ready, empty,
                 a_scale_ptr, b_scale_ptr, masked_m_ptr, E, M_MAX, N, K, num_workers,
                 stride_ase, stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, NARROW),
            ),
            (
                _storer,
                (out_wide, out_narrow, tile_done, tile_free, d_ptr, masked_m_ptr, signal_ptr,
                 E, M_MAX, N, num_workers, stride_de, stride_dm,
                 BLOCK_M, ROW_STEP, COL_STEP, NARROW, SIGNAL_MODE, WIDE_STORE_LAYOUT, NARROW_STORE_LAYOUT),
            ),
        ],
        [4, 1, STORER_WARPS],
        [MATH_REGS, PRODUCER_REGS, STORER_REGS],
    )  # fmt: skip


# %%
# The launcher
# ------------


def _wide_and_narrow(config: WsConfig) -> tuple[int, int]:
    """A tile's columns as a wide part (one TMA box) and a narrow one (0, or 64 of a 192-wide tile)."""
    return (128, 64) if config.block_n == 192 else (config.block_n, 0)


def _math_split(config: WsConfig) -> dict:
    """Where the second math partition's piece starts, and the layouts (the kernel's constexprs)."""
    # A warpgroup per 64 rows of a 128-row tile, or per 128 columns of a 64×256 one.
    split = {"ROW_STEP": 64, "COL_STEP": 0} if config.block_m == 128 else {"ROW_STEP": 0, "COL_STEP": 128}
    # A warpgroup's wgmma: m16 × 128 (or the narrow part's 64) columns × k32 per warp for FP8,
    # 4 warps down the 64 rows. The store: 8 bf16 = 16 bytes per thread.
    mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    narrow = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
    warps = config.storer_warps
    return {
        **split,
        "NARROW": _wide_and_narrow(config)[1],
        "MMA_LAYOUT": mma,
        "NARROW_MMA_LAYOUT": narrow,
        # The finished pieces in shared memory, swizzled as wgmma operands are (bank-conflict free
        # for the math's writes and the storer's 16-byte reads).
        "OUT_LAYOUT": gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16),
        "NARROW_OUT_LAYOUT": gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16),
        # The storer's passes: rows of 8 bf16 = 16 bytes a thread, over 8 rows at least (the
        # swizzle pattern's height, which a slice of the pieces must not split).
        "WIDE_STORE_LAYOUT": gl.BlockedLayout([max(1, 4 // warps), 8], [2, 16], [warps, 1], [1, 0]),
        "NARROW_STORE_LAYOUT": gl.BlockedLayout([max(1, 2 // warps), 8], [4, 8], [warps, 1], [1, 0]),
        "STORER_WARPS": warps,
        "STORER_REGS": config.storer_regs,
        "num_warps": 4,
    }


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

    def descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
        """TMA boxes of rows × one K step (128 FP8 bytes, so the 128-byte swizzle)."""
        layout = gl.NVMMASharedLayout.get_default_for([rows, SCALE_BLOCK], gl.float8e4nv)
        return TensorDescriptor.from_tensor(x.view(-1, K), [rows, SCALE_BLOCK], layout)

    wide, narrow = _wide_and_narrow(config)
    a_desc = descriptor(a, config.block_m)
    b_desc = descriptor(b, wide)
    b2_desc = descriptor(b, narrow) if narrow else b_desc
    tiles = E * triton.cdiv(min(expected_m, M_max), config.block_m) * triton.cdiv(N, config.block_n)
    num_workers = triton.cdiv(tiles, triton.cdiv(tiles, num_programs)) if tiles else num_programs
    _masked_grouped_gemm_ws_kernel[(num_programs,)](
        a_desc, b_desc, b2_desc, a_scale, b_scale, out, masked_m, signal,
        E, M_max, N, K, num_workers,
        a_scale.stride(0), a_scale.stride(1), a_scale.stride(2),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out.stride(0), out.stride(1),
        SIGNAL_MODE=signal_mode, NUM_STAGES=config.num_stages,
        MATH_REGS=config.math_regs, PRODUCER_REGS=config.producer_regs,
        **_math_split(config),
    )  # fmt: skip
