"""The SBO preset's weights: DeepSeek-V3 names, FP8 only where the config quantizes, scales that dequantize."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from sglang_pd.deploy.spec.topology import PRESETS_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
fp8_checkpoint = importlib.import_module("fp8_checkpoint")

CONFIG = PRESETS_DIR / "models/tiny-deepseek-v3-fp8/config.json"


def _small_config() -> dict[str, object]:
    """The preset's config, shrunk (same structure) so the test writes kilobytes."""
    cfg = json.loads(CONFIG.read_text())
    cfg.update(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128)
    cfg.update(num_attention_heads=2, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2)
    return cfg


def test_block_scales_dequantize_within_fp8_precision() -> None:
    w = torch.randn(256, 384) * torch.logspace(-3, 1, 384)  # columns of very different size
    q, scale = fp8_checkpoint.quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = (q.float().view(2, 128, 3, 128) * scale[:, None, :, None]).view(256, 384)
    blocks = w.view(2, 128, 3, 128).abs().amax(dim=(1, 3))
    err = (back - w).abs().view(2, 128, 3, 128).amax(dim=(1, 3))
    assert bool((err <= blocks * 2**-3).all())  # e4m3 keeps 3 mantissa bits: within 1/8 of the block's max


def test_block_quantization_refuses_ragged_shapes() -> None:
    with pytest.raises(ValueError, match="divisible by 128"):
        fp8_checkpoint.quantize_blocks(torch.zeros(100, 128))


def test_names_and_dtypes_follow_the_config(tmp_path: Path) -> None:
    cfg = _small_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = fp8_checkpoint.write(tmp_path, seed=1)
    from safetensors.torch import load_file

    state = load_file(str(out))
    fp8 = {k for k, v in state.items() if v.dtype == torch.float8_e4m3fn}
    experts, layers = 4, int(cfg["num_hidden_layers"])  # type: ignore[call-overload]
    assert len(fp8) == (layers - 1) * experts * 3  # routed experts only: the rest is in modules_to_not_convert
    assert all(".mlp.experts." in k for k in fp8)
    for k in fp8:
        assert state[k.replace(".weight", ".weight_scale_inv")].dtype == torch.float32
    assert state["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # the dense layer
    assert state["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == torch.bfloat16
    assert state["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (128 + 64, 256)
    assert state["model.layers.2.mlp.experts.3.down_proj.weight"].shape == (256, 128)
    assert state["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    assert not list(tmp_path.glob("*.tmp"))


def test_the_preset_config_is_what_the_kernels_take() -> None:
    cfg = json.loads(CONFIG.read_text())
    assert cfg["hidden_size"] == 7168  # a hidden size DeepEP's low-latency kernels are built for
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert cfg["moe_intermediate_size"] % 128 == 0 and cfg["n_routed_experts"] % cfg["n_group"] == 0
