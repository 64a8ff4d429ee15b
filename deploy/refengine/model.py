"""The model a reference engine runs, and its KV rows in the paged pool's layout.

Models come from `sources.py` (SmolLM2-135M-Instruct from its packaged GGUF by default, the tiny
DeepSeek-V3 from a seed, or a local file or directory). The KV cache shape is read from the model's
config (`KVCacheShape.from_config`: MLA latent rows for DeepSeek-V3, K and V heads for Llama-style
attention) and checked once against what transformers actually caches, so a config the engine reads
wrongly fails at load, not as wrong tokens after a transfer.

KV rows: `prefill` returns [buffers, seq, row] in the pool's buffer order. For MLA a token's row in
layer i is its cached latent then its RoPE key (transformers keeps them as the layer's keys and
values); for MHA/GQA buffer i is layer i's K heads and buffer layers + i its V heads.
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from sglang_pd.deploy.kv.pages import KVCacheShape

from .sources import ModelSource, converted_gguf_dir, resolve_model
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["DEFAULT_SEED", "LoadedModel", "load_model", "sample_token"]

DEFAULT_SEED = 0


@dataclass
class LoadedModel:
    name: str
    model: Any
    tokenizer: Tokenizer
    kv_shape: KVCacheShape
    context_length: int  # the model's own (its config's max_position_embeddings)
    vocab_size: int  # token ids are 0 to vocab_size - 1
    weights_digest: str  # crc32 of every parameter: prefill and decode must run the same weights

    @property
    def num_layers(self) -> int:
        return self.kv_shape.num_layers

    # -- model steps (run on the engine's single model thread) --------------------------------

    @torch.inference_mode()
    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Last-position logits and the KV rows [buffers, len(ids), row] of a prompt."""
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        return out.logits[0, -1].float(), self.rows_from_cache(out.past_key_values, len(ids))

    def rows_from_cache(self, cache: Any, seq: int) -> torch.Tensor:
        def flat(t: torch.Tensor) -> torch.Tensor:  # [1, heads, seq, dim] -> [seq, heads * dim]
            return t[0].transpose(0, 1).reshape(seq, -1)

        layers = cache.layers
        if self.kv_shape.attention == "mla":
            return torch.stack([torch.cat([flat(layer.keys), flat(layer.values)], -1) for layer in layers])
        return torch.stack([flat(layer.keys) for layer in layers] + [flat(layer.values) for layer in layers])

    def cache_from_rows(self, rows: torch.Tensor) -> Any:
        """A transformers cache holding the KV rows [buffers, seq, row]."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        s = self.kv_shape
        seq = rows.shape[1]

        def heads(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:  # [seq, n * dim] -> [1, n, seq, dim]
            return t.reshape(seq, n, dim).transpose(0, 1).unsqueeze(0).contiguous()

        split = s.key_heads * s.key_dim
        for i in range(s.num_layers):
            if s.attention == "mla":
                k, v = rows[i, :, :split], rows[i, :, split:]
            else:
                k, v = rows[i], rows[s.num_layers + i]
            cache.update(heads(k, s.key_heads, s.key_dim), heads(v, s.value_heads, s.value_dim), i)
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
    """Greedy when temperature is 0; otherwise temperature/top-k/top-p sampling seeded per (seed, step).

    Numerically safe for any temperature > 0 and top_p in (0, 1]: the logits are shifted by their
    maximum and scaled in float64, so a tiny temperature (1e-50) sharpens towards greedy instead of
    overflowing to NaN, and the most likely token always survives top-p, so a tiny top_p (5e-324)
    keeps one token instead of none.
    """
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = (logits.double() - logits.max().double()) / temperature
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return int(torch.argmax(logits))
    if top_k > 0:
        kth = torch.topk(probs, min(top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p * sorted_p.sum()
        keep[0] = True
        mask = torch.zeros_like(probs, dtype=torch.bool).scatter(0, idx[keep], True)
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _digest(model: Any) -> str:
    crc = 0
    for name, p in sorted(model.state_dict().items()):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(memoryview(p.detach().contiguous().cpu().numpy()).cast("B"), crc)
    return f"{crc:08x}"


def _check_kv_shape(model: Any, shape: KVCacheShape) -> None:
    """Fail at load when transformers caches something else than the config-derived shape says."""
    with torch.inference_mode():
        cache = model(input_ids=torch.tensor([[2, 3]]), use_cache=True).past_key_values
    k, v = cache.layers[0].keys, cache.layers[0].values
    seen = (len(cache.layers), int(k.shape[1]), int(k.shape[3]), int(v.shape[1]), int(v.shape[3]))
    want = (shape.num_layers, shape.key_heads, shape.key_dim, shape.value_heads, shape.value_dim)
    if seen != want:
        raise RuntimeError(
            f"The model config gives the KV cache shape {shape.describe()} (layers, key heads x dim, value heads x "
            f"dim = {want}), but transformers caches {seen}; this model's attention is not one the reference "
            "engine can page."
        )


_INIT_LOCK = threading.Lock()


def _random_deepseek_v3(source: ModelSource, seed: int) -> Any:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    raw = json.loads(source.path.read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "torch_dtype", "auto_map")}
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return DeepseekV3ForCausalLM(DeepseekV3Config(**raw)).float().eval()


def load_model(model: str | None = None, *, seed: int = DEFAULT_SEED, threads: int | None = None) -> LoadedModel:
    """Load `model` (a `--model` value, see sources.py; None: the default SmolLM2) on CPU in float32."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    source = resolve_model(model)
    tokenizer: Tokenizer
    if source.kind == "random-deepseek-v3":
        net = _random_deepseek_v3(source, seed)
        tokenizer = ByteTokenizer()
    else:
        path = converted_gguf_dir(source.path) if source.kind == "gguf" else source.path
        net = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
        tokenizer = HFTokenizer(str(path))
    shape = KVCacheShape.from_config(net.config)
    _check_kv_shape(net, shape)
    return LoadedModel(
        name=source.name,
        model=net,
        tokenizer=tokenizer,
        kv_shape=shape,
        context_length=int(getattr(net.config, "max_position_embeddings", 4096)),
        vocab_size=int(net.get_input_embeddings().num_embeddings),
        weights_digest=_digest(net),
    )
