"""Search the signal down GEMM's launch configurations on DeepSeek-V3 decode shapes.

For each shape (E local experts, every expert at m rows, K = 2048, N = 7168, FP8 with the
activation scales MN-major, as sglang hands them to the down GEMM) it times every candidate of
``candidates(m)`` (on an sm_90 GPU the Gluon kernel's too) without signals, checks its output
against an fp32 reference, and prints the fastest beside DeepGEMM's time on the same inputs, with
each kernel's registers and spills: a tile that needs more than 255 registers per thread spills
and runs about twice as long (kernels/README.md).
At the end it lists every kernel that spills; ``python -m sglang_pd.kernels.sm90_resources``
checks a configuration for spills without a GPU.

The winners go into ``kernels/signal_gemm.py``'s ``_TUNED`` tables; ``benchmarks/bench_sbo_gemm.py``
then measures the picked configurations with and without signals.

    python benchmarks/sweep_sbo_gemm.py --json out.json [--experts 16 32] [--m 8 16 32 64 128]
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import time
from pathlib import Path

import bench_sbo_gemm as bench  # the shapes, problem, timing and baselines are shared (scripts/ is on the path)
import torch

sg = bench.sg
Config = sg.GemmConfig


def candidates(m: int, warp_specialized: bool) -> list[Config | sg.WsConfig]:
    """What is worth timing at m rows per expert: every tile here fits in shared memory, and none
    spills registers when compiled for sm_90a with Triton 3.6 (128-row tiles 128 columns wide
    do not spill since the weight scales are loaded as scalars; 256 wide they still do). With
    ``warp_specialized`` (an sm_90 GPU), the Gluon kernel's configurations too."""
    tma = {"use_tma": True}
    found: list[Config | sg.WsConfig] = [
        Config(block_m=64, block_n=256, num_stages=s, num_warps=8, **tma) for s in (3, 4)
    ]
    found += [Config(block_m=64, block_n=128, num_stages=s, num_warps=w, **tma) for w in (4, 8) for s in (4, 6)]
    # Swap-AB: the weights fill wgmma's 64-row side, the tokens its narrow side (16 or 32 wide).
    for block_m in (16, 32):
        if block_m > max(16, 2 * m):
            continue
        found += [Config(block_m=block_m, block_n=256, num_stages=s, num_warps=8, swap_ab=True, **tma) for s in (3, 4)]
        found += [Config(block_m=block_m, block_n=128, num_stages=s, num_warps=4, swap_ab=True, **tma) for s in (4, 6)]
        found += [Config(block_m=block_m, block_n=128, num_stages=4, num_warps=8, swap_ab=True, **tma)]
    if m > 32:  # 128-row tiles read each weight tile once at m = 128
        found += [Config(block_m=128, block_n=128, num_stages=s, num_warps=8, **tma) for s in (3, 4, 5)]
        found += [Config(block_m=128, block_n=64, num_stages=s, num_warps=4, **tma) for s in (4, 6)]
    if warp_specialized:
        found += [sg.WsConfig(64, 256, s) for s in (3, 4)]
        if m > 32:
            found += [sg.WsConfig(128, 128, s) for s in (4, 5)]  # 6 stages and the tile buffer exceed 227 KiB
            found += [sg.WsConfig(128, 192, s) for s in (3, 4)]
    return list(dict.fromkeys(found))


def _compile(job: tuple[Config | sg.WsConfig, int]) -> str:
    """Compile one configuration for E experts in a worker, so the binary lands in Triton's cache."""
    config, E = job
    try:
        rows, n, k = 128, 256, bench.K
        a = torch.zeros(E, rows, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.zeros(E, n, k, device="cuda").to(torch.float8_e4m3fn)
        a_scale = torch.ones(E, rows, k // 128, device="cuda")
        b_scale = torch.ones(E, n // 128, k // 128, device="cuda")
        out = torch.empty(E, rows, n, dtype=torch.bfloat16, device="cuda")
        masked_m = torch.full((E,), 8, dtype=torch.int32, device="cuda")
        sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, config=config, num_sms=8)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # e.g. out of shared memory: reported, then skipped
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def _compiled() -> dict:
    """Triton's in-process caches of both GEMM kernels: launch key -> compiled kernel."""
    from sglang_pd.kernels import signal_gemm_ws  # imports Gluon: only where the sweep runs

    kernels = (sg._masked_grouped_gemm_kernel, signal_gemm_ws._masked_grouped_gemm_ws_kernel)
    return {key: k for fn in kernels for cache in fn.device_caches.values() for key, k in cache[0].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="write every timing here")
    parser.add_argument("--experts", type=int, nargs="*", default=list(bench.EXPERTS))
    parser.add_argument("--m", type=int, nargs="*", default=list(bench.M_VALUES))
    parser.add_argument("--programs", type=int, default=None, help="persistent programs (default: SMs - 3)")
    args = parser.parse_args()
    programs = (
        args.programs or torch.cuda.get_device_properties(0).multi_processor_count - sg.SMS_KEPT_FOR_COMMUNICATION
    )

    ws = sg.ws_usable(0)
    jobs = list(dict.fromkeys((c, E) for E in args.experts for m in args.m for c in candidates(m, ws)))
    t0 = time.time()
    with multiprocessing.get_context("spawn").Pool(min(14, len(jobs))) as pool:
        compiled = pool.map(_compile, jobs, chunksize=1)
    failed = {repr(c): r for (c, _), r in zip(jobs, compiled, strict=True) if r != "ok"}
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f} s; {len(failed)} failed", flush=True)
    for name, why in failed.items():
        print(f"  failed: {name}: {why}", flush=True)

    bandwidth = bench.copy_bandwidth()
    deep_gemm, why_not = bench.load_deep_gemm()
    print(f"copy bandwidth {bandwidth:.0f} GB/s; DeepGEMM: {'loaded' if deep_gemm else why_not}", flush=True)
    rows = []
    resources: dict[str, dict] = {}  # config -> registers, spills, shared memory of its first kernel
    for E in args.experts:
        M_max = bench.EXPERTS[E]
        a, a_scale, b, b_scale = bench.make_problem(E, M_max)  # activation scales MN-major
        for m in args.m:
            masked_m = torch.full((E,), m, dtype=torch.int32, device="cuda")
            out = torch.empty(E, M_max, bench.N, dtype=torch.bfloat16, device="cuda")
            ref = sg.reference_masked_grouped_gemm(a[:, :m], b, masked_m, a_scale[:, :m], b_scale, dtype=torch.float32)
            moved = E * bench.N * bench.K + b_scale.numel() * 4 + E * m * bench.K + E * m * 16 * 4 + E * m * bench.N * 2
            row: dict = {"E": E, "m": m, "bytes": moved, "programs": programs, "configs": {}}
            if deep_gemm is not None:
                dg_out = torch.empty_like(out)
                row["deepgemm_us"] = bench.bench(
                    functools.partial(
                        deep_gemm.fp8_m_grouped_gemm_nt_masked, (a, a_scale), (b, b_scale), dg_out, masked_m, m
                    )
                )
            for config in candidates(m, ws):
                if repr(config) in failed:
                    continue
                run = functools.partial(
                    sg.masked_grouped_gemm, a, b, out, masked_m,
                    a_scale=a_scale, b_scale=b_scale, config=config, num_sms=programs, expected_m=m,
                )  # fmt: skip
                out.fill_(float("nan"))
                known = set(_compiled())
                run()
                torch.cuda.synchronize()
                for key, kernel in _compiled().items():
                    if key not in known:  # this configuration's kernel, loaded on its first launch
                        resources[repr(config)] = {
                            "regs": kernel.n_regs, "spills": kernel.n_spills, "smem": kernel.metadata.shared,
                        }  # fmt: skip
                row["configs"][repr(config)] = {
                    "us": bench.bench(run, rep_ms=20),
                    "err": bench.rel_err(out[:, :m], ref),
                    **resources.get(repr(config), {}),
                }
            ranked = sorted(row["configs"].items(), key=lambda kv: kv[1]["us"])
            dg = row.get("deepgemm_us")
            print(f"E={E} m={m}: DeepGEMM {dg or float('nan'):.1f} us", flush=True)
            for name, r in ranked[:6]:
                pct = 100 * moved / (r["us"] * 1e-6) / 1e9 / bandwidth
                ratio = f"{dg / r['us']:.3f}" if dg else "-"
                regs = f"regs {r.get('regs', '?')}/spills {r.get('spills', '?')}"
                print(
                    f"  {r['us']:7.1f} us {pct:5.1f}% of copy bw  DG/ours {ratio}  err {r['err']:.1e}  {regs}  {name}",
                    flush=True,
                )
            rows.append(row)
            log = {**bench.run_info(), "copy_gbps": bandwidth, "failed": failed, "rows": rows}
            args.json.write_text(json.dumps(log, indent=1))
        torch.cuda.empty_cache()

    print("kernels that spill registers:")
    for name, r in sorted(resources.items()):
        if r["spills"]:
            print(f"  regs {r['regs']} spills {r['spills']} smem {r['smem']}: {name}")


if __name__ == "__main__":
    main()
