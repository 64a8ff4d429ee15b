"""A request's prompt text and batch size are derived once, however many steps read them (the
capacity estimate, the cache-aware prefill policy, the prefix's DP rank): the routing
text of a long prompt is a copy of all of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router.api import validation

from ..conftest import Cluster


def test_routing_text_and_batch_size_are_derived_once_per_request(
    cluster_factory: Callable[..., Cluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"text": 0, "batch": 0}
    text_of, batch_of = validation._routing_text, validation._batch_size

    # The router's calls only: the in-process test workers read the legs' bodies (with bootstrap fields).
    def counted_text(payload: dict[str, Any]) -> str:
        calls["text"] += "bootstrap_room" not in payload
        return text_of(payload)

    def counted_batch(payload: dict[str, Any]) -> int | None:
        calls["batch"] += "bootstrap_room" not in payload
        return batch_of(payload)

    monkeypatch.setattr(validation, "_routing_text", counted_text)
    monkeypatch.setattr(validation, "_batch_size", counted_batch)
    cluster = cluster_factory(1, 1, dp_size=2)
    config = cluster.config(prefill_policy="cache_aware")
    with cluster.serve(config) as running:
        chat = {"messages": [{"role": "user", "content": "a long prompt " * 500}], "max_tokens": 2}
        assert httpx.post(running.url + "/v1/chat/completions", json=chat, timeout=10).status_code == 200
        assert calls["text"] == 1, calls
        batch = {"text": ["one prompt", "another prompt"], "sampling_params": {"max_new_tokens": 2}}
        answer = httpx.post(running.url + "/generate", json=batch, timeout=10)
        assert answer.status_code == 200 and len(answer.json()) == 2
        assert calls == {"text": 2, "batch": 1}, calls
