"""Write seeded random weights for a DeepSeek-V3-shaped FP8 model folder: `model.safetensors` beside its config.json.

sglang's `--load-format dummy` draws every weight from U(-1e-3, 1e-3); in FP8 (e4m3, smallest
subnormal 2^-9) nearly all of those round to zero, so the routed experts, the path SBO changes,
would add nothing and any comparison through them would pass trivially. This writes weights with
unit-scale activations instead (each matrix ~ N(0, 1/fan_in)), in the checkpoint layout sglang's
DeepSeek loader reads (the Hugging Face DeepSeek-V3 names): the routed experts' projections as
FP8 e4m3 with one float32 `weight_scale_inv` per 128x128 block (DeepSeek-V3's block scales, the
layout DeepGEMM and our kernel take), everything the config's `modules_to_not_convert` names in
bf16.

    python scripts/gpu/fp8_checkpoint.py deploy/spec/presets/models/tiny-deepseek-v3-fp8 [--seed 0]

On a GPU the weights are drawn there (seconds for ~1.5 GB); on CPU it works, slower.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = 128  # DeepSeek-V3's weight_block_size


def _normal(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / fan_in**0.5


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] as e4m3 and its per-128x128 dequantization scales (`weight_scale_inv`: w ~= q * s)."""
    n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"FP8 block quantization needs both dimensions divisible by {BLOCK}, got {n}x{k}")
    blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def tensors(cfg: dict[str, object], seed: int, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, by its Hugging Face DeepSeek-V3 name."""

    def get(key: str) -> int:
        value = cfg[key]
        assert isinstance(value, int), f"config.json: {key} must be an integer"
        return value

    h, vocab, layers = get("hidden_size"), get("vocab_size"), get("num_hidden_layers")
    heads, q_lora, kv_lora = get("num_attention_heads"), get("q_lora_rank"), get("kv_lora_rank")
    nope, rope, v = get("qk_nope_head_dim"), get("qk_rope_head_dim"), get("v_head_dim")
    experts, moe_i, dense_i = get("n_routed_experts"), get("moe_intermediate_size"), get("intermediate_size")
    shared_i = moe_i * get("n_shared_experts")
    gen = torch.Generator(device=device).manual_seed(seed)

    def bf16(name: str, shape: tuple[int, int]) -> tuple[str, torch.Tensor]:
        return name, _normal(shape, shape[1], gen, device).to(torch.bfloat16)

    def ones(name: str, n: int) -> tuple[str, torch.Tensor]:
        return name, torch.ones(n, dtype=torch.bfloat16, device=device)

    yield "model.embed_tokens.weight", torch.randn(vocab, h, generator=gen, device=device).to(torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield ones(f"{p}.input_layernorm.weight", h)
        yield ones(f"{p}.post_attention_layernorm.weight", h)
        yield bf16(f"{p}.self_attn.q_a_proj.weight", (q_lora, h))
        yield ones(f"{p}.self_attn.q_a_layernorm.weight", q_lora)
        yield bf16(f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora))
        yield bf16(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h))
        yield ones(f"{p}.self_attn.kv_a_layernorm.weight", kv_lora)
        yield bf16(f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora))
        yield bf16(f"{p}.self_attn.o_proj.weight", (h, heads * v))
        if i < get("first_k_dense_replace"):
            yield bf16(f"{p}.mlp.gate_proj.weight", (dense_i, h))
            yield bf16(f"{p}.mlp.up_proj.weight", (dense_i, h))
            yield bf16(f"{p}.mlp.down_proj.weight", (h, dense_i))
            continue
        yield f"{p}.mlp.gate.weight", _normal((experts, h), h, gen, device).to(torch.bfloat16)
        yield f"{p}.mlp.gate.e_score_correction_bias", torch.zeros(experts, dtype=torch.float32, device=device)
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                q, scale = quantize_blocks(_normal(shape, shape[1], gen, device))
                yield f"{p}.mlp.experts.{e}.{proj}.weight", q
                yield f"{p}.mlp.experts.{e}.{proj}.weight_scale_inv", scale
        yield bf16(f"{p}.mlp.shared_experts.gate_proj.weight", (shared_i, h))
        yield bf16(f"{p}.mlp.shared_experts.up_proj.weight", (shared_i, h))
        yield bf16(f"{p}.mlp.shared_experts.down_proj.weight", (h, shared_i))
    yield ones("model.norm.weight", h)
    yield bf16("lm_head.weight", (vocab, h))


def write(model_dir: Path, seed: int = 0) -> Path:
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config", {}).get("weight_block_size") != [BLOCK, BLOCK]:
        raise SystemExit(f"error: {model_dir}/config.json: quantization_config.weight_block_size must be [128, 128]")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {name: t.contiguous().cpu() for name, t in tensors(cfg, seed, device)}
    out = model_dir / "model.safetensors"
    tmp = out.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "seed": str(seed)})
    tmp.replace(out)  # a half-written file never carries the final name
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a folder with a DeepSeek-V3 config.json (FP8 128x128 blocks)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write(args.model_dir, args.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
