"""Overlap on 2×H200: the down GEMM with a combine-send stand-in, against GEMM-then-send.

SBO's second half lets DeepEP's combine-send ship each finished block of tokens while the down
GEMM is still running. Here the combine-send is `tests/support/signal_consumer.py`: a few programs
(the SMs the GEMM leaves free) poll the GEMM's signals with acquire loads and copy each finished
row-block (sglang layout) into the peer GPU's memory over NVLink. Per shape it times, with CUDA
events around one replay of the whole step:

- `seq`: our GEMM on all 132 SMs, then the rows sent by the copy engines (`cudaMemcpy2DAsync`, full
  NVLink speed);
- `seq same`: the signalled GEMM, then the same consumer kernel once the GEMM is done;
- `overlap`: the signalled GEMM on 132 − P SMs and the consumer on P programs, concurrently;

each step captured in a CUDA graph (as sglang's decode runs it) and timed over its replays, and
checks the peer's copy equals the GEMM's output. Prints a table and writes JSON.

    PYTHONPATH=. python benchmarks/bench_sbo_overlap.py --json overlap.json   # 2 GPUs with peer access

(from the repository root, with the package installed: the stand-in is a test harness and is not
shipped).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
from pathlib import Path

import torch
from bench_sbo_gemm import EXPERTS, N, make_problem, run_info  # the same problems as the GEMM table

from sglang_pd.kernels import signal_gemm as sg

try:
    from tests.support.signal_consumer import copy_when_signalled
except ModuleNotFoundError as exc:
    if exc.name not in ("tests", "tests.support"):
        raise
    raise SystemExit(
        "The combine-send stand-in lives in tests/support, which is not installed: run this script from "
        "the repository root with the root on the path, `PYTHONPATH=. python benchmarks/bench_sbo_overlap.py`."
    ) from exc

M_VALUES = (8, 32, 64, 128)
CONSUMER_PROGRAMS = (3, 8)
ITERS = 50


@functools.cache
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime, loaded once (peer access at start, then a peer copy per captured step)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("libcudart not found (needed for peer access and peer copies)")


def enable_peer_access(a: int, b: int) -> None:
    """Let kernels on GPU `a` store into GPU `b`'s memory (a Triton store through a peer pointer)."""
    if not torch.cuda.can_device_access_peer(a, b):
        raise SystemExit(f"GPU {a} cannot access GPU {b}'s memory (no P2P): this benchmark needs NVLink peers")
    with torch.cuda.device(a):
        torch.cuda.synchronize()
        rc = _cudart().cudaDeviceEnablePeerAccess(ctypes.c_int(b), ctypes.c_uint(0))
    if rc not in (0, 704):  # 704: cudaErrorPeerAccessAlreadyEnabled
        raise SystemExit(f"cudaDeviceEnablePeerAccess({b}) on GPU {a} failed with {rc}")


def copy_rows_to_peer(src: torch.Tensor, dst: torch.Tensor, m: int) -> None:
    """``dst[:, :m] = src[:, :m]`` on the current stream by the copy engines, as one 2D memcpy.
    (torch's cross-device ``copy_`` also synchronises with the peer's stream, which a CUDA graph
    capture refuses.)"""
    E, M_max, N = src.shape
    row_bytes, expert_bytes = N * src.element_size(), M_max * N * src.element_size()
    rc = _cudart().cudaMemcpy2DAsync(
        ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(expert_bytes),
        ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(expert_bytes),
        ctypes.c_size_t(m * row_bytes), ctypes.c_size_t(E),
        ctypes.c_int(4),  # cudaMemcpyDefault: unified addressing finds both devices
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync to the peer failed with {rc}")


def timed(step, iters: int = ITERS) -> float:
    """Median µs of one replay of ``step`` captured in a CUDA graph, as sglang's decode runs it
    (eager launches would add the host's launch time, which is not what overlap changes)."""
    step()  # compile and load every kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
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

    def gemm_signalled() -> int:
        _, threshold = sg.masked_grouped_gemm(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, signal=signal,
            signal_mode=sg.SIGNAL_SGLANG, num_sms=all_sms - programs, config=cfg, expected_m=m,
        )  # fmt: skip
        return threshold

    threshold = gemm_signalled()
    torch.cuda.synchronize()

    def send() -> None:
        copy_when_signalled(signal, masked_m, out, peer, threshold, per_expert=False, block_m=cfg.block_m,
                            num_programs=programs)  # fmt: skip

    def seq() -> None:
        sg.masked_grouped_gemm(
            a, b, out, masked_m, a_scale=a_scale, b_scale=b_scale, num_sms=all_sms, config=plain_cfg, expected_m=m
        )
        copy_rows_to_peer(out, peer, m)

    def seq_same() -> None:
        signal.zero_()
        gemm_signalled()
        send()

    def overlap() -> None:
        signal.zero_()
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        gemm_signalled()
        with torch.cuda.stream(side):
            send()
        main.wait_stream(side)

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
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, µs (median of {ITERS} CUDA-graph replays)")
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
        args.json.write_text(
            json.dumps({**run_info(), "device": torch.cuda.get_device_name(0), "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
