"""Registers on sm_90a, checked on the CPU: no tile ``pick_config`` chooses may spill.

A spilling tile runs 2–10× slower on the H200 (kernels/README.md), and whether it spills is fixed
at compile time, so CI compiles each chosen configuration for sm_90a and reads ptxas's report.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the `validate` or `kernels` extra)")

from sglang_pd.kernels import signal_gemm as sg
from sglang_pd.kernels.sm90_resources import compile_resources

MODES = {"none": sg.SIGNAL_NONE, "sglang": sg.SIGNAL_SGLANG, "deepep": sg.SIGNAL_DEEPEP}


@pytest.mark.parametrize("warp_specialized", [False, True], ids=["triton", "gluon-ws"])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("expected_m", [1, 16, 17, 32, 64, 128, 2048])
def test_picked_tiles_do_not_spill(expected_m: int, mode: int, warp_specialized: bool) -> None:
    config = sg.pick_config(expected_m, signal_mode=mode, warp_specialized=warp_specialized)
    resources = compile_resources(config, mode)
    assert resources.spill_bytes == 0, f"{config} spills {resources.spill_bytes} B per thread on sm_90a"
    assert resources.registers <= 255
    assert resources.shared_bytes <= 227 * 1024, "H100/H200 give a program at most 227 KiB of shared memory"


def test_a_tile_too_large_for_the_register_file_is_reported() -> None:
    """The check can fail: a 128×256 fp32 accumulator alone is 128 registers a thread on 8 warps,
    and the scaled partial product needs as many again."""
    too_big = sg.GemmConfig(block_m=128, block_n=256, num_stages=3, num_warps=8, use_tma=True)
    resources = compile_resources(too_big)
    assert resources.registers == 255 and resources.spill_bytes > 0
