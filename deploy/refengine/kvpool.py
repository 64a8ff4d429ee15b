"""KVPool: an engine's paged KV memory, one region registered once with the transfer engine.

Pages are zeroed when freed, so the registered region holds no KV but that of requests in flight."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence

import torch

from sglang_pd.deploy.kv.pages import KVCacheShape, PagedLayout

from .exceptions import PoolExhausted

__all__ = ["DEFAULT_POOL_BYTES", "KVPool", "PoolExhausted", "default_num_pages"]

# A pool's default size: float32 rows of a 30-layer model cost 60 times a 2-layer one's, so the
# default is a memory budget (and at most 2048 pages), not a fixed page count.
DEFAULT_POOL_BYTES = 512 * 2**20
MAX_DEFAULT_PAGES = 2048


def default_num_pages(shape: KVCacheShape, page_size: int) -> int:
    """As many pages as DEFAULT_POOL_BYTES holds (every buffer of a page counted), at most 2048."""
    page_bytes = shape.num_buffers * shape.page_bytes(page_size, element_bytes=4)
    return max(1, min(MAX_DEFAULT_PAGES, DEFAULT_POOL_BYTES // page_bytes))


class KVPool:
    """[buffers, pages, page_size, row] float32, shaped by the model's KVCacheShape; pages handed out
    lowest-first so runs merge."""

    def __init__(self, *, shape: KVCacheShape, page_size: int, num_pages: int) -> None:
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.buffer = torch.zeros((shape.num_buffers, num_pages, page_size, shape.row_elements), dtype=torch.float32)
        self._free = list(range(num_pages))
        self._lock = threading.Lock()

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def used_pages(self) -> int:
        with self._lock:
            return self.num_pages - len(self._free)

    def layout(self) -> PagedLayout:
        layer_stride = self.buffer.stride(0) * self.buffer.element_size()
        page_bytes = self.buffer.stride(1) * self.buffer.element_size()
        return PagedLayout(
            tuple(self.base + i * layer_stride for i in range(self.buffer.shape[0])), page_bytes, self.num_pages
        )

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, tokens: int) -> list[int]:
        n = self.pages_for(tokens)
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(
                    f"The KV pool has {len(self._free)} free pages of {self.page_size} tokens; the request needs {n}. "
                    "Retry later or raise --kv-pages."
                )
            self._free.sort()
            pages, self._free = self._free[:n], self._free[n:]
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Zero `pages`, then hand them back: the buffer is registered with the transfer engine, so a
        peer able to read it must not find an earlier request's KV (and so its prompt) there."""
        if pages:
            self.buffer.index_fill_(1, torch.tensor(list(pages), dtype=torch.long), 0.0)
        with self._lock:
            self._free.extend(pages)

    def write(self, pages: Sequence[int], rows: torch.Tensor) -> None:
        """Store KV rows [buffers, seq, row] into `pages`."""
        seq = rows.shape[1]
        for i, p in enumerate(pages):
            chunk = rows[:, i * self.page_size : (i + 1) * self.page_size]
            self.buffer[:, p, : chunk.shape[1]] = chunk
        assert seq <= len(pages) * self.page_size

    def read(self, pages: Sequence[int], seq: int) -> torch.Tensor:
        """The KV rows [buffers, seq, row] held in `pages`."""
        idx = torch.tensor(list(pages), dtype=torch.long)
        rows = self.buffer.index_select(1, idx).reshape(self.buffer.shape[0], -1, self.buffer.shape[3])
        return rows[:, :seq].clone()

    def checksum(self, pages: Sequence[int], seq: int) -> int:
        """crc32 of the rows of the first `seq` tokens in `pages` (what a transfer must preserve)."""
        return zlib.crc32(self.read(pages, seq).numpy().tobytes())
