"""KV-cache capacity of a decode GPU: how many tokens fit beside the weights, and whether a batch does."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang_pd.deploy.estimate.roofline import Layout
from sglang_pd.deploy.spec.model_shape import ModelShape

__all__ = ["KVCapacity", "kv_bytes_per_element", "kv_capacity"]

GIB = 1024**3


def kv_bytes_per_element(kv_cache_dtype: str, model_dtype: str | None) -> float:
    """sglang's KV dtype: `auto` keeps the model's activation dtype (bf16 for DeepSeek's FP8 checkpoint)."""
    if kv_cache_dtype.startswith("fp8"):
        return 1.0
    if kv_cache_dtype == "auto" and model_dtype in ("float32",):
        return 4.0
    return 2.0


@dataclass(frozen=True)
class KVCapacity:
    """Tokens of KV one decode GPU holds, against what the asked batch needs."""

    gpu_memory_gib: float
    mem_fraction_static: float
    weights_gib: float
    kv_bytes_per_token: float
    page_size: int
    tokens_per_gpu: int
    tokens_needed_per_gpu: int
    batch_per_rank: int
    max_batch_per_rank: int

    @property
    def fits(self) -> bool:
        return self.tokens_needed_per_gpu <= self.tokens_per_gpu

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens_per_gpu": self.tokens_per_gpu,
            "tokens_needed_per_gpu": self.tokens_needed_per_gpu,
            "batch_per_rank": self.batch_per_rank,
            "max_batch_per_rank": self.max_batch_per_rank,
            "fits": self.fits,
            "weights_gib": round(self.weights_gib, 1),
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "mem_fraction_static": self.mem_fraction_static,
            "page_size": self.page_size,
        }


def kv_capacity(
    shape: ModelShape,
    lay: Layout,
    *,
    gpu_memory_gib: float,
    mem_fraction_static: float,
    kv_bytes: float,
    page_size: int,
    batch_per_rank: int,
    sequence_len: int,
) -> KVCapacity:
    """sglang sizes its KV pool as `mem_fraction_static` of GPU memory minus the weights.

    MLA caches one latent per token per layer, the same on every attention-TP rank (it is not
    split by heads), so a GPU holds the KV of its whole attention rank. A request occupies whole
    pages of its full length (input plus output).
    """
    weights = shape.weight_bytes_per_gpu(lay.attn_tp, lay.dense_tp, lay.experts_per_gpu, lay.lm_head_tp)
    pool = gpu_memory_gib * GIB * mem_fraction_static - weights
    per_token = shape.layers * shape.kv_width * kv_bytes
    fit = max(0, int(pool // (per_token * page_size))) * page_size  # the pool holds whole pages
    per_request = math.ceil(sequence_len / page_size) * page_size
    return KVCapacity(
        gpu_memory_gib=gpu_memory_gib,
        mem_fraction_static=mem_fraction_static,
        weights_gib=weights / GIB,
        kv_bytes_per_token=per_token,
        page_size=page_size,
        tokens_per_gpu=fit,
        tokens_needed_per_gpu=batch_per_rank * per_request,
        batch_per_rank=batch_per_rank,
        max_batch_per_rank=fit // per_request,
    )
