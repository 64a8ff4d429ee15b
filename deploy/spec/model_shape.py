"""What a model's config.json says of its size: the one reader of parameter counts and weight dtypes.

`ModelShape` is the full shape of a DeepSeek-V3-class model (MLA + MoE) that the estimate's
roofline needs; `checkpoint_bytes` is the checkpoint size of any decoder (dense or MoE, MHA, GQA or
MLA) that startup budgets are computed from. Both count MLA's projections and detect FP8 here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "ShapeError", "checkpoint_bytes", "linear_weight_bytes"]


class ShapeError(ValueError):
    """The config.json lacks a field the estimate needs."""


def linear_weight_bytes(cfg: dict[str, Any]) -> int:
    """Bytes per linear-layer weight: 1 for an FP8 checkpoint (`quant_method` fp8, or a variant
    such as `fp8_block`), else 2; embeddings and the LM head stay 16-bit either way."""
    quant = cfg.get("quantization_config") or {}
    return 1 if str(quant.get("quant_method", "")).startswith("fp8") else 2


def _req(cfg: dict[str, Any], key: str) -> int:
    if key not in cfg or cfg[key] is None:
        raise ShapeError(
            f"model.config_json: the estimate needs {key!r} (a DeepSeek-V3-style MLA + MoE config); "
            "point model.config_json at the model's own config.json."
        )
    return int(cfg[key])


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of the model; parameter counts are per layer unless named otherwise."""

    hidden: int
    layers: int
    dense_layers: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    dense_intermediate: int
    moe_intermediate: int
    routed_experts: int
    shared_experts: int
    topk: int
    n_group: int
    topk_group: int
    vocab: int
    weight_bytes: float  # 1 for an FP8 checkpoint, 2 for bf16

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        layers = _req(cfg, "num_hidden_layers")
        return cls(
            hidden=_req(cfg, "hidden_size"),
            layers=layers,
            dense_layers=min(int(cfg.get("first_k_dense_replace", 0)), layers),
            heads=_req(cfg, "num_attention_heads"),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=_req(cfg, "kv_lora_rank"),
            qk_nope_dim=_req(cfg, "qk_nope_head_dim"),
            qk_rope_dim=_req(cfg, "qk_rope_head_dim"),
            v_head_dim=_req(cfg, "v_head_dim"),
            dense_intermediate=_req(cfg, "intermediate_size"),
            moe_intermediate=_req(cfg, "moe_intermediate_size"),
            routed_experts=_req(cfg, "n_routed_experts"),
            shared_experts=int(cfg.get("n_shared_experts") or 0),
            topk=_req(cfg, "num_experts_per_tok"),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            vocab=_req(cfg, "vocab_size"),
            weight_bytes=float(linear_weight_bytes(cfg)),
        )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def kv_width(self) -> int:
        """Elements cached per token per layer: MLA's compressed latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_dim

    def attention_params(self, attn_tp: int) -> tuple[int, int]:
        """(replicated, head-sharded / attn_tp) projection parameters of one layer on one GPU."""
        qk = self.qk_nope_dim + self.qk_rope_dim
        if self.q_lora_rank:
            q_down, q_up = self.hidden * self.q_lora_rank, self.q_lora_rank * self.heads * qk
        else:
            q_down, q_up = 0, self.hidden * self.heads * qk
        kv_down = self.hidden * self.kv_width
        kv_up = self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
        out = self.heads * self.v_head_dim * self.hidden
        return q_down + kv_down, (q_up + kv_up + out) // attn_tp

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert: gate, up and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.dense_intermediate

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def weight_bytes_per_gpu(self, attn_tp: int, dense_tp: int, experts_per_gpu: float, lm_head_tp: int) -> float:
        """Bytes of weights one GPU holds (embedding and LM head in bf16, the rest in the checkpoint's dtype)."""
        replicated, sharded = self.attention_params(attn_tp)
        attention = self.layers * (replicated + sharded) * self.weight_bytes
        dense = self.dense_layers * self.dense_mlp_params / dense_tp * self.weight_bytes
        moe = self.moe_layers * (experts_per_gpu + self.shared_experts) * self.expert_params * self.weight_bytes
        embed_and_head = self.lm_head_params * 2 * (1 + 1 / lm_head_tp)
        return attention + dense + moe + embed_and_head


def _attention_params(cfg: dict[str, Any], hidden: int) -> int:
    heads = int(cfg.get("num_attention_heads") or 0)
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): low-rank Q and compressed KV projections
        replicated, sharded = ModelShape.from_config(cfg).attention_params(attn_tp=1)
        return replicated + sharded
    head_dim = int(cfg.get("head_dim") or hidden // max(heads, 1))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim


def checkpoint_bytes(cfg: dict[str, Any]) -> int:
    """Checkpoint size estimated from a config.json: parameters x bytes per parameter.

    Covers dense and MoE decoders with MHA/GQA or MLA attention, plus DeepSeek's next-token
    prediction layers. FP8 checkpoints store linear weights in one byte; embeddings stay 16-bit.
    """
    hidden = int(cfg.get("hidden_size") or 0)
    vocab = int(cfg.get("vocab_size") or 0)
    if not hidden or not vocab:
        raise ShapeError("model.config_json: needs hidden_size and vocab_size to estimate the checkpoint size.")
    layers = int(cfg.get("num_hidden_layers") or 0) + int(cfg.get("num_nextn_predict_layers") or 0)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    dense_layers = min(int(cfg.get("first_k_dense_replace", 0 if experts else layers)), layers)
    dense_mlp = 3 * hidden * int(cfg.get("intermediate_size") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
    moe_mlp = (experts + int(cfg.get("n_shared_experts") or 0)) * 3 * hidden * moe_inter + hidden * experts
    linear = layers * _attention_params(cfg, hidden) + dense_layers * dense_mlp + (layers - dense_layers) * moe_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return linear * linear_weight_bytes(cfg) + embeddings * 2
