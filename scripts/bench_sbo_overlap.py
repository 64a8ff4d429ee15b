"""Overlap on 2×H200: the down GEMM with a combine-send stand-in, against GEMM-then-send.

SBO's second half lets DeepEP's combine-send ship each finished block of tokens while the down
GEMM is still running. Here the combine-send is `kernels/signal_consumer.py`: a few programs
(the SMs the GEMM leaves free) poll the GEMM's signals with acquire loads and copy each finished
row-block (sglang layout) into the peer GPU's memory over NVLink. Per shape it times, with CUDA
events around the whole step:

- `seq`: our GEMM on all 132 SMs, then the rows sent with torch's peer copy (full NVLink speed);
- `seq same`: the signalled GEMM, then the same consumer kernel once the GEMM is done;
- `overlap`: the signalled GEMM on 132 − P SMs and the consumer on P programs, concurrently;

and checks the peer's copy equals the GEMM's output. Prints a table and writes JSON.

    python scripts/bench_sbo_overlap.py --json overlap.json     # needs 2 GPUs with peer access
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch

try:
    from sglang_pd.kernels import signal_gemm as sg
    from sglang_pd.kernels.signal_consumer import copy_when_signalled
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels import signal_gemm as sg
    from kernels.signal_consumer import copy_when_signalled

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sbo_gemm import EXPERTS, N, make_problem  # the same problems as the GEMM table

M_VALUES = (8, 32, 64, 128)
CONSUMER_PROGRAMS = (3, 8)
ITERS = 50


def enable_peer_access(a: int, b: int) -> None:
    """Let kernels on GPU `a` store into GPU `b`'s memory (a Triton store through a peer pointer)."""
    if not torch.cuda.can_device_access_peer(a, b):
        raise SystemExit(f"GPU {a} cannot access GPU {b}'s memory (no P2P): this benchmark needs NVLink peers")
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise SystemExit("libcudart not found to enable peer access")
    with torch.cuda.device(a):
        torch.cuda.synchronize()
        rc = cudart.cudaDeviceEnablePeerAccess(ctypes.c_int(b), ctypes.c_uint(0))
    if rc not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
        raise SystemExit(f"cudaDeviceEnablePeerAccess({b}) on GPU {a} failed with {rc}")


def timed(step, iters: int = ITERS) -> float:
    """Median µs of `step()`, which records its own start and end events on the current stream."""
    times = []
    for _ in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step(start, end)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[5:])


def measure(E: int, M_max: int, m: int, programs: int) -> dict:
    a, a_scale, b, b_scale = make_problem(E, M_max)
    masked_m = torch.full((E,), m, dtype=torch.int32, device="cuda:0")
    out = torch.empty(E, M_max, N, dtype=torch.bfloat16, device="cuda:0")
    peer = torch.zeros(E, M_max, N, dtype=torch.bfloat16, device="cuda:1")
    all_sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = sg.ws_usable(0)  # what the entry point picks on this GPU: on sm_90 the Gluon kernel
    cfg = sg.pick_config(m, signal_mode=sg.SIGNAL_SGLANG, warp_specialized=ws)
    plain_cfg = sg.pick_config(m, warp_specialized=ws)
    num_units = E * -(-M_max // cfg.block_m)
    signal = torch.zeros(num_units, dtype=torch.int32, device="cuda:0")
    side = torch.cuda.Stream(device="cuda:0")
    main = torch.cuda.current_stream()

    def gemm_signalled(num_sms: int) -> int:
        _, threshold = sg.masked_grouped_gemm(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal,
            signal_mode=sg.SIGNAL_SGLANG, num_sms=num_sms, config=cfg,
        )  # fmt: skip
        return threshold

    threshold = gemm_signalled(all_sms - programs)
    torch.cuda.synchronize()

    def seq(start, end):
        start.record()
        sg.masked_grouped_gemm(a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, num_sms=all_sms, config=plain_cfg)
        peer[:, :m].copy_(out[:, :m], non_blocking=True)
        end.record()

    def seq_same(start, end):
        signal.zero_()
        start.record()
        gemm_signalled(all_sms - programs)
        copy_when_signalled(signal, masked_m, out, peer, threshold, per_expert=False, block_m=cfg.block_m,
                            num_programs=programs)  # fmt: skip
        end.record()

    def overlap(start, end):
        signal.zero_()
        start.record()
        side.wait_stream(main)
        gemm_signalled(all_sms - programs)
        with torch.cuda.stream(side):
            copy_when_signalled(signal, masked_m, out, peer, threshold, per_expert=False, block_m=cfg.block_m,
                                num_programs=programs)  # fmt: skip
        main.wait_stream(side)
        end.record()

    row = {"E": E, "m": m, "consumer_programs": programs, "block_m": cfg.block_m, "config": repr(cfg)}
    row["seq_us"] = timed(seq)
    row["seq_same_us"] = timed(seq_same)
    peer.zero_()
    row["overlap_us"] = timed(overlap)
    torch.cuda.synchronize()
    row["peer_copy_exact"] = bool(torch.equal(peer[:, :m].cpu(), out[:, :m].cpu()))
    row["saved_vs_seq_pct"] = 100 * (1 - row["overlap_us"] / row["seq_us"])
    row["saved_vs_seq_same_pct"] = 100 * (1 - row["overlap_us"] / row["seq_same_us"])
    row["sent_mb"] = E * m * N * 2 / 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs: the combine-send stand-in writes into the peer GPU")
    enable_peer_access(0, 1)
    torch.cuda.set_device(0)
    rows = []
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, times in µs (median of {ITERS})")
    times = f"{'seq':>7} {'seq same':>9} {'overlap':>8}"
    header = f"{'E':>3} {'m':>4} {'P':>2} {'MB':>6} | {times} | saved vs seq, vs same | exact"
    print(header)
    print("-" * len(header))
    for E, M_max in EXPERTS.items():
        for m in M_VALUES:
            for programs in CONSUMER_PROGRAMS:
                r = measure(E, M_max, m, programs)
                rows.append(r)
                print(
                    f"{E:>3} {m:>4} {programs:>2} {r['sent_mb']:>6.1f} | {r['seq_us']:>7.1f} {r['seq_same_us']:>9.1f} "
                    f"{r['overlap_us']:>8.1f} | {r['saved_vs_seq_pct']:>+6.1f}% {r['saved_vs_seq_same_pct']:>+6.1f}%"
                    f"        | {r['peer_copy_exact']}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
