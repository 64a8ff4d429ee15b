"""KV page layouts and page-run planning: which (src, dst, length) items move a request's KV pages.

A KV pool is a set of buffers, each an array of equal-sized pages (sglang's layout: page index
times page bytes from the buffer's base). Which buffers there are and what a token's row in each
holds comes from the model's config (`KVCacheShape`): one latent buffer per layer for MLA, a K and
a V buffer per layer for multi-head / grouped-query attention. A request's pages are written
prefill → decode buffer by buffer; runs of pages that are contiguous on both sides become one
item, as sglang's `group_concurrent_contiguous` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "KVCacheShape",
    "PagedLayout",
    "TransferItem",
    "merge_page_runs",
    "plan_page_writes",
    "split_batches",
]

TransferItem = tuple[int, int, int]  # (source address, destination address, length in bytes)


@dataclass(frozen=True)
class KVCacheShape:
    """What a model keeps per token in its KV cache, read from its config as sglang's KV pools do.

    - `mla` (DeepSeek-V2/V3, sglang's MLATokenToKVPool): one buffer per layer; a token's row is the
      compressed latent (`kv_lora_rank`, as one key head) then the decoupled RoPE key
      (`qk_rope_head_dim`, as one value head), which is also how transformers caches these models.
    - `mha` (Llama-style multi-head or grouped-query attention, sglang's MHATokenToKVPool): a K and a
      V buffer per layer, every K buffer first; a token's row in each is `num_key_value_heads` heads
      of `head_dim`.
    """

    attention: Literal["mla", "mha"]
    num_layers: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    def __post_init__(self) -> None:
        dims = (self.num_layers, self.key_heads, self.key_dim, self.value_heads, self.value_dim)
        if min(dims) < 1:
            raise ValueError(f"A KV cache shape needs positive sizes, got {self!r}.")
        if self.attention == "mha" and self.key_heads * self.key_dim != self.value_heads * self.value_dim:
            raise ValueError(
                f"K rows of {self.key_heads}x{self.key_dim} and V rows of {self.value_heads}x{self.value_dim} differ; "
                "the paged pool holds K and V buffers of one row size."
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> KVCacheShape:
        """The shape of a Hugging Face config (a dict or a transformers config object)."""

        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

        layers = get("num_hidden_layers")
        if not layers:
            raise ValueError("The model config has no num_hidden_layers; cannot size its KV cache.")
        if get("kv_lora_rank"):
            rope = get("qk_rope_head_dim")
            if not rope:
                raise ValueError("The model config has kv_lora_rank (MLA) but no qk_rope_head_dim.")
            return cls("mla", int(layers), 1, int(get("kv_lora_rank")), 1, int(rope))
        heads = get("num_attention_heads")
        if not heads:
            raise ValueError(
                f"The model config ({get('model_type') or 'unknown type'}) has neither kv_lora_rank (MLA) nor "
                "num_attention_heads; the reference engine knows MLA and multi-head / grouped-query attention."
            )
        kv_heads = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or int(get("hidden_size")) // int(heads))
        return cls("mha", int(layers), kv_heads, head_dim, kv_heads, head_dim)

    @property
    def num_buffers(self) -> int:
        return self.num_layers if self.attention == "mla" else 2 * self.num_layers

    @property
    def row_elements(self) -> int:
        """Elements of one token's row in one buffer."""
        key = self.key_heads * self.key_dim
        return key + self.value_heads * self.value_dim if self.attention == "mla" else key

    def page_bytes(self, page_size: int, element_bytes: int) -> int:
        return page_size * self.row_elements * element_bytes

    def describe(self) -> str:
        if self.attention == "mla":
            return (
                f"MLA: {self.num_layers} layers, a row of {self.key_dim} latent + {self.value_dim} RoPE "
                f"elements per token"
            )
        return (
            f"MHA/GQA: {self.num_layers} layers x (K, V), a row of {self.key_heads} heads x {self.key_dim} "
            "per token in each"
        )


@dataclass(frozen=True)
class PagedLayout:
    """One side's KV pool: a base address per buffer (`layer_bases`, in KVCacheShape's order), equal pages."""

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
    """The items that copy `src_pages` of every buffer of `src` into `dst_pages` of `dst`."""
    if len(src.layer_bases) != len(dst.layer_bases) or src.page_bytes != dst.page_bytes:
        raise ValueError(
            f"KV layouts differ: source has {len(src.layer_bases)} buffers of {src.page_bytes}-byte pages, "
            f"destination {len(dst.layer_bases)} buffers of {dst.page_bytes}-byte pages; "
            "the model, page size and KV dtype must match on prefill and decode."
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
