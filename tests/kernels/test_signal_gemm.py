"""Tests for kernels/signal_gemm.py: the sm_90 masked grouped down GEMM with completion signals.

GPU tests run on the device machine (``pytest -m gpu tests/kernels``); CI has no CUDA and skips
them. ``test_interpreter_smoke`` runs the same kernel through Triton's CPU interpreter, so CI checks
the FP8 path, both signal layouts and the TMA variant whenever triton is installed.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from sglang_pd.kernels import signal_gemm as sg  # noqa: E402
from tests.support.signal_consumer import copy_when_signalled  # noqa: E402

#: ‖out − ref‖ / ‖ref‖ for exact FP8 operands, fp32 accumulation and a bf16 output: the bf16
#: rounding of the output alone gives about 1.5e-3 (bf16 keeps 8 significant bits).
FP8_RTOL = 4e-3
#: bf16 operands accumulate in fp32; same output rounding.
BF16_RTOL = 4e-3


# %%
# Inputs: DeepSeek-V3's FP8 recipe, on fresh random data every time
# ---------------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, M, K] → FP8 e4m3 and one float32 scale per token per 128 channels."""
    E, M, K = x.shape
    blocks = x.float().view(E, M, K // 128, 128)
    scale = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (blocks / scale[..., None]).view(E, M, K).to(torch.float8_e4m3fn), scale


def quantize_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] → FP8 e4m3 and one float32 scale per 128×128 block."""
    E, N, K = w.shape
    nb = -(-N // 128)
    padded = torch.zeros(E, nb * 128, K, device=w.device)
    padded[:, :N] = w.float()
    blocks = padded.view(E, nb, 128, K // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
    q = (blocks / scale[:, :, None, :, None]).view(E, nb * 128, K)[:, :N].contiguous()
    return q.to(torch.float8_e4m3fn), scale


def make_fp8_problem(E: int, M_max: int, N: int, K: int, device: str = "cuda"):
    # Varied magnitudes per expert and channel, so that the scales matter.
    x = torch.randn(E, M_max, K, device=device) * torch.rand(E, 1, K, device=device).add(0.1)
    w = torch.randn(E, N, K, device=device) * torch.rand(E, N, 1, device=device).add(0.1)
    a, a_scale = quantize_activations(x)
    b, b_scale = quantize_weights(w)
    return a, a_scale, b, b_scale


def poisoned(E: int, M_max: int, N: int) -> torch.Tensor:
    return torch.full((E, M_max, N), float("nan"), dtype=torch.bfloat16, device="cuda")


def check_output(out: torch.Tensor, ref: torch.Tensor, masked_m: torch.Tensor, rtol: float) -> None:
    """Rows < masked_m[e] match the reference; rows at or beyond it still hold the poison."""
    for e, m in enumerate(masked_m.tolist()):
        assert out[e, m:].isnan().all(), f"expert {e}: a row at or beyond masked_m={m} was written"
        if m == 0:
            continue
        got = out[e, :m].double()
        assert not got.isnan().any(), f"expert {e}: a row below masked_m={m} was not written"
        err = ((got - ref[e, :m]).norm() / ref[e, :m].norm()).item()
        assert err < rtol, f"expert {e} (masked_m={m}): relative error {err:.2e} exceeds {rtol:.0e}"


def signal_buffer(mode: int, E: int, M_max: int, block_m: int) -> torch.Tensor:
    """Zeroed counters as each layout's caller allocates them (DeepEP's are uint32)."""
    return torch.zeros(
        E * -(-M_max // block_m) if mode == sg.SIGNAL_SGLANG else E,
        dtype=torch.int32 if mode != sg.SIGNAL_DEEPEP else torch.uint32,
        device="cuda",
    )


def check_signals(result, signal, mode, config, masked_m, M_max: int, N: int, num_programs: int) -> None:
    """The launcher's returned pair and the final counters match the layout's torch reference."""
    if mode == sg.SIGNAL_SGLANG:
        assert result == (config.block_m, -(-N // config.block_n))
        expected = sg.reference_sglang_signal(masked_m, M_max, N, config.block_m, config.block_n)
        assert torch.equal(signal.cpu(), expected), "sglang-layout signals differ from the reference"
    elif mode == sg.SIGNAL_DEEPEP:
        assert result == (num_programs, num_programs)
        expected = sg.reference_deepep_signal(len(masked_m), num_programs)
        assert torch.equal(signal.view(torch.int32).cpu(), expected), "DeepEP-layout signals differ"


SHAPES = [
    # (E, M_max, N, K): DeepSeek-V3 down projection at test scale, then an odd one.
    (4, 256, 7168, 2048),
    (3, 70, 200, 256),
]

MASKS = {
    "all0": lambda E, M: [0] * E,
    "all1": lambda E, M: [1] * E,
    "all63": lambda E, M: [min(63, M)] * E,
    "all64": lambda E, M: [min(64, M)] * E,
    "all65": lambda E, M: [min(65, M)] * E,
    "allMmax": lambda E, M: [M] * E,
    "mix": None,  # random per expert, zeros included
}

VARIANTS = [
    sg.GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4),
    sg.GemmConfig(block_m=64, block_n=256, num_stages=4, num_warps=8),
    sg.GemmConfig(block_m=128, block_n=128, num_stages=3, num_warps=8),
    sg.GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=8, swap_ab=True),
    sg.GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4, use_tma=True),
    sg.GemmConfig(block_m=64, block_n=64, num_stages=6, num_warps=4, flatten=False),
    sg.GemmConfig(block_m=64, block_n=256, num_stages=3, num_warps=8, use_tma=True, signal_asm=True),
    sg.GemmConfig(block_m=64, block_n=128, num_stages=4, num_warps=4, flatten=False, signal_asm=True),
    # The tiles pick_config chooses: swap-AB up to 32 rows, 128×128 with TMA at 128 rows.
    sg.GemmConfig(block_m=16, block_n=256, num_stages=3, num_warps=8, swap_ab=True, use_tma=True, signal_asm=True),
    sg.GemmConfig(block_m=32, block_n=256, num_stages=3, num_warps=8, swap_ab=True, use_tma=True, signal_asm=True),
    sg.GemmConfig(block_m=16, block_n=256, num_stages=4, num_warps=8, swap_ab=True, use_tma=True, signal_asm=True),
    sg.GemmConfig(block_m=128, block_n=128, num_stages=3, num_warps=8, use_tma=True, signal_asm=True),
]


def masked_m_for(name: str, E: int, M_max: int, gen: torch.Generator) -> torch.Tensor:
    if MASKS[name] is None:
        values = torch.randint(0, M_max + 1, (E,), generator=gen)
        values[torch.randint(0, E, (1,), generator=gen)] = 0
        return values.to(torch.int32).cuda()
    return torch.tensor(MASKS[name](E, M_max), dtype=torch.int32, device="cuda")


# %%
# Correctness
# -----------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("config", [None, *VARIANTS], ids=lambda c: "picked" if c is None else repr(c))
@pytest.mark.parametrize("mode", [sg.SIGNAL_NONE, sg.SIGNAL_SGLANG, sg.SIGNAL_DEEPEP])
def test_fp8_masked_gemm(shape, mask, config, mode):
    E, M_max, N, K = shape
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, mask, config, mode)).encode()))
    masked_m = masked_m_for(mask, E, M_max, gen)
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    cfg = config or sg.pick_config(int(masked_m.float().mean().item()) or 1)
    signal = signal_buffer(mode, E, M_max, cfg.block_m)
    out = poisoned(E, M_max, N)
    num_sms = 7 if mode == sg.SIGNAL_DEEPEP else None  # fewer programs than tiles and than experts
    result = sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal,
                                    signal_mode=mode, config=cfg, num_sms=num_sms)  # fmt: skip
    torch.cuda.synchronize()
    ref = sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale)
    check_output(out, ref, masked_m, FP8_RTOL)
    check_signals(result, signal, mode, cfg, masked_m, M_max, N, num_programs=7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("swap_ab", [False, True])
def test_bf16_masked_gemm(mask, swap_ab):
    E, M_max, N, K = 4, 192, 1536, 1024
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mask, swap_ab)).encode()))
    masked_m = masked_m_for(mask, E, M_max, gen)
    a = torch.randn(E, M_max, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    out = poisoned(E, M_max, N)
    cfg = sg.GemmConfig(block_m=64, block_n=128, num_stages=3, num_warps=8 if swap_ab else 4, swap_ab=swap_ab)
    signal = torch.zeros(E * -(-M_max // 64), dtype=torch.int32, device="cuda")
    assert sg.bf16_m_grouped_gemm_nt_masked(
        a, b, out, masked_m, 64, enable_overlap=True, signal=signal, config=cfg
    ) == (64, -(-N // 128))
    torch.cuda.synchronize()
    check_output(out, sg.reference_masked_grouped_gemm(a, b, masked_m), masked_m, BF16_RTOL)
    assert torch.equal(signal.cpu(), sg.reference_sglang_signal(masked_m, M_max, N, 64, 128))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deepgemm_compatible_entry():
    """Same argument order and return value as ``deep_gemm.fp8_m_grouped_gemm_nt_masked``."""
    E, M_max, N, K = 4, 128, 7168, 2048
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    masked_m = torch.tensor([5, 64, 0, 128], dtype=torch.int32, device="cuda")
    out = poisoned(E, M_max, N)
    assert sg.fp8_m_grouped_gemm_nt_masked((a, a_scale), (b, b_scale), out, masked_m, 64) == (None, None)
    signal = torch.zeros(E * 2, dtype=torch.int32, device="cuda")
    block_m, threshold = sg.fp8_m_grouped_gemm_nt_masked(
        (a, a_scale), (b, b_scale), out, masked_m, 64, enable_overlap=True, max_block_n=160, signal=signal
    )
    assert block_m == 64 and threshold == -(-N // 128)  # block_n capped to 128 by max_block_n=160
    torch.cuda.synchronize()
    check_output(out, sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale), masked_m, FP8_RTOL)
    assert torch.equal(signal.cpu(), sg.reference_sglang_signal(masked_m, M_max, N, block_m, 128))
    # DeepEP's layout: uint32 per expert, expected value = number of programs.
    sig = torch.zeros(E, dtype=torch.uint32, device="cuda")
    programs, _ = sg.fp8_m_grouped_gemm_nt_masked(
        (a, a_scale), (b, b_scale), out, masked_m, 64, enable_overlap=True, signal=sig, signal_layout="deepep"
    )
    torch.cuda.synchronize()
    assert torch.equal(sig.view(torch.int32).cpu(), sg.reference_deepep_signal(E, programs))


# %%
# Ordering: a consumer on another stream never sees a torn row-block
# -------------------------------------------------------------------


def _ordering_runs(layout: str, runs: int, target_offset: int = 0) -> dict:
    """``runs`` randomized runs of the GEMM with a consumer on another stream that copies each unit
    as soon as its counter reaches the target (+ ``target_offset``: a negative offset makes the
    consumer skip the last wait, a must-fail control). Counts the runs whose copy differs from the
    final output, the units copied while the GEMM still ran, and the units the consumer gave up on."""
    E, M_max, N, K = 8, 256, 7168, 2048
    consumer_programs = 3
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count - consumer_programs
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    out = torch.empty(E, M_max, N, dtype=torch.bfloat16, device="cuda")
    copy = torch.empty_like(out)
    side = torch.cuda.Stream()
    gen = torch.Generator().manual_seed((7 if layout == "sglang" else 8) + 100 * abs(target_offset))

    # One run of each kernel before the loop, so that no module load happens while a consumer spins:
    # with CUDA's lazy loading, a kernel's first launch loads its module, and that waits for the
    # running consumer, which waits for the GEMM queued behind that launch (seen on the H200: the
    # first run that slept before the GEMM stalled until the consumer gave up). Hence _sleep too.
    torch.cuda._sleep(1)
    per_expert = layout == "deepep"
    mode = sg.SIGNAL_DEEPEP if per_expert else sg.SIGNAL_SGLANG

    def pick(m: int, max_block_n: int) -> sg.GemmConfig | sg.WsConfig:  # what the entry point picks here
        return sg.pick_config(m, max_block_n, signal_mode=mode, warp_specialized=sg.ws_usable(0))

    # sglang passes max_block_n 160 or 256: on sm_90 the Gluon 64x256 tile up to 64 rows and 128x192
    # above, or under 160 the Gluon 128x128 tile above 64 rows and the Triton kernel's tiles below.
    for cfg in {pick(m, cap) for m in (1, 17, 64, 128, M_max) for cap in (160, 256)}:
        warm = torch.zeros(E * -(-M_max // cfg.block_m), dtype=torch.int32, device="cuda")
        full = torch.full((E,), M_max, dtype=torch.int32, device="cuda")
        sg.masked_grouped_gemm(a, b, out, full, a_scale=a_scale, b_scale=b_scale, signal=warm,
                               signal_mode=mode, num_sms=num_sms, config=cfg)  # fmt: skip
        target = num_sms if layout == "deepep" else -(-N // cfg.block_n)
        copy_when_signalled(warm, full, out, copy, target, per_expert=per_expert, block_m=cfg.block_m)
    torch.cuda.synchronize()
    mismatches, waited_units, gave_up, units = 0, 0, 0, 0
    slowest_launch = (0.0, -1)  # (seconds, run)
    stuck: list = []  # (run, launch seconds, config, masked_m, final signals, waited) where the consumer gave up
    for run in range(runs):
        # Every other run has few rows per expert (the Triton tile at max_block_n=160).
        rows_hi = M_max if run % 2 == 0 else 48
        masked_m = torch.randint(0, rows_hi + 1, (E,), generator=gen).to(torch.int32).cuda()
        if run % 4 == 0:
            a, a_scale, _, _ = make_fp8_problem(E, M_max, 128, K)  # fresh activations now and then
        out.fill_(float("nan"))
        copy.fill_(float("-inf"))
        cfg = pick(int(masked_m.float().mean().item()) or 1, (256, 256, 160, 160)[run % 4])
        signal = torch.zeros(E if per_expert else E * -(-M_max // cfg.block_m), dtype=torch.int32, device="cuda")
        target = (num_sms if per_expert else -(-N // cfg.block_n)) + target_offset
        torch.cuda.synchronize()
        delay_consumer, delay_gemm = torch.randint(0, 20000, (2,), generator=gen).tolist()
        with torch.cuda.stream(side):
            if run % 3 == 1:
                torch.cuda._sleep(delay_consumer)
            waited = copy_when_signalled(
                signal,
                masked_m,
                out,
                copy,
                target,
                per_expert=per_expert,
                block_m=cfg.block_m,
                num_programs=consumer_programs,
            )
        if run % 3 != 1:
            torch.cuda._sleep(delay_gemm)
        launch_start = time.perf_counter()
        sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal,
                               signal_mode=mode, num_sms=num_sms, config=cfg)  # fmt: skip
        launch_s = time.perf_counter() - launch_start  # seconds the host took to launch the GEMM
        slowest_launch = max(slowest_launch, (launch_s, run))
        torch.cuda.synchronize()
        rows = torch.arange(M_max, device="cuda")[None, :] < masked_m[:, None]
        same = torch.where(rows[:, :, None], copy.view(torch.int16) == out.view(torch.int16), True)
        mismatches += int((~same).any().item())
        waited_units += int((waited == 1).sum().item())
        if (waited == 2).any():
            stuck.append((run, round(launch_s, 4), cfg, masked_m.tolist(), signal.tolist(), waited.tolist()))
        gave_up += int((waited == 2).sum().item())
        units += waited.numel()
    return {"runs": runs, "mismatches": mismatches, "waited_units": waited_units, "units": units,
            "gave_up": gave_up, "stuck": stuck[:3], "target": target, "slowest_launch": slowest_launch}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["sglang", "deepep"])
def test_signal_ordering_with_polling_consumer(layout):
    """Over 1000 randomized runs, a consumer that copies each unit as soon as its signal completes
    copies exactly the final output: no unit is ever announced before its rows are stored.
    Only the shipped signal path (inline-PTX release) is held to this; Triton's own atomic path,
    kept for comparison, is never picked (it costs +120 % in the flattened loop, kernels/README.md)."""
    r = _ordering_runs(layout, int(os.environ.get("SIGNAL_ORDERING_RUNS", "1000")))
    assert r["gave_up"] == 0, f"the consumer gave up on {r['gave_up']} units (target {r['target']}): {r['stuck']}"
    assert r["mismatches"] == 0, f"{r['mismatches']} of {r['runs']} runs copied a unit before its rows were stored"
    # The test only has teeth if the consumer really polled while the GEMM ran.
    assert r["waited_units"] > 0, "the consumer never found an unfinished unit: no overlap happened"
    print(f"{layout}: {r['runs']} runs, {r['waited_units']}/{r['units']} units copied while the GEMM was running;"
          f" slowest GEMM launch {r['slowest_launch'][0] * 1e3:.1f} ms (run {r['slowest_launch'][1]})")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["sglang", "deepep"])
def test_signal_ordering_control_a_consumer_that_skips_the_last_wait_is_caught(layout):
    """The ordering test's must-fail control: the same runs with the consumer's target one below the
    complete value (it copies a unit one tile or one program too early). The comparison must see
    torn units; if it does not, the ordering test above could not see them either."""
    r = _ordering_runs(layout, int(os.environ.get("SIGNAL_ORDERING_CONTROL_RUNS", "200")), target_offset=-1)
    assert r["gave_up"] == 0, f"the consumer gave up on {r['gave_up']} units: {r['stuck']}"
    assert r["mismatches"] > 0, (
        f"control not caught: none of {r['runs']} runs with the wait skipped copied a torn unit "
        f"({r['waited_units']}/{r['units']} units copied while the GEMM ran)"
    )
    print(f"{layout} control: {r['mismatches']} of {r['runs']} runs with the last wait skipped caught as torn")


# %%
# CPU: the same kernel through Triton's interpreter (runs in CI when triton is installed)
# ---------------------------------------------------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import torch
    from sglang_pd.kernels import signal_gemm as sg

    torch.manual_seed(0)
    E, M, N, K = 3, 70, 200, 256
    a, a_scale = quantize_activations(torch.randn(E, M, K))
    b, b_scale = quantize_weights(torch.randn(E, N, K))
    masked_m = torch.tensor([0, 65, 7], dtype=torch.int32)
    ref = sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale)
    for cfg in (sg.GemmConfig(block_m=64, block_n=64, num_stages=2),
                sg.GemmConfig(block_m=64, block_n=128, swap_ab=True),
                sg.GemmConfig(block_m=64, block_n=64, use_tma=True)):
        for mode in (sg.SIGNAL_NONE, sg.SIGNAL_SGLANG, sg.SIGNAL_DEEPEP):
            out = torch.full((E, M, N), float("nan"), dtype=torch.bfloat16)
            sig = torch.zeros(E * 2 if mode == sg.SIGNAL_SGLANG else E, dtype=torch.int32)
            sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=sig,
                                   signal_mode=mode, num_sms=5, config=cfg)
            for e, m in enumerate(masked_m.tolist()):
                assert out[e, m:].isnan().all(), (cfg, mode, e)
                if m:
                    err = ((out[e, :m].double() - ref[e, :m]).norm() / ref[e, :m].norm()).item()
                    assert err < 4e-3, (cfg, mode, e, err)
            if mode == sg.SIGNAL_SGLANG:
                assert torch.equal(sig, sg.reference_sglang_signal(masked_m, M, N, cfg.block_m, cfg.block_n))
            if mode == sg.SIGNAL_DEEPEP:
                assert torch.equal(sig, sg.reference_deepep_signal(E, 5))
    # The DeepGEMM-compatible entry point: its returned pair in each layout (threshold = ceil(200 / 64)).
    gemm = lambda **kw: sg.fp8_m_grouped_gemm_nt_masked((a, a_scale), (b, b_scale), out, masked_m, 32, num_sms=5,
                                                        config=sg.GemmConfig(block_m=64, block_n=64), **kw)
    assert gemm() == (None, None)
    assert gemm(enable_overlap=True, signal=torch.zeros(E * 2, dtype=torch.int32)) == (64, 4)
    assert gemm(enable_overlap=True, signal=torch.zeros(E, dtype=torch.int32), signal_layout="deepep") == (5, 5)
    print("ok")
    """
)


def test_interpreter_smoke():
    """FP8 path, both signal layouts and the TMA variant, on the CPU through TRITON_INTERPRET=1.
    (The interpreter's bf16 dot is wrong on CPU in triton 3.9, so the bf16 variant is GPU-only.)"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    helpers = "".join(inspect.getsource(f) for f in (quantize_activations, quantize_weights))
    script = "import torch\n" + helpers + _INTERPRETER_SCRIPT
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# %%
# The warp-specialized Gluon kernel (kernels/signal_gemm_ws.py): same contract
# ---------------------------------------------------------------------------


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# (block_m, block_n, num_stages)
# 128x192 covers the split tile (a 128- and a 64-column part, in either order), and with N = 7168,
# 200 and 512 a last tile whose wide or narrow part lies past N.
WS_CONFIGS = [(64, 256, 4), (64, 256, 3), (128, 128, 5), (128, 192, 4), (128, 192, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("tile", WS_CONFIGS, ids=lambda t: "{}x{}s{}".format(*t))
@pytest.mark.parametrize("mode", [sg.SIGNAL_NONE, sg.SIGNAL_SGLANG, sg.SIGNAL_DEEPEP])
def test_ws_fp8_masked_gemm(shape, mask, tile, mode):
    E, M_max, N, K = shape
    config = sg.WsConfig(*tile)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, mask, tile, mode, "ws")).encode()))
    masked_m = masked_m_for(mask, E, M_max, gen)
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    a_scale = a_scale.transpose(1, 2).contiguous().transpose(1, 2)  # MN-major, as sglang passes them
    signal = signal_buffer(mode, E, M_max, config.block_m)
    out = poisoned(E, M_max, N)
    result = sg.masked_grouped_gemm(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal, signal_mode=mode, num_sms=7, config=config
    )
    torch.cuda.synchronize()
    check_output(out, sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale), masked_m, FP8_RTOL)
    check_signals(result, signal, mode, config, masked_m, M_max, N, num_programs=7)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("tile", WS_CONFIGS, ids=lambda t: "{}x{}s{}".format(*t))
def test_ws_scales_spanning_ten_decades_and_zero(tile):
    """Scales from 1e-14 to 1e3 per element, changing every K step, and zero scales: the products
    the producer stages in shared memory must give each row its own relative accuracy."""
    E, M_max, N, K = 2, 128, 512, 2048
    gen = torch.Generator(device="cuda").manual_seed(11)
    a = (torch.randn(E, M_max, K, device="cuda", generator=gen) * 32).to(torch.float8_e4m3fn)
    b = (torch.randn(E, N, K, device="cuda", generator=gen) * 32).to(torch.float8_e4m3fn)
    a_scale = 10 ** torch.empty(E, M_max, K // 128, device="cuda").uniform_(-8, 2, generator=gen)
    b_scale = 10 ** torch.empty(E, N // 128, K // 128, device="cuda").uniform_(-6, 1, generator=gen)
    a_scale[torch.rand(a_scale.shape, device="cuda", generator=gen) < 0.1] = 0.0
    a_scale[0, 5] = 0.0  # a row whose every block has a zero scale: exactly zero
    b_scale[1, 2] = 0.0  # expert 1's columns 256..383: exactly zero
    a_scale = a_scale.transpose(1, 2).contiguous().transpose(1, 2)
    masked_m = torch.tensor([128, 77], dtype=torch.int32, device="cuda")
    config = sg.WsConfig(*tile)
    out = poisoned(E, M_max, N)
    sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, num_sms=7, config=config)
    torch.cuda.synchronize()
    ref = sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale)
    check_output(out, ref, masked_m, FP8_RTOL)
    assert not out[0, 5].any() and not out[1, :77, 256:384].any(), "a zero scale must give exact zeros"
    for e, m in enumerate(masked_m.tolist()):  # row by row: the rows' magnitudes span decades
        got, want = out[e, :m].double(), ref[e, :m].double()
        nonzero = want.norm(dim=1) > 0
        err = (got - want)[nonzero].norm(dim=1) / want[nonzero].norm(dim=1)
        assert err.max().item() < FP8_RTOL, f"expert {e}: a row's relative error is {err.max().item():.2e}"


def test_ws_config_refuses_tiles_its_math_warpgroups_cannot_hold():
    with pytest.raises(AssertionError, match="the tile is 64x256, 128x128 or 128x192"):
        sg.WsConfig(block_m=128, block_n=256)  # 128 accumulator + 128 product registers a thread
    with pytest.raises(AssertionError, match="split in two halves"):
        sg.WsConfig(block_m=64, block_n=128)
    with pytest.raises(AssertionError, match="unsupported configuration"):
        sg.WsConfig(block_m=64, block_n=192)
    with pytest.raises(AssertionError, match="more than an SM's 65536"):
        sg.WsConfig(storer_warps=4, storer_regs=40)  # 59392 + 1280 + 5120
    with pytest.raises(AssertionError, match="storer_warps must be 1, 2 or 4"):
        sg.WsConfig(storer_warps=3)


def test_ws_pick_by_rows_and_signal_layout():
    """The measured choices (kernels/README.md), the same in every signal layout: the 64x256 tile up
    to 64 rows and 128x192 above; under sglang's max_block_n=160 the 128x128 one above 64 rows and
    the Triton kernel's 128-column tiles below."""
    for mode in (sg.SIGNAL_NONE, sg.SIGNAL_SGLANG, sg.SIGNAL_DEEPEP):
        for m in (1, 8, 16, 32, 64):
            assert sg.pick_config(m, signal_mode=mode, warp_specialized=True) == sg.WsConfig(64, 256, 4)
        for m in (65, 96, 128, 512):
            assert sg.pick_config(m, signal_mode=mode, warp_specialized=True) == sg.WsConfig(128, 192, 4)
            assert sg.pick_config(m, 160, signal_mode=mode, warp_specialized=True) == sg.WsConfig(128, 128, 4)
    narrow = sg.pick_config(64, max_block_n=160, warp_specialized=True)
    assert isinstance(narrow, sg.GemmConfig) and narrow.block_n == 128


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (wgmma)")
def test_default_config_is_warp_specialized():
    """What sglang's call gets on sm_90: the Gluon kernel."""
    assert sg.ws_usable(0)
    assert isinstance(sg.pick_config(8, warp_specialized=True), sg.WsConfig)
    E, M_max, N, K = 4, 128, 7168, 2048
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    masked_m = torch.tensor([5, 64, 0, 128], dtype=torch.int32, device="cuda")
    out = poisoned(E, M_max, N)
    signal = torch.zeros(E * 2, dtype=torch.int32, device="cuda")
    assert sg.fp8_m_grouped_gemm_nt_masked(
        (a, a_scale), (b, b_scale), out, masked_m, 64, enable_overlap=True, signal=signal
    ) == (64, -(-N // 256))
    torch.cuda.synchronize()
    check_output(out, sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale), masked_m, FP8_RTOL)
    assert torch.equal(signal.cpu(), sg.reference_sglang_signal(masked_m, M_max, N, 64, 256))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (wgmma)")
@pytest.mark.parametrize("mode", [sg.SIGNAL_SGLANG, sg.SIGNAL_DEEPEP])
def test_ws_idle_programs_still_signal(mode):
    """With expected_m the Gluon kernel splits 112 tiles over 14 of 15 programs (8 each); the idle
    one must still count itself in for every expert in DeepEP's layout."""
    E, M_max, N, K = 4, 128, 7168, 2048
    a, a_scale, b, b_scale = make_fp8_problem(E, M_max, N, K)
    masked_m = torch.tensor([64, 1, 0, 64], dtype=torch.int32, device="cuda")
    config = sg.WsConfig(block_m=64, block_n=256, num_stages=4)
    signal = torch.zeros(E * 2 if mode == sg.SIGNAL_SGLANG else E, dtype=torch.int32, device="cuda")
    out = poisoned(E, M_max, N)
    result = sg.masked_grouped_gemm(
        a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal, signal_mode=mode,
        num_sms=15, config=config, expected_m=64,
    )  # fmt: skip
    torch.cuda.synchronize()
    check_output(out, sg.reference_masked_grouped_gemm(a, b, masked_m, a_scale, b_scale), masked_m, FP8_RTOL)
    if mode == sg.SIGNAL_DEEPEP:
        assert result == (15, 15)
        assert torch.equal(signal.cpu(), sg.reference_deepep_signal(E, 15))
    else:
        assert torch.equal(signal.cpu(), sg.reference_sglang_signal(masked_m, M_max, N, 64, 256))
