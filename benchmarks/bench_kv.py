"""Benchmark: our KV-transfer layer vs raw Mooncake `batch_transfer_sync_write`, same buffers, one run.

DeepSeek-V3-shaped KV: 61 layers, one row per token and layer of 576 bf16 values (kv_lora_rank 512
+ rope 64 = 1152 bytes), pages of 64 tokens. For each prompt length the prefill side writes its
pages into a decode peer process's pages, either contiguous (one item per layer after merging) or
fragmented (the decode pages are a random permutation: one item per page and layer). "raw" hands
the same (src, dst, len) items straight to `batch_transfer_sync_write` in slices of 1024 (the most
Mooncake's TCP lane takes per peer); "ours" is `KVTransferEngine.write_pages`, planning included.

    .venv/bin/python benchmarks/bench_kv.py                      # 1k..32k tokens, table + bench_kv.json
    .venv/bin/python benchmarks/bench_kv.py --tokens 1024 4096 --repeat 5 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import statistics
import sys
import time

from sglang_pd.deploy.kv import KVConfig, PagedLayout, get_engine, plan_page_writes
from sglang_pd.deploy.kv.config import MAX_BATCH_ITEMS
from sglang_pd.deploy.kv.peer import start_peer

LAYERS, ROW_BYTES, PAGE_TOKENS = 61, 1152, 64


def raw_write(te: object, session: str, items: list[tuple[int, int, int]]) -> None:
    """The baseline: the same items straight into Mooncake, 1024 at a time."""
    for k in range(0, len(items), MAX_BATCH_ITEMS):
        chunk = items[k : k + MAX_BATCH_ITEMS]
        srcs, dsts, lens = [i[0] for i in chunk], [i[1] for i in chunk], [i[2] for i in chunk]
        rc = te.batch_transfer_sync_write(session, srcs, dsts, lens)  # type: ignore[attr-defined]
        assert rc == 0, f"raw batch_transfer_sync_write failed with {rc}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--row-bytes", type=int, default=ROW_BYTES)
    p.add_argument("--page-tokens", type=int, default=PAGE_TOKENS)
    p.add_argument("--repeat", type=int, default=5, help="timed runs per cell (ours and raw alternate)")
    p.add_argument("--json", default="bench_kv.json", help="where to write the JSON report")
    a = p.parse_args()

    page_bytes = a.row_bytes * a.page_tokens
    max_pages = -(-max(a.tokens) // a.page_tokens)
    layer_bytes = page_bytes * max_pages
    size = layer_bytes * a.layers
    engine = get_engine(KVConfig(timeout_s=60.0))
    src_buf = (ctypes.c_char * size)()
    ctypes.memset(src_buf, 7, size)
    base = ctypes.addressof(src_buf)
    engine.register(base, size)
    te = engine._te  # the raw Mooncake engine, for the baseline
    rows = []
    print(f"best of {a.repeat} runs each, ours and raw alternating")
    print(f"{'tokens':>7} {'shape':<11} {'MiB':>8} {'items':>6} {'raw GB/s':>9} {'ours GB/s':>10} {'ours/raw':>9}")
    with start_peer(size) as peer:
        session = peer.info.session_id
        src = PagedLayout(tuple(base + i * layer_bytes for i in range(a.layers)), page_bytes, max_pages)
        dst = PagedLayout(tuple(peer.info.base + i * layer_bytes for i in range(a.layers)), page_bytes, max_pages)
        engine.write_pages(session, src, dst, [0], [0])  # connect once before timing
        for tokens in a.tokens:
            n = -(-tokens // a.page_tokens)
            src_pages = list(range(n))
            for shape, dst_pages in (
                ("contiguous", list(range(n))),
                ("fragmented", random.Random(tokens).sample(range(max_pages), n)),
            ):
                items = plan_page_writes(src, dst, src_pages, dst_pages)
                nbytes = sum(i[2] for i in items)
                raw_t, ours_t = [], []
                for rep in range(a.repeat):
                    # alternate who goes first, so that neither always meets a warm or a cold peer
                    for who in ("raw", "ours") if rep % 2 == 0 else ("ours", "raw"):
                        t0 = time.perf_counter()
                        if who == "raw":
                            raw_write(te, session, items)
                            raw_t.append(time.perf_counter() - t0)
                        else:
                            engine.write_pages(session, src, dst, src_pages, dst_pages)
                            ours_t.append(time.perf_counter() - t0)
                # best of N: on shared cores the minimum is the least noisy estimate of what each can do
                raw_gbps = nbytes / min(raw_t) / 1e9
                ours_gbps = nbytes / min(ours_t) / 1e9
                row = {
                    "tokens": tokens,
                    "shape": shape,
                    "pages": n,
                    "bytes": nbytes,
                    "items": len(items),
                    "raw_s": raw_t,
                    "ours_s": ours_t,
                    "raw_gbps_best": raw_gbps,
                    "raw_gbps_median": nbytes / statistics.median(raw_t) / 1e9,
                    "ours_gbps_best": ours_gbps,
                    "ours_gbps_median": nbytes / statistics.median(ours_t) / 1e9,
                    "ratio": ours_gbps / raw_gbps,
                }
                rows.append(row)
                print(
                    f"{tokens:>7} {shape:<11} {nbytes / 2**20:>8.1f} {len(items):>6} {raw_gbps:>9.2f} "
                    f"{ours_gbps:>10.2f} {row['ratio']:>9.2f}",
                    flush=True,
                )
    worst = min(r["ratio"] for r in rows)
    report = {
        "layers": a.layers,
        "row_bytes": a.row_bytes,
        "page_tokens": a.page_tokens,
        "repeat": a.repeat,
        "protocol": engine.config.protocol,
        "machine": platform.node(),
        "rows": rows,
        "min_ratio": worst,
        "target_ratio": 0.9,
    }
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"min ours/raw = {worst:.2f} (target >= 0.90); JSON: {a.json}")
    return 0 if worst >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
