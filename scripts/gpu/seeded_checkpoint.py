"""Write seeded weights for a DeepSeek-V3-shaped model folder: `model.safetensors` beside its config.json.

sglang's `--load-format dummy` draws every parameter, RMSNorm weights included, from U(-1e-3, 1e-3)
(`initialize_dummy_weights` in srt/model_loader/weight_utils.py). Each layer then adds about 1e-5
of the embedding to the residual stream, below bf16's resolution: the model answers from the last
token alone, and a missing or corrupted KV page changes nothing. The weights written here make the
answer depend on the whole prompt: RMSNorm weights are ones, every matrix is N(0, 1/fan_in)
(std 0.03 at fan-in 1024, in the range of Hugging Face's `initializer_range`), so queries and keys
reach unit scale and attention spreads over the context. Names are the Hugging Face DeepSeek-V3
ones, which sglang's DeepSeek loader and transformers' `DeepseekV3ForCausalLM` both read.

    python scripts/gpu/seeded_checkpoint.py deploy/spec/presets/models/tiny-deepseek-v3-bf16 [--seed 0]

The bf16 weights are drawn on the CPU whatever the machine, so the GPU machine writes the same
bytes that `tests/scripts/test_seeded_checkpoint.py` loads into transformers (about 1 s for the
single-h200 model). `fp8_checkpoint.py` draws the same tensors in the same order and quantizes the
routed experts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from sglang_pd.deploy.evals.data import sha256_of

#: What the writer does with one routed expert's projection (drawn in float32): the tensors to store.
ExpertWeight = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def normal(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """N(0, 1/fan_in) in float32: a unit-scale input gives a unit-scale output."""
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) / fan_in**0.5


def bf16_expert(name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    return [(name, w.to(torch.bfloat16))]


def config_int(cfg: dict[str, object], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int):
        raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def tensors(
    cfg: dict[str, object], seed: int, device: str, expert: ExpertWeight = bf16_expert
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, by its Hugging Face DeepSeek-V3 name; `expert` stores each
    routed expert's projection (bf16 here, FP8 blocks in fp8_checkpoint.py)."""

    def get(key: str) -> int:
        return config_int(cfg, key)

    h, vocab, layers = get("hidden_size"), get("vocab_size"), get("num_hidden_layers")
    heads, q_lora, kv_lora = get("num_attention_heads"), get("q_lora_rank"), get("kv_lora_rank")
    nope, rope, v = get("qk_nope_head_dim"), get("qk_rope_head_dim"), get("v_head_dim")
    experts, moe_i, dense_i = get("n_routed_experts"), get("moe_intermediate_size"), get("intermediate_size")
    shared_i = moe_i * get("n_shared_experts")
    gen = torch.Generator(device=device).manual_seed(seed)

    def bf16(name: str, shape: tuple[int, int]) -> tuple[str, torch.Tensor]:
        return name, normal(shape, shape[1], gen, device).to(torch.bfloat16)

    def ones(name: str, n: int) -> tuple[str, torch.Tensor]:
        return name, torch.ones(n, dtype=torch.bfloat16, device=device)

    yield (
        "model.embed_tokens.weight",
        torch.randn(vocab, h, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16),
    )
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
        yield f"{p}.mlp.gate.weight", normal((experts, h), h, gen, device).to(torch.bfloat16)
        yield f"{p}.mlp.gate.e_score_correction_bias", torch.zeros(experts, dtype=torch.float32, device=device)
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                yield from expert(f"{p}.mlp.experts.{e}.{proj}.weight", normal(shape, shape[1], gen, device))
        yield bf16(f"{p}.mlp.shared_experts.gate_proj.weight", (shared_i, h))
        yield bf16(f"{p}.mlp.shared_experts.up_proj.weight", (shared_i, h))
        yield bf16(f"{p}.mlp.shared_experts.down_proj.weight", (h, shared_i))
    yield ones("model.norm.weight", h)
    yield bf16("lm_head.weight", (vocab, h))


def save(model_dir: Path, named: Iterable[tuple[str, torch.Tensor]]) -> Path:
    """Write `model_dir/model.safetensors` atomically: a half-written file never carries the final name."""
    from safetensors.torch import save_file

    state = {name: t.contiguous().cpu() for name, t in named}
    out = model_dir / "model.safetensors"
    tmp = out.with_suffix(".tmp")
    # One metadata key only: safetensors writes the metadata map in an order that varies between
    # processes, and the file's sha256 names the weights in the check's report.
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out)
    return out


def write(model_dir: Path, seed: int = 0) -> Path:
    """The bf16 checkpoint of `model_dir/config.json`, drawn on the CPU (the same bytes on any machine)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    if "quantization_config" in cfg:
        raise SystemExit(
            f"error: {model_dir}/config.json has a quantization_config: write its weights with "
            "scripts/gpu/fp8_checkpoint.py, or remove the key for a bf16 model"
        )
    return save(model_dir, tensors(cfg, seed, "cpu"))


# The file's sha256 names the exact weights a report ran with; the gsm8k loader already has the helper.
sha256 = sha256_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a folder with a DeepSeek-V3 config.json (bf16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write(args.model_dir, args.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB, sha256 {sha256(out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
