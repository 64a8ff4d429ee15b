"""Drives sglang's own Mooncake KV send over real Mooncake TCP on loopback, for test_kv_fault.py.

Run with sglang 0.5.17 (the release the GPU check runs) and, when testing the fault, the check's
faults folder on PYTHONPATH. A MooncakeKVManager is built without its constructor (which needs a
scheduler and a bootstrap server), holding what `send_kvcache` reads for an MLA model: two layers
of a 12-page prefill pool, each page filled with its own byte value, and sglang's
MooncakeTransferEngine on 127.0.0.1. Each send writes pages into a zeroed decode pool in the same
process; the driver prints, per send, the value each destination page holds in each layer.
Argument: the flag file the fault watches (created and removed here between sends).
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import sglang
import sglang.srt.disaggregation.mooncake.conn as conn
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import MooncakeTransferEngine

LAYERS, PAGES, ITEM = 2, 12, 576  # one MLA token row of 576 bytes stands for a page here


def page_value(layer: int, page: int) -> int:
    return 50 * layer + page + 1


def main() -> None:
    flag = Path(sys.argv[1])
    engine = MooncakeTransferEngine("127.0.0.1")
    src = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(LAYERS)]
    dst = [np.zeros(PAGES * ITEM, dtype=np.uint8) for _ in range(LAYERS)]
    for layer, pool in enumerate(src):
        for page in range(PAGES):
            pool[page * ITEM : (page + 1) * ITEM] = page_value(layer, page)
    if engine.batch_register([a.ctypes.data for a in src + dst], [a.nbytes for a in src + dst]) != 0:
        raise SystemExit("Mooncake refused to register the pools")

    manager = object.__new__(conn.MooncakeKVManager)
    manager.kv_args = SimpleNamespace(
        kv_data_ptrs=[a.ctypes.data for a in src],
        kv_item_lens=[ITEM] * LAYERS,
        kv_layer_ids=None,
        mla_compression_ratios=None,
    )
    manager.is_mla_backend, manager.is_hybrid_mla_backend = True, False
    manager.enable_custom_mem_pool, manager.pp_size = False, 1
    manager.engine = engine

    def send(prefill_pages: list[int], decode_pages: list[int]) -> dict[str, object]:
        ret = manager.send_kvcache(
            engine.get_session_id(),
            np.array(prefill_pages, dtype=np.int32),
            [a.ctypes.data for a in dst],
            np.array(decode_pages, dtype=np.int32),
            executor,
        )
        held = [[int(dst[layer][p * ITEM]) for p in decode_pages] for layer in range(LAYERS)]
        # Each destination page holds one value throughout: whole pages moved, not parts of two.
        whole = all(
            np.unique(dst[layer][p * ITEM : (p + 1) * ITEM]).size == 1 for layer in range(2) for p in decode_pages
        )
        return {"ret": ret, "held": held, "pages_whole": whole}

    with ThreadPoolExecutor(1) as executor:
        result = {
            "sglang": sglang.__version__,
            "wrapped": bool(getattr(conn.MooncakeKVManager.send_kvcache, "pd_check_fault", False)),
            "expected": [[page_value(layer, p) for p in (3, 5, 6, 9)] for layer in range(LAYERS)],
            "flag_absent": send([3, 5, 6, 9], [0, 1, 2, 3]),
        }
        flag.touch()
        result["flag_present"] = send([3, 5, 6, 9], [4, 5, 6, 7])
        result["flag_present_one_page"] = send([7], [8])
        flag.unlink()
        result["flag_removed"] = send([3, 5, 6], [9, 10, 11])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
