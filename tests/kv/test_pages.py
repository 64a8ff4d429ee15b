from __future__ import annotations

import pytest

from sglang_pd.deploy.kv import KVConfig, PagedLayout, merge_page_runs, plan_page_writes
from sglang_pd.deploy.kv.pages import split_batches


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
