"""The model a reference engine runs: a tiny DeepSeek-V3 (MLA + MoE) from a seed, or a local HF dir.

KV rows: transformers keeps one cache layer per decoder layer (for DeepSeek-V3 the compressed MLA
latent: keys = kv_lora_rank, values = rope dims, one head); a token's row in a layer is its keys
then its values, flattened — the per-token layout sglang transfers for MLA.
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["DEFAULT_SEED", "TINY_CONFIG", "LoadedModel", "load_model", "sample_token"]

DEFAULT_SEED = 0
TINY_CONFIG = Path(__file__).resolve().parent.parent / "presets" / "tiny-deepseek-v3-config.json"
TINY_NAME = "tiny-deepseek-v3"


@dataclass
class LoadedModel:
    name: str
    model: Any
    tokenizer: Tokenizer
    num_layers: int
    key_dims: tuple[int, int]  # (heads, dim) of a cache layer's keys
    value_dims: tuple[int, int]
    context_length: int
    weights_digest: str  # crc32 of every parameter: prefill and decode must run the same weights

    @property
    def row_floats(self) -> int:
        return self.key_dims[0] * self.key_dims[1] + self.value_dims[0] * self.value_dims[1]

    # -- model steps (run on the engine's single model thread) --------------------------------

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Last-position logits and the KV rows [layers, len(ids), row_floats] of a prompt."""
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        n = len(ids)
        rows = torch.stack(
            [
                torch.cat(
                    [layer.keys[0].transpose(0, 1).reshape(n, -1), layer.values[0].transpose(0, 1).reshape(n, -1)], -1
                )
                for layer in cache.layers
            ]
        )
        return out.logits[0, -1].float(), rows

    def cache_from_rows(self, rows: torch.Tensor) -> Any:
        """A transformers cache holding the KV rows [layers, seq, row_floats]."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        (kh, kd), (vh, vd) = self.key_dims, self.value_dims
        seq = rows.shape[1]
        for i in range(self.num_layers):
            k = rows[i, :, : kh * kd].reshape(seq, kh, kd).transpose(0, 1).unsqueeze(0).contiguous()
            v = rows[i, :, kh * kd :].reshape(seq, vh, vd).transpose(0, 1).unsqueeze(0).contiguous()
            cache.update(k, v, i)
        return cache

    @torch.inference_mode()
    def decode_step(self, cache: Any, token: int, position: int) -> torch.Tensor:
        out = self.model(
            input_ids=torch.tensor([[token]]),
            past_key_values=cache,
            position_ids=torch.tensor([[position]]),
            use_cache=True,
        )
        return out.logits[0, -1].float()


def sample_token(logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, seed: int, step: int) -> int:
    """Greedy when temperature is 0; otherwise temperature/top-k/top-p sampling seeded per (seed, step)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_k > 0:
        kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p * sorted_p.sum()
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, idx[keep], True)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _digest(model: Any) -> str:
    crc = 0
    for name, p in sorted(model.state_dict().items()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(p.detach().contiguous().cpu().numpy().tobytes(), crc)
    return f"{crc:08x}"


_INIT_LOCK = threading.Lock()


def load_model(model_dir: str | None = None, *, seed: int = DEFAULT_SEED, threads: int | None = None) -> LoadedModel:
    """The tiny DeepSeek-V3 (model_dir None, `tiny-deepseek-v3` or the preset config) or a local HF model."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if threads:
        torch.set_num_threads(threads)
    tokenizer: Tokenizer
    if model_dir in (None, TINY_NAME) or (model_dir and Path(model_dir).suffix == ".json"):
        cfg_path = Path(model_dir) if model_dir and model_dir.endswith(".json") else TINY_CONFIG
        raw = json.loads(cfg_path.read_text())
        raw = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "auto_map")}
        config = DeepseekV3Config(**raw)
        with _INIT_LOCK:
            torch.manual_seed(seed)
            model = DeepseekV3ForCausalLM(config).float().eval()
        tokenizer = ByteTokenizer()
        name = TINY_NAME
    else:
        path = Path(str(model_dir))
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"Model directory {path} has no config.json; pass a local HF model directory.")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        config = model.config
        tokenizer = HFTokenizer(str(path))
        name = path.name
    # One forward pass tells the cache layout (heads, dims) of every layer.
    with torch.inference_mode():
        cache = model(input_ids=torch.tensor([[2, 3]]), use_cache=True).past_key_values
    k, v = cache.layers[0].keys, cache.layers[0].values
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        num_layers=len(cache.layers),
        key_dims=(int(k.shape[1]), int(k.shape[3])),
        value_dims=(int(v.shape[1]), int(v.shape[3])),
        context_length=int(getattr(config, "max_position_embeddings", 4096)),
        weights_digest=_digest(model),
    )
