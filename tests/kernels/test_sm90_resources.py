"""Registers on sm_90a, checked on the CPU: no tile ``pick_config`` chooses may spill.

A spilling tile runs about twice as long on the H200 (kernels/README.md), and whether it spills is fixed
at compile time, so CI compiles each chosen configuration for sm_90a and reads ptxas's report.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs triton (the `validate` or `kernels` extra)")

from sglang_pd.kernels import signal_gemm as sg
from sglang_pd.kernels.sm90_resources import compile_resources, wgmma_waits_on_loads

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

MODES = {"none": sg.SIGNAL_NONE, "sglang": sg.SIGNAL_SGLANG, "deepep": sg.SIGNAL_DEEPEP}


@pytest.mark.parametrize("max_block_n", [256, 160], ids=["bn256", "bn160"])  # what sglang passes
@pytest.mark.parametrize("warp_specialized", [False, True], ids=["triton", "gluon-ws"])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("expected_m", [1, 16, 17, 32, 64, 128, 2048])
def test_picked_tiles_do_not_spill(expected_m: int, mode: int, warp_specialized: bool, max_block_n: int) -> None:
    config = sg.pick_config(expected_m, max_block_n, signal_mode=mode, warp_specialized=warp_specialized)
    resources = compile_resources(config, mode)
    assert resources.spill_bytes == 0, f"{config} spills {resources.spill_bytes} B per thread on sm_90a"
    assert resources.registers <= 255
    assert resources.shared_bytes <= 227 * 1024, "H100/H200 give a program at most 227 KiB of shared memory"
    if isinstance(config, sg.WsConfig):  # its math warps issue no global load, so none can stall a wgmma
        assert resources.loads_in_wgmma == (), f"{config}: {resources.loads_in_wgmma}"


def test_a_tile_too_large_for_the_register_file_is_reported() -> None:
    """The check can fail: a 128×256 fp32 accumulator alone is 128 registers a thread on 8 warps,
    and the scaled partial product needs as many again."""
    too_big = sg.GemmConfig(block_m=128, block_n=256, num_stages=3, num_warps=8, use_tma=True)
    resources = compile_resources(too_big)
    assert resources.registers == 255 and resources.spill_bytes > 0


SASS = """
        /*3a10*/                   LDG.E R156, desc[UR18][R26.64] ;
        /*3a20*/              @!P1 LDG.E R152, desc[UR18][R16.64] ;
        /*3a30*/                   LDG.E R150, desc[UR18][R16.64+0x20] ;
        /*3a40*/                   IMAD.MOV.U32 R150, RZ, RZ, R7 ;
        /*3a80*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R157+UR34+0x22000], R28 ;
.L_x_42:
        /*3b60*/                   WARPGROUP.ARRIVE ;
        /*3b70*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ, !UPT ;
        /*3b80*/                   IMAD.MOV.U32 R137, RZ, RZ, R156 ;
        /*3b90*/                   SEL R16, R150, R145, !P2 ;
        /*3ba0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24, gsb0 ;
        /*3bb0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*3bc0*/                   FMUL R40, R24, R152 ;
        /*3bd0*/                   WARPGROUP.ARRIVE ;
        /*3be0*/                   FMUL R41, R25, R152 ;
        /*3bf0*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ, !UPT, gsb0 ;
        /*3c00*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_wgmma_waits_on_loads_finds_a_copy_of_a_fresh_load_between_the_wgmmas() -> None:
    """The pattern ptxas produced in the DeepEP build of the one-partition 64x256 tile: a copy of a
    load of the same step between two QGMMAs. Not reported: a register overwritten after its load
    (R150), reads outside ARRIVE..DEPBAR, and loads before the previous DEPBAR (R152 in the second
    step)."""
    assert wgmma_waits_on_loads(SASS) == ["IMAD.MOV.U32 R137, RZ, RZ, R156"]
