"""benchmarks/sbo_waves.py against a walk of the kernels' tile list, tile by tile."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sbo_waves


def walk(counts: list[int], block_m: int, n_blocks: int, workers: int) -> dict[tuple[int, int], int]:
    """Each row-block's release wave from the tile list itself: tiles expert by expert, column-block
    by column-block, row-blocks adjacent; tile g to worker g % W in wave g // W; a row-block is
    released when the last of its tiles has run."""
    released: dict[tuple[int, int], int] = {}
    g = 0
    for e, count in enumerate(counts):
        rows = -(-count // block_m)
        for _nb in range(n_blocks):
            for rb in range(rows):
                released[(e, rb)] = max(released.get((e, rb), 0), g // workers)
                g += 1
    return released


@pytest.mark.parametrize("case", range(40))
def test_release_waves_match_the_tile_walk(case: int) -> None:
    rng = random.Random(case)
    counts = [rng.choice([0, 1, 7, 64, 65, 128, 200]) for _ in range(rng.randint(1, 16))]
    block_m, n_blocks, workers = rng.choice([64, 128]), rng.choice([28, 38, 56]), rng.randint(1, 132)
    waves = sbo_waves.release_waves(counts, block_m, n_blocks, workers)
    walked = walk(counts, block_m, n_blocks, workers)
    assert {(e, rb): w for e, ws in enumerate(waves) for rb, w in enumerate(ws)} == walked


def test_the_gluon_kernel_splits_tiles_evenly_over_the_fewest_workers() -> None:
    # kernels/README.md: 448 tiles on 129 programs run on 112 workers of 4 tiles each
    assert sbo_waves.gemm_workers(16, 256, 8, 64, 28, 129, warp_specialized=True) == 112
    assert sbo_waves.gemm_workers(16, 256, 8, 64, 28, 129, warp_specialized=False) == 129


def test_one_token_per_expert_sixteen_experts_three_send_sms() -> None:
    d = sbo_waves.describe([8] * 16, block_m=64, n_blocks=28, programs=129, expected_m=8, m_max=256,
                           warp_specialized=True, send_sms=3)  # fmt: skip
    assert (d["tiles"], d["gemm_workers"], d["gemm_waves"]) == (448, 112, 4)
    # expert e's row-block is released with tile 28 e + 27: experts 0-3 in wave 0, ... 12-15 in wave 3
    assert d["released_per_wave"] == [4, 4, 4, 4] and d["released_in_last_wave"] == 4
    assert (d["valid_signals"], d["send_rounds"]) == (16, 6)


def test_an_expert_without_tokens_is_still_one_valid_signal_for_deepep() -> None:
    d = sbo_waves.describe([0, 0, 70], block_m=64, n_blocks=28, programs=8, expected_m=24, m_max=128,
                           warp_specialized=False, send_sms=2)  # fmt: skip
    assert d["row_blocks"] == 2 and d["valid_signals"] == 4 and d["send_rounds"] == 2


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="send_sms must be >= 1"):
        sbo_waves.describe([1], block_m=64, n_blocks=28, programs=8, expected_m=1, m_max=64,
                           warp_specialized=False, send_sms=0)  # fmt: skip
    with pytest.raises(ValueError, match="token counts"):
        sbo_waves.release_waves([-1], 64, 28, 8)
