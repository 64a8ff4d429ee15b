"""Parameter counts and per-token sizes of a DeepSeek-V3-class model (MLA + MoE), from its config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "ShapeError"]


class ShapeError(ValueError):
    """The config.json lacks a field the estimate needs."""


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
        quant = (cfg.get("quantization_config") or {}).get("quant_method")
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
            weight_bytes=1.0 if quant == "fp8" else 2.0,
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
