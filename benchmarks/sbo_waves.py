"""Waves of the signal down-GEMM and of DeepEP's combine-send, derived from tile and SM counts.

Recording when each row-block's signal is released would need a timestamp store in the kernels;
instead this derives it, assuming every tile takes the same time and the workers run in lockstep:

- Both kernels walk one tile list, expert by expert, the row-blocks of one column-block next to
  each other: tile ``g = tiles before e + nb * R_e + rb`` (``R_e`` row-blocks of expert ``e``), and
  worker ``w`` runs tiles ``w, w + W, ...`` (`kernels/signal_gemm.py`, the tile loop of
  `_masked_grouped_gemm_kernel`; `kernels/signal_gemm_ws.py`, `_row_and_column_block` and
  `_first_tile`). Tile ``g`` runs in wave ``g // W``, and a row-block is released with its last
  column-block's tile.
- The Triton kernel's ``W`` is its program count; the Gluon kernel's is the fewest programs that
  give each the same count of the tiles ``expected_m`` predicts (`signal_gemm_ws.launch`).
- DeepEP antgroup-opt's overlapped combine-send (`csrc/kernels/internode_ll.cu` at 76f0271, the
  send loop of `combine`) walks the *valid signals*, ``max(1, ceil(count_e / block_m))`` per local
  expert, round-robin over its ``num_sms`` send SMs, one row-block at a time each.

So the GEMM takes ``ceil(tiles / W)`` waves, the row-blocks released in its last wave can only be
sent after it ends, and the send SMs need ``ceil(valid signals / num_sms)`` rounds in all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["describe", "gemm_workers", "release_waves"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(counts: Sequence[int], **positive: int) -> None:
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if any(c < 0 for c in counts):
        raise ValueError(f"token counts per expert must be >= 0, got {list(counts)}")


def gemm_workers(
    num_experts: int, m_max: int, expected_m: int, block_m: int, n_blocks: int, programs: int, warp_specialized: bool
) -> int:
    """The number of programs that take tiles (``W``)."""
    _check([], num_experts=num_experts, m_max=m_max, expected_m=expected_m, block_m=block_m, n_blocks=n_blocks,
           programs=programs)  # fmt: skip
    if not warp_specialized:
        return programs
    tiles = num_experts * _cdiv(min(expected_m, m_max), block_m) * n_blocks
    return _cdiv(tiles, _cdiv(tiles, programs))


def release_waves(counts: Sequence[int], block_m: int, n_blocks: int, workers: int) -> list[list[int]]:
    """Per expert, the wave in which each of its row-blocks is released (its last tile runs)."""
    _check(counts, block_m=block_m, n_blocks=n_blocks, workers=workers)
    waves: list[list[int]] = []
    before = 0
    for count in counts:
        r = _cdiv(count, block_m)
        waves.append([(before + (n_blocks - 1) * r + rb) // workers for rb in range(r)])
        before += r * n_blocks
    return waves


def describe(
    counts: Sequence[int],
    *,
    block_m: int,
    n_blocks: int,
    programs: int,
    expected_m: int,
    m_max: int,
    warp_specialized: bool,
    send_sms: int,
) -> dict[str, Any]:
    """The derived waves of one layer call: tiles, workers, GEMM waves, how many row-blocks each
    wave releases, and the combine-send's valid signals and rounds."""
    _check(counts, send_sms=send_sms)
    workers = gemm_workers(len(counts), m_max, expected_m, block_m, n_blocks, programs, warp_specialized)
    per_expert = release_waves(counts, block_m, n_blocks, workers)
    tiles = sum(len(w) for w in per_expert) * n_blocks
    gemm_waves = _cdiv(tiles, workers) if tiles else 0
    released = Counter(w for expert in per_expert for w in expert)
    valid_signals = sum(max(1, len(w)) for w in per_expert)
    row_blocks = sum(len(w) for w in per_expert)
    return {
        "model": "derived from tile and SM counts (equal tile times, workers in lockstep); not measured",
        "tiles": tiles,
        "gemm_workers": workers,
        "gemm_waves": gemm_waves,
        "row_blocks": row_blocks,
        "released_per_wave": [released.get(w, 0) for w in range(gemm_waves)],
        "released_in_last_wave": released.get(gemm_waves - 1, 0) if gemm_waves else 0,
        "send_sms": send_sms,
        "valid_signals": valid_signals,
        "send_rounds": _cdiv(valid_signals, send_sms),
    }
