"""Benchmark the sm_90 signal down GEMM (kernels/signal_gemm.py) on DeepSeek-V3 decode shapes.

For E = 16 and 32 local experts (M_max = 2048 and 1024 rows, as DeepEP's low-latency buffers for
16 and 8 ranks), K = 2048, N = 7168, FP8 with 1×128 / 128×128 scales, every expert at m rows
(m = 8 … 128), it reports in one run:

* our kernel's time without signals (on the SMs SBO leaves it, and on all of them), with
  sglang-layout signals and with DeepEP-layout signals, each with the configuration
  ``pick_config`` gives that layout on this GPU (on sm_90 the warp-specialized Gluon kernel), and
  the signals' cost against the same tile without them;
* beside it, the Triton kernel's tile without signals ("Triton"), to show what the Gluon kernel
  gains;
* bytes moved (weights + weight scales + active activation rows + their scales + active output
  rows) over time, against the device's measured copy bandwidth (read + write);
* baselines: torch dequantize + bmm, ``torch._scaled_mm`` per expert, and DeepGEMM's
  ``fp8_m_grouped_gemm_nt_masked`` (sgl-deep-gemm 0.1.4) when importable.

Every time is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``): sglang's
decode runs these kernels inside CUDA graphs, and without a graph Python's launch overhead would
show in the events. Ours and DeepGEMM's are then the median of ``--rounds`` such timings taken in
interleaved rounds. The activation scales are MN-major for every kernel, as sglang hands them to
the down GEMM. ``benchmarks/sweep_sbo_gemm.py`` is the search that chose the configurations.

    python benchmarks/bench_sbo_gemm.py --json out.json

It imports the installed package (``pip install -e .``, or ``pip install --target DIR .`` with
``PYTHONPATH=DIR``); its JSON carries the command, GPU, date and versions of the run, as the
logs in ``benchmarks/results/`` do.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shlex
import statistics
import sys
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from sglang_pd.kernels import signal_gemm as sg

N, K = 7168, 2048
EXPERTS = {16: 2048, 32: 1024}  # E → M_max
M_VALUES = (8, 16, 32, 64, 128)


def run_info() -> dict:
    """How and where this run was made: the header of every JSON log these scripts write."""
    return {
        "command": shlex.join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def bench(fn, rep_ms: int = 30) -> float:
    """Median µs per call over CUDA-graph replays."""
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1e3


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s), 2 GiB buffers. The GPU idles
    at 345 MHz; two seconds of copies first bring its clocks up (on the H200 a cold first reading
    came out at 2.8 TB/s, warm ones at 4.1 TB/s)."""
    src = torch.empty(2**30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    t_end = time.time() + 2.0
    while time.time() < t_end:
        for _ in range(50):
            dst.copy_(src)
        torch.cuda.synchronize()
    us_torch = bench(lambda: dst.copy_(src), rep_ms=200)
    s32, d32 = src.view(torch.int32), dst.view(torch.int32)
    n = s32.numel()
    us_triton = bench(lambda: _copy_kernel[(triton.cdiv(n, 8192),)](s32, d32, n, BLOCK=8192, num_warps=8), rep_ms=200)
    # Two kernels, take the faster: the ceiling is the memory system's, not one copy routine's.
    return 2 * src.numel() * 2 / (min(us_torch, us_triton) * 1e-6) / 1e9


# %%
# Problem and baselines
# ---------------------


def make_problem(E: int, M_max: int):
    x = torch.randn(E, M_max, K, device="cuda")
    a = x.view(E, M_max, K // 128, 128)
    a_scale = a.abs().amax(-1).clamp(min=1e-4) / 448.0
    a = (a / a_scale[..., None]).view(E, M_max, K).to(torch.float8_e4m3fn)
    a_scale = a_scale.transpose(1, 2).contiguous().transpose(1, 2)  # MN-major, as sglang hands it over
    del x
    w = torch.randn(E, N, K, device="cuda").view(E, N // 128, 128, K // 128, 128)
    b_scale = w.abs().amax(dim=(2, 4)).clamp(min=1e-4) / 448.0
    b = (w / b_scale[:, :, None, :, None]).view(E, N, K).to(torch.float8_e4m3fn)
    del w
    return a, a_scale, b, b_scale


def torch_dequant_bmm(a, a_scale, b, b_scale, m):
    """What a plain-torch fallback does: dequantize to bf16, then one batched matmul."""
    a_d = (a[:, :m].float() * a_scale[:, :m].repeat_interleave(128, dim=2)).bfloat16()
    b_d = (b.float() * b_scale.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)).bfloat16()
    return torch.bmm(a_d, b_d.transpose(1, 2))


def scaled_mm_variants(a, a_scale, b, b_scale, m):
    """Ways to call ``torch._scaled_mm`` per expert, most faithful first: blockwise 1×128 / 128×128
    scales (cuBLASLt on sm_90), then row-wise scales (a different quantization: a speed baseline)."""
    E = a.shape[0]
    mp = max(16, -(-m // 16) * 16)  # cuBLASLt wants rows in multiples of 16
    rows_a = [a[e, :mp] for e in range(E)]
    cols_b = [b[e].t() for e in range(E)]  # [K, N], column-major

    def blockwise():
        sa = [a_scale[e, :mp].t().contiguous().t() for e in range(E)]  # [mp, K/128], M-major
        sb = [b_scale[e].t() for e in range(E)]  # [K/128, N/128] view of [N/128, K/128]
        return lambda: [
            torch._scaled_mm(rows_a[e], cols_b[e], sa[e], sb[e], out_dtype=torch.bfloat16) for e in range(E)
        ]

    def blockwise_nk():
        sa = [a_scale[e, :mp].t().contiguous().t() for e in range(E)]
        sb = [b_scale[e] for e in range(E)]  # [N/128, K/128]
        return lambda: [
            torch._scaled_mm(rows_a[e], cols_b[e], sa[e], sb[e], out_dtype=torch.bfloat16) for e in range(E)
        ]

    def rowwise():
        sa = [a_scale[e, :mp].amax(1, keepdim=True) for e in range(E)]
        sb = [b_scale[e].amax(1).repeat_interleave(128)[None, :].contiguous() for e in range(E)]
        return lambda: [
            torch._scaled_mm(rows_a[e], cols_b[e], sa[e], sb[e], out_dtype=torch.bfloat16) for e in range(E)
        ]

    return [("blockwise", blockwise), ("blockwise_nk", blockwise_nk), ("rowwise", rowwise)]


def load_deep_gemm():
    try:
        import deep_gemm

        return deep_gemm, None
    except Exception as exc:  # the baseline is optional: report why it is missing
        return None, f"{type(exc).__name__}: {exc}"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def unsignalled(config):
    """The same tile without the signal-release knob (the Gluon kernel has none)."""
    return dataclasses.replace(config, signal_asm=False) if isinstance(config, sg.GemmConfig) else config


def measure(E: int, m: int, problem: tuple, num_sms: int, sig_sms: int, deep_gemm, log, rounds: int) -> dict:
    """All timings and errors of one shape. Our variants and DeepGEMM are timed in ``rounds``
    interleaved rounds and each keeps the median of its rounds: one timing each measured up to 6 %
    apart between two runs of the same kernel on the H200, enough to flip a 3 % signal cost."""
    a, a_scale, b, b_scale, masked_m, out = problem
    M_max = a.shape[1]
    ws = sg.ws_usable(0)  # what the entry point picks on this GPU: on sm_90 the Gluon kernel
    plain = sg.pick_config(m, warp_specialized=ws)
    for_sglang = sg.pick_config(m, signal_mode=sg.SIGNAL_SGLANG, warp_specialized=ws)
    for_deepep = sg.pick_config(m, signal_mode=sg.SIGNAL_DEEPEP, warp_specialized=ws)
    triton_only = sg.pick_config(m)  # the Triton kernel's tile, for the side-by-side column
    row: dict = {"E": E, "m": m, "config": repr(plain), "sglang_config": repr(for_sglang)}
    row["triton_config"] = repr(triton_only)
    row["bytes"] = E * N * K + b_scale.numel() * 4 + E * m * K + E * m * (K // 128) * 4 + E * m * N * 2
    ref = sg.reference_masked_grouped_gemm(a[:, :m], b, masked_m, a_scale[:, :m], b_scale, dtype=torch.float32)
    signals = {
        sg.SIGNAL_NONE: None,
        sg.SIGNAL_SGLANG: torch.zeros(E * -(-M_max // for_sglang.block_m), dtype=torch.int32, device="cuda"),
        sg.SIGNAL_DEEPEP: torch.zeros(E, dtype=torch.int32, device="cuda"),
    }

    # name -> (configuration, signal layout, programs)
    variants = {
        "plain": (plain, sg.SIGNAL_NONE, sig_sms),  # what the DeepEP layout's signals cost is measured against
        "plain_all_sms": (plain, sg.SIGNAL_NONE, num_sms),
        "triton": (triton_only, sg.SIGNAL_NONE, sig_sms),
        "rows64": (unsignalled(for_sglang), sg.SIGNAL_NONE, sig_sms),  # sglang's tile
        "sig_sglang": (for_sglang, sg.SIGNAL_SGLANG, sig_sms),
        "sig_deepep": (for_deepep, sg.SIGNAL_DEEPEP, sig_sms),
    }
    runs = {
        name: functools.partial(
            sg.masked_grouped_gemm,
            a,
            b,
            out,
            masked_m,
            a_scale=a_scale,
            b_scale=b_scale,
            config=config,
            num_sms=programs,
            signal=signals[mode],
            signal_mode=mode,
            expected_m=m,  # as sglang passes it
        )
        for name, (config, mode, programs) in variants.items()
    }
    for name, fn in runs.items():
        signal = signals[variants[name][1]]
        if signal is not None:
            signal.zero_()
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        row[f"{name}_err"] = rel_err(out[:, :m], ref)
        if signal is not None:  # the final counters of one run, before timing reruns add to them
            row[f"{name}_signals"] = sorted(set(signal.tolist()))
    timed = dict(runs)

    try:
        row["torch_bmm_us"] = bench(lambda: torch_dequant_bmm(a, a_scale, b, b_scale, m))
    except Exception as exc:
        row["torch_bmm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for method, make in scaled_mm_variants(a, a_scale, b, b_scale, m):
        try:
            fn = make()
            outs = fn()
            torch.cuda.synchronize()
            row["scaled_mm_method"], row["scaled_mm_err"] = method, rel_err(torch.stack([o[:m] for o in outs]), ref)
            row["scaled_mm_us"] = bench(fn)
            break
        except Exception as exc:
            row[f"scaled_mm_{method}_error"] = f"{type(exc).__name__}: {exc}"[:300]

    if deep_gemm is not None:
        try:
            a_sf = deep_gemm.get_mn_major_tma_aligned_tensor(a_scale)
            dg_out = torch.empty_like(out)
            fn = functools.partial(deep_gemm.fp8_m_grouped_gemm_nt_masked, (a, a_sf), (b, b_scale), dg_out, masked_m, m)
            fn()
            torch.cuda.synchronize()
            row["deepgemm_err"] = rel_err(dg_out[:, :m], ref)
            timed["deepgemm"] = fn
        except Exception as exc:
            row["deepgemm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(traceback.format_exc()[-1500:])

    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            samples[name].append(bench(fn))
    for name, times in samples.items():
        row[f"{name}_us"] = statistics.median(times)
        row[f"{name}_us_rounds"] = times
    row["sig_sglang_cost"] = row["sig_sglang_us"] / row["rows64_us"] - 1
    row["sig_deepep_cost"] = row["sig_deepep_us"] / row["plain_us"] - 1
    return row


# %%
# Main
# ----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--log", type=Path, default=None, help="write the log and the table here")
    parser.add_argument("--experts", type=int, nargs="*", default=list(EXPERTS))
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds; each time is their median")
    args = parser.parse_args()

    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        print(line, flush=True)

    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    sig_sms = num_sms - sg.SMS_KEPT_FOR_COMMUNICATION
    bw_before = copy_bandwidth()
    log(f"device: {props.name}, {num_sms} SMs; torch {torch.__version__}, triton {triton.__version__}")
    log(f"copy bandwidth (read + write): {bw_before:.0f} GB/s")
    deep_gemm, dg_error = load_deep_gemm()
    log(f"DeepGEMM: {getattr(deep_gemm, '__version__', 'loaded') if deep_gemm else dg_error}")

    rows = []
    for E in args.experts:
        M_max = EXPERTS[E]
        a, a_scale, b, b_scale = make_problem(E, M_max)
        for m in args.m:
            masked_m = torch.full((E,), m, dtype=torch.int32, device="cuda")
            out = torch.empty(E, M_max, N, dtype=torch.bfloat16, device="cuda")
            problem = (a, a_scale, b, b_scale, masked_m, out)
            row = measure(E, m, problem, num_sms, sig_sms, deep_gemm, log, args.rounds)
            rows.append(row)
            log(json.dumps(row))

    bw_after = copy_bandwidth()
    bw = max(bw_before, bw_after)
    log(f"copy bandwidth after the runs: {bw_after:.0f} GB/s; using {bw:.0f} GB/s")

    def pct(row: dict, us: float) -> float:
        return 100 * row["bytes"] / (us * 1e-6) / 1e9 / bw

    header = (
        f"{'E':>3} {'m':>4} | {'plain':>6} {'bw%':>5} {'all SMs':>7} {'Triton':>6} {'T/plain':>7} |"
        f" {'rows64':>6} {'sig a':>6} {'cost':>6} |"
        f" {'sig b':>6} {'cost':>6} | {'DeepGEMM':>8} {'bw%':>5} {'DG/plain':>8} {'DG/all':>6} {'DG/sig b':>8} |"
        f" {'torch bmm':>9} | {'scaled_mm':>9}"
    )
    lines = [
        f"{props.name}, copy bandwidth {bw:.0f} GB/s; times in µs (median of CUDA-graph replays)",
        header,
        "-" * len(header),
    ]
    for row in rows:
        t, dg = row["plain_us"], row.get("deepgemm_us")
        ratios = (
            f" {dg:>8.1f} {pct(row, dg):>5.1f} {dg / t:>7.2f}x {dg / row['plain_all_sms_us']:>5.2f}x"
            f" {dg / row['sig_deepep_us']:>7.2f}x |"
            if dg
            else f" {'-':>8} {'-':>5} {'-':>8} {'-':>6} {'-':>8} |"
        )
        lines.append(
            f"{row['E']:>3} {row['m']:>4} | {t:>6.1f} {pct(row, t):>5.1f} {row['plain_all_sms_us']:>7.1f}"
            f" {row['triton_us']:>6.1f} {row['triton_us'] / t:>6.2f}x |"
            f" {row['rows64_us']:>6.1f} {row['sig_sglang_us']:>6.1f} {100 * row['sig_sglang_cost']:>+5.1f}% |"
            f" {row['sig_deepep_us']:>6.1f} {100 * row['sig_deepep_cost']:>+5.1f}% |"
            + ratios
            + f" {row.get('torch_bmm_us', float('nan')):>9.1f} | {row.get('scaled_mm_us', float('nan')):>9.1f}"
        )
    lines.append("")
    for row in rows:
        lines.append(
            f"{row['E']:>3} {row['m']:>4} | plain, sig b: {row['config']} | rows64, sig a: {row['sglang_config']}"
            f" | Triton: {row['triton_config']}"
        )
    spread = [(max(r["plain_us_rounds"]) / min(r["plain_us_rounds"]) - 1) * 100 for r in rows]
    errors = [r[k] for r in rows for k in r if k.endswith("_err")]
    signals = sorted({v for r in rows for k in r if k.endswith("_signals") for v in r[k]})
    lines.append(f"largest relative error against the fp32 reference, any kernel: {max(errors):.2e}")
    lines.append(f"final signal values seen (sglang: ceil(N/block_n), 28 or 38; DeepEP: {sig_sms} programs): {signals}")
    lines.append(
        f"spread of the no-signal kernel over {args.rounds} rounds (slowest / fastest): median"
        f" {statistics.median(spread):.1f} %, max {max(spread):.1f} %"
    )
    lines.append(f"scaled_mm method: {sorted({r.get('scaled_mm_method', 'failed') for r in rows})}")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(
            json.dumps({**run_info(), "device": props.name, "copy_gbps": bw, "rows": rows, "table": table}, indent=1)
        )
    if args.log:
        args.log.write_text("\n".join(log_lines) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
