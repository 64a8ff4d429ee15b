"""Benchmark the sm_90 signal down GEMM (kernels/signal_gemm.py) on DeepSeek-V3 decode shapes.

For E = 16 and 32 local experts (M_max = 2048 and 1024 rows, as DeepEP's low-latency buffers for
16 and 8 ranks), K = 2048, N = 7168, FP8 with 1×128 / 128×128 scales, every expert at m rows
(m = 8 … 128), it reports in one run:

* the Triton kernel's time without signals, with sglang-layout signals and with DeepEP-layout
  signals, and the signals' cost against the same kernel without them;
* bytes moved (weights + weight scales + active activation rows + their scales + active output
  rows) over time, against the device's measured copy bandwidth (read + write);
* baselines: torch dequantize + bmm, ``torch._scaled_mm`` per expert, and DeepGEMM's
  ``fp8_m_grouped_gemm_nt_masked`` (sgl-deep-gemm 0.1.4) when importable.

Every time is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``): sglang's
decode runs these kernels inside CUDA graphs, and without a graph Python's launch overhead would
show in the events. ``--sweep`` first times every configuration of
``get_signal_gemm_configs()`` and then uses the best per shape.

    python scripts/bench_sbo_gemm.py --json out.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

try:
    from sglang_pd.kernels import signal_gemm as sg
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels import signal_gemm as sg

N, K = 7168, 2048
EXPERTS = {16: 2048, 32: 1024}  # E → M_max
M_VALUES = (8, 16, 32, 64, 128)


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
    at 345 MHz; two seconds of copies first bring its clocks up (a cold first reading came out at
    2.8 TB/s, a warm one at the 4.3 TB/s KINDS.md records)."""
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


# %%
# Sweep
# -----


def _compile_one(cfg: sg.GemmConfig) -> str:
    """Compile (and run once) one configuration on a tiny problem whose sizes and strides have the
    same divisibility as the benchmark's, so the binary lands in Triton's on-disk cache."""
    try:
        E, M, n, k = 16, 64, 256, K
        a = torch.zeros(E, M, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.zeros(E, n, k, device="cuda").to(torch.float8_e4m3fn)
        a_scale = torch.ones(E, M, k // 128, device="cuda")
        b_scale = torch.ones(E, n // 128, k // 128, device="cuda")
        out = torch.empty(E, M, n, dtype=torch.bfloat16, device="cuda")
        masked_m = torch.full((E,), 8, dtype=torch.int32, device="cuda")
        sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg, num_sms=8)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(configs: list[sg.GemmConfig], log, workers: int = 12) -> None:
    """Triton compiles one kernel at a time per process; spread the sweep's over processes."""
    import multiprocessing

    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_compile_one, configs, chunksize=1)
    failed = [f"{c}: {r}" for c, r in zip(configs, results, strict=True) if r != "ok"]
    log(f"precompiled {len(configs)} configurations in {time.time() - t0:.0f} s; failed: {failed}")


def sweep(problems, log) -> dict:
    """Time every candidate configuration (no signals) on a few shapes; best per (E, m)."""
    best = {}
    configs = sg.get_signal_gemm_configs()
    for (E, m), (a, a_scale, b, b_scale, masked_m, out) in problems.items():
        if m not in (16, 64, 128):
            continue
        results = []
        for cfg in configs:
            if cfg.block_m > 64 and m <= 64:
                continue
            try:
                t0 = time.time()
                fn = functools.partial(
                    sg.masked_grouped_gemm, a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=cfg
                )
                us = bench(fn, rep_ms=15)
                results.append((us, cfg))
                log(f"sweep E={E} m={m} {cfg}: {us:.1f} us ({time.time() - t0:.1f} s)")
            except Exception as exc:
                log(f"sweep E={E} m={m} {cfg}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
        results.sort(key=lambda r: r[0])
        best[(E, m)] = results[0][1]
        unflat = [c for _, c in results if not c.flatten]
        if unflat:
            best[("unflat", E, m)] = unflat[0]
        log(f"BEST E={E} m={m}: " + "; ".join(f"{us:.1f} {c}" for us, c in results[:5]))
    return best


def measure(E, m, problem, cfg, unflat, num_sms, sig_sms, deep_gemm, log) -> dict:
    """All timings and errors of one shape."""
    a, a_scale, b, b_scale, masked_m, out = problem
    M_max = a.shape[1]
    row: dict = {"E": E, "m": m, "config": repr(cfg)}
    bytes_moved = E * N * K + b_scale.numel() * 4 + E * m * K + E * m * (K // 128) * 4 + E * m * N * 2
    row["bytes"] = bytes_moved
    ref = sg.reference_masked_grouped_gemm(a[:, :m], b, masked_m, a_scale[:, :m], b_scale, dtype=torch.float32)

    sig_a = torch.zeros(E * -(-M_max // cfg.block_m), dtype=torch.int32, device="cuda")
    sig_b = torch.zeros(E, dtype=torch.int32, device="cuda")

    def run(config, mode=sg.SIGNAL_NONE, programs=sig_sms):
        signal = {sg.SIGNAL_NONE: None, sg.SIGNAL_SGLANG: sig_a, sg.SIGNAL_DEEPEP: sig_b}[mode]
        return functools.partial(
            sg.masked_grouped_gemm,
            a,
            b,
            out,
            masked_m,
            a_scale=a_scale,
            b_scale=b_scale,
            config=config,
            num_sms=programs,
            signal=signal,
            signal_mode=mode,
        )

    asm = dataclasses.replace(cfg, signal_asm=True)
    variants = {
        "triton": run(cfg),
        "triton_all_sms": run(cfg, programs=num_sms),
        "triton_sig_sglang": run(cfg, sg.SIGNAL_SGLANG),
        "triton_sig_deepep": run(cfg, sg.SIGNAL_DEEPEP),
        "triton_asm_sglang": run(asm, sg.SIGNAL_SGLANG),
        "triton_asm_deepep": run(asm, sg.SIGNAL_DEEPEP),
    }
    if unflat is not None:
        unflat_asm = dataclasses.replace(unflat, signal_asm=True)
        variants.update(
            {
                "unflat": run(unflat),
                "unflat_sig_sglang": run(unflat, sg.SIGNAL_SGLANG),
                "unflat_sig_deepep": run(unflat, sg.SIGNAL_DEEPEP),
                "unflat_asm_sglang": run(unflat_asm, sg.SIGNAL_SGLANG),
                "unflat_asm_deepep": run(unflat_asm, sg.SIGNAL_DEEPEP),
            }
        )
        row["unflat_config"] = repr(unflat)
    for name, fn in variants.items():
        try:
            row[f"{name}_us"] = bench(fn)
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"E={E} m={m} {name}: {row[f'{name}_error']}")
    # The best signalled variant of each layout, and its cost against the best unsignalled one.
    plain = min(row[k] for k in ("triton_us", "unflat_us") if k in row)
    for layout in ("sglang", "deepep"):
        keys = [k for k in row if k.endswith(f"_{layout}_us")]
        best_key = min(keys, key=lambda k: row[k])
        row[f"best_{layout}"] = best_key.removesuffix("_us")
        row[f"best_{layout}_us"] = row[best_key]
        row[f"best_{layout}_cost"] = row[best_key] / plain - 1
        # Check the chosen variant's output and signals once.
        sig = sig_a if layout == "sglang" else sig_b
        sig.zero_()
        out.fill_(float("nan"))
        variants[best_key.removesuffix("_us")]()
        torch.cuda.synchronize()
        row[f"best_{layout}_err"] = rel_err(out[:, :m], ref)
        row[f"best_{layout}_signals"] = sorted(set(sig.tolist()))
    row["plain_us"] = plain
    # Time the no-signal kernel twice (first and last) to see the run-to-run spread.
    row["triton_us_again"] = bench(variants["triton"])
    variants["triton"]()
    torch.cuda.synchronize()
    row["triton_err"] = rel_err(out[:, :m], ref)

    try:
        row["torch_bmm_us"] = bench(lambda: torch_dequant_bmm(a, a_scale, b, b_scale, m))
    except Exception as exc:
        row["torch_bmm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    for method, make in scaled_mm_variants(a, a_scale, b, b_scale, m):
        try:
            fn = make()
            outs = fn()
            torch.cuda.synchronize()
            err = rel_err(torch.stack([o[:m] for o in outs]), ref)
            row["scaled_mm_method"], row["scaled_mm_err"] = method, err
            row["scaled_mm_us"] = bench(fn)
            break
        except Exception as exc:
            row[f"scaled_mm_{method}_error"] = f"{type(exc).__name__}: {exc}"[:300]

    if deep_gemm is not None:
        try:
            a_sf = deep_gemm.get_mn_major_tma_aligned_tensor(a_scale)
            dg_out = torch.empty_like(out)
            fn = lambda: deep_gemm.fp8_m_grouped_gemm_nt_masked(  # noqa: E731
                (a, a_sf), (b, b_scale), dg_out, masked_m, m
            )
            fn()
            torch.cuda.synchronize()
            row["deepgemm_err"] = rel_err(dg_out[:, :m], ref)
            row["deepgemm_us"] = bench(fn)
        except Exception as exc:
            row["deepgemm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(traceback.format_exc()[-1500:])
    return row


# %%
# Main
# ----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write all numbers here")
    parser.add_argument("--log", type=Path, default=None, help="write the sweep log here")
    parser.add_argument("--sweep", action="store_true", help="sweep configurations first")
    parser.add_argument("--experts", type=int, nargs="*", default=list(EXPERTS))
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    args = parser.parse_args()

    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        print(line, flush=True)

    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    sig_sms = num_sms - sg.SMS_KEPT_FOR_COMMUNICATION
    bw_before = copy_bandwidth()
    bw = bw_before
    log(f"device: {props.name}, {num_sms} SMs; torch {torch.__version__}, triton {triton.__version__}")
    log(f"copy bandwidth (read + write): {bw:.0f} GB/s")
    deep_gemm, dg_error = load_deep_gemm()
    log(f"DeepGEMM: {getattr(deep_gemm, '__version__', 'loaded') if deep_gemm else dg_error}")

    problems = {}
    for E in args.experts:
        M_max = EXPERTS[E]
        a, a_scale, b, b_scale = make_problem(E, M_max)
        for m in args.m:
            masked_m = torch.full((E,), m, dtype=torch.int32, device="cuda")
            out = torch.empty(E, M_max, N, dtype=torch.bfloat16, device="cuda")
            problems[(E, m)] = (a, a_scale, b, b_scale, masked_m, out)

    if args.sweep:
        precompile(sg.get_signal_gemm_configs(), log)
    best = sweep(problems, log) if args.sweep else {}

    def config_for(E: int, m: int, prefix: tuple = ()) -> sg.GemmConfig | None:
        keys = [k[len(prefix) :] for k in best if k[: len(prefix)] == prefix and len(k) == len(prefix) + 2]
        keys = [k for k in keys if isinstance(k[0], int) and k[0] == E]
        if not keys:
            return None if prefix else sg.pick_config(m)
        key = min((k for k in keys if k[1] >= m), default=max(keys))
        return best[prefix + key]

    rows = []
    for (E, m), problem in problems.items():
        unflat = config_for(E, m, ("unflat",)) or dataclasses.replace(
            sg.pick_config(m), flatten=False, signal_asm=False
        )
        row = measure(E, m, problem, config_for(E, m), unflat, num_sms, sig_sms, deep_gemm, log)
        rows.append(row)
        log(json.dumps(row))

    bw_after = copy_bandwidth()
    bw = max(bw_before, bw_after)
    log(f"copy bandwidth after the runs: {bw_after:.0f} GB/s; using {bw:.0f} GB/s")

    # The table.
    def pct(us):
        return 100 * row["bytes"] / (us * 1e-6) / 1e9 / bw

    header = (
        f"{'E':>3} {'m':>4} | {'plain':>6} {'bw%':>5} | {'sig a':>6} {'cost':>6} | {'sig b':>6} {'cost':>6} |"
        f" {'DeepGEMM':>8} {'bw%':>5} {'DG/plain':>8} {'DG/sig a':>8} | {'torch bmm':>9} | {'scaled_mm':>9}"
    )
    lines = [
        f"{props.name}, copy bandwidth {bw:.0f} GB/s; times in µs (median of CUDA-graph replays)",
        header,
        "-" * len(header),
    ]
    for row in rows:
        t = row["plain_us"]
        ta, tb = row["best_sglang_us"], row["best_deepep_us"]
        dg = row.get("deepgemm_us")
        lines.append(
            f"{row['E']:>3} {row['m']:>4} | {t:>6.1f} {pct(t):>5.1f} |"
            f" {ta:>6.1f} {100 * row['best_sglang_cost']:>+5.1f}% |"
            f" {tb:>6.1f} {100 * row['best_deepep_cost']:>+5.1f}% |"
            + (
                f" {dg:>8.1f} {pct(dg):>5.1f} {dg / t:>7.2f}x {dg / ta:>7.2f}x |"
                if dg
                else f" {'-':>8} {'-':>5} {'-':>8} {'-':>8} |"
            )
            + f" {row.get('torch_bmm_us', float('nan')):>9.1f} | {row.get('scaled_mm_us', float('nan')):>9.1f}"
        )
    names = [k.removesuffix("_us") for k in rows[0] if k.startswith(("triton", "unflat")) and k.endswith("_us")]
    lines.append("")
    lines.append("every variant (µs): " + ", ".join(names))
    for row in rows:
        lines.append(
            f"{row['E']:>3} {row['m']:>4} | "
            + " ".join(f"{row.get(n + '_us', float('nan')):>6.1f}" for n in names)
            + f" | best a: {row['best_sglang']}, best b: {row['best_deepep']}"
        )
    lines.append("")
    for row in rows:
        lines.append(f"{row['E']:>3} {row['m']:>4} | flat: {row['config']} | unflat: {row.get('unflat_config')}")
    spread = [abs(r["triton_us_again"] / r["triton_us"] - 1) * 100 for r in rows]
    errors = [r[k] for r in rows for k in r if k.endswith("_err")]
    lines.append(f"largest relative error against the fp32 reference, any kernel: {max(errors):.2e}")
    lines.append(
        f"run-to-run spread of the no-signal kernel: median {statistics.median(spread):.1f} %, max {max(spread):.1f} %"
    )
    lines.append(f"scaled_mm method: {sorted({r.get('scaled_mm_method', 'failed') for r in rows})}")
    table = "\n".join(lines)
    print("\n" + table)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": props.name,
                    "copy_gbps": bw,
                    "rows": rows,
                    "table": table,
                    "best": {"x".join(map(str, k)): repr(v) for k, v in best.items()},
                },
                indent=1,
            )
        )
    if args.log:
        args.log.write_text("\n".join(log_lines) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
