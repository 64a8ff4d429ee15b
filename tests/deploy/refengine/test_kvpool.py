"""KVPool: freed pages hold nothing of the request that used them."""

from __future__ import annotations

import ctypes

import torch

from sglang_pd.deploy.kv.pages import KVCacheShape
from sglang_pd.deploy.refengine.kvpool import KVPool

PAGE_SIZE = 4


def _page_bytes(pool: KVPool, buffer: int, page: int) -> bytes:
    """One page of one buffer, read from the registered region's raw memory (what a peer sees)."""
    layout = pool.layout()
    return ctypes.string_at(layout.layer_bases[buffer] + page * layout.page_bytes, layout.page_bytes)


def test_freed_pages_are_zeroed_and_pages_in_use_are_kept() -> None:
    shape = KVCacheShape("mha", num_layers=2, key_heads=2, key_dim=8, value_heads=2, value_dim=8)
    pool = KVPool(shape=shape, page_size=PAGE_SIZE, num_pages=8)
    done = pool.alloc(3 * PAGE_SIZE - 1)  # the last page partly filled
    running = pool.alloc(PAGE_SIZE)
    for pages in (done, running):
        pool.write(pages, torch.rand(shape.num_buffers, len(pages) * PAGE_SIZE, shape.row_elements) + 1)
    zero = bytes(pool.layout().page_bytes)
    assert all(_page_bytes(pool, b, p) != zero for b in range(shape.num_buffers) for p in done + running)

    pool.free(done)

    assert all(_page_bytes(pool, b, p) == zero for b in range(shape.num_buffers) for p in done)
    assert all(_page_bytes(pool, b, p) != zero for b in range(shape.num_buffers) for p in running)
    # the next request gets the zeroed pages back, lowest first
    assert pool.alloc(PAGE_SIZE) == [done[0]]
