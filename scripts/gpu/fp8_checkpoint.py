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
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from seeded_checkpoint import save
from seeded_checkpoint import tensors as seeded_tensors

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = 128  # DeepSeek-V3's weight_block_size


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] as e4m3 and its per-128x128 dequantization scales (`weight_scale_inv`: w ~= q * s)."""
    n, k = w.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"FP8 block quantization needs both dimensions divisible by {BLOCK}, got {n}x{k}")
    blocks = w.view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(n, k)
    return q, scale


def fp8_expert(name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    q, scale = quantize_blocks(w)
    return [(name, q), (name.replace(".weight", ".weight_scale_inv"), scale)]


def tensors(cfg: dict[str, object], seed: int, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, by its Hugging Face DeepSeek-V3 name (seeded_checkpoint.py's
    draws, the routed experts in FP8 blocks)."""
    return seeded_tensors(cfg, seed, device, expert=fp8_expert)


def write(model_dir: Path, seed: int = 0) -> Path:
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("quantization_config", {}).get("weight_block_size") != [BLOCK, BLOCK]:
        raise SystemExit(f"error: {model_dir}/config.json: quantization_config.weight_block_size must be [128, 128]")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return save(model_dir, tensors(cfg, seed, device))


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
