"""Page-run planning: which (src, dst, length) items move a request's KV pages.

A KV pool is one buffer per layer, each an array of equal-sized pages (sglang's layout: page
index times page bytes from the layer's base). A request's pages are written prefill → decode
layer by layer; runs of pages that are contiguous on both sides become one item, as sglang's
`group_concurrent_contiguous` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PagedLayout", "TransferItem", "merge_page_runs", "plan_page_writes", "split_batches"]

TransferItem = tuple[int, int, int]  # (source address, destination address, length in bytes)


@dataclass(frozen=True)
class PagedLayout:
    """One side's KV pool: a base address per layer, equal pages in each."""

    layer_bases: tuple[int, ...]
    page_bytes: int
    num_pages: int

    def __post_init__(self) -> None:
        assert self.page_bytes > 0, "page_bytes must be positive"
        assert self.num_pages > 0, "num_pages must be positive"
        assert self.layer_bases, "a layout needs at least one layer"

    def to_json(self) -> dict[str, object]:
        return {"layer_bases": list(self.layer_bases), "page_bytes": self.page_bytes, "num_pages": self.num_pages}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> PagedLayout:
        bases = d["layer_bases"]
        assert isinstance(bases, list)
        return cls(tuple(int(b) for b in bases), int(d["page_bytes"]), int(d["num_pages"]))  # type: ignore[call-overload]


def merge_page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, count) runs where both page lists advance by one together."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"Got {len(src_pages)} source pages but {len(dst_pages)} destination pages; they must match.")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def plan_page_writes(
    src: PagedLayout, dst: PagedLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> list[TransferItem]:
    """The items that copy `src_pages` of every layer of `src` into `dst_pages` of `dst`."""
    if len(src.layer_bases) != len(dst.layer_bases) or src.page_bytes != dst.page_bytes:
        raise ValueError(
            f"KV layouts differ: source has {len(src.layer_bases)} layers of {src.page_bytes}-byte pages, "
            f"destination {len(dst.layer_bases)} layers of {dst.page_bytes}-byte pages; "
            "page size and KV dtype must match on prefill and decode."
        )
    for name, pages, layout in (("source", src_pages, src), ("destination", dst_pages, dst)):
        bad = [p for p in pages if not 0 <= p < layout.num_pages]
        if bad:
            raise IndexError(f"{name} page {bad[0]} is outside the pool of {layout.num_pages} pages.")
    runs = merge_page_runs(src_pages, dst_pages)
    pb = src.page_bytes
    return [
        (sb + s * pb, db + d * pb, n * pb)
        for sb, db in zip(src.layer_bases, dst.layer_bases, strict=True)
        for s, d, n in runs
    ]


def split_batches(items: Sequence[TransferItem], max_items: int) -> list[Sequence[TransferItem]]:
    """Consecutive slices of at most `max_items` items."""
    return [items[i : i + max_items] for i in range(0, len(items), max_items)]
