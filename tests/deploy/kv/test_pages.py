from __future__ import annotations

import json

import pytest

from sglang_pd.deploy.kv import KVConfig, PagedLayout, merge_page_runs, plan_page_writes
from sglang_pd.deploy.kv.pages import KVCacheShape, split_batches
from sglang_pd.deploy.spec.topology import PRESETS_DIR


def test_merge_page_runs() -> None:
    assert merge_page_runs([0, 1, 2, 7, 8], [5, 6, 7, 9, 3]) == [(0, 5, 3), (7, 9, 1), (8, 3, 1)]
    assert merge_page_runs([], []) == []
    with pytest.raises(ValueError, match="must match"):
        merge_page_runs([1], [])


def test_plan_page_writes_per_layer() -> None:
    src = PagedLayout((1000, 5000), page_bytes=10, num_pages=100)
    dst = PagedLayout((90000, 70000), page_bytes=10, num_pages=8)
    items = plan_page_writes(src, dst, [3, 4, 9], [0, 1, 5])
    assert items == [(1030, 90000, 20), (1090, 90050, 10), (5030, 70000, 20), (5090, 70050, 10)]
    with pytest.raises(IndexError, match="destination page 8"):
        plan_page_writes(src, dst, [0], [8])
    with pytest.raises(ValueError, match="page size"):
        plan_page_writes(src, PagedLayout((1,), 10, 8), [0], [0])


def test_split_batches() -> None:
    items = [(i, i, 1) for i in range(2500)]
    assert [len(b) for b in split_batches(items, 1024)] == [1024, 1024, 452]


def test_config_from_env() -> None:
    c = KVConfig.from_env({"SGLANG_PD_KV_TIMEOUT_S": "2.5", "SGLANG_PD_KV_HOSTNAME": "10.0.0.1"})
    assert c == KVConfig(timeout_s=2.5, hostname="10.0.0.1")
    with pytest.raises(ValueError, match=r"'SGLANG_PD_KV_TIMEOUT_S' has value 'abc'\. Not a valid float"):
        KVConfig.from_env({"SGLANG_PD_KV_TIMEOUT_S": "abc"})
    with pytest.raises(ValueError, match="MAX_BATCH_ITEMS"):
        KVConfig(max_batch_items=4096)


PRESETS = PRESETS_DIR


def _config(name: str) -> dict[str, object]:
    return dict(json.loads((PRESETS / name).read_text()))


def test_kv_shape_of_deepseek_v3_is_mla_latent_rows() -> None:
    shape = KVCacheShape.from_config(_config("deepseek-v3-config.json"))
    assert shape == KVCacheShape("mla", num_layers=61, key_heads=1, key_dim=512, value_heads=1, value_dim=64)
    # sglang's MLA pool: one buffer per layer, a token's row is kv_lora_rank + qk_rope_head_dim elements.
    assert shape.num_buffers == 61 and shape.row_elements == 576
    assert shape.page_bytes(64, element_bytes=2) == 64 * 576 * 2


def test_kv_shape_of_a_llama_style_gqa_model_is_k_and_v_heads() -> None:
    shape = KVCacheShape.from_config(_config("smollm2-135m-instruct-config.json"))
    assert shape == KVCacheShape("mha", num_layers=30, key_heads=3, key_dim=64, value_heads=3, value_dim=64)
    # A K and a V buffer per layer, each row num_key_value_heads x head_dim.
    assert shape.num_buffers == 60 and shape.row_elements == 192
    # Without head_dim or num_key_value_heads: hidden_size / heads, and one KV head per query head.
    plain = KVCacheShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    assert (plain.key_heads, plain.key_dim, plain.num_buffers) == (4, 64, 4)


def test_kv_shape_refuses_configs_it_cannot_page() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVCacheShape.from_config({"num_attention_heads": 4})
    with pytest.raises(ValueError, match="neither kv_lora_rank"):
        KVCacheShape.from_config({"model_type": "mamba", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        KVCacheShape.from_config({"num_hidden_layers": 2, "kv_lora_rank": 64})
