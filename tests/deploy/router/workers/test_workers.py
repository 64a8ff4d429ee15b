from __future__ import annotations

import pytest

from sglang_pd.deploy.router.exceptions import WorkerRegistrationError
from sglang_pd.deploy.router.workers.registry import WorkerRegistry, normalize_url


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("10.0.0.1:30000", "http://10.0.0.1:30000"),
        ("http://host:8000/", "http://host:8000"),
        ("https://Host.example:443", "https://host.example:443"),
        ("http://[fd00::1]:30000", "http://[fd00::1]:30000"),
    ],
)
def test_normalize_url(raw: str, expected: str) -> None:
    assert normalize_url(raw) == expected


@pytest.mark.parametrize("bad", ["ftp://x:1", "http://", "http://h:1/v1", "http://u:p@h:1", "http://h:99999"])
def test_normalize_url_rejects(bad: str) -> None:
    with pytest.raises(WorkerRegistrationError, match=r"Use http://HOST:PORT|invalid port"):
        normalize_url(bad)


def test_registry_add_remove_and_availability() -> None:
    registry = WorkerRegistry(breaker_failure_threshold=1, breaker_cooldown_s=60)
    events: list[tuple[str, str]] = []
    registry.subscribe(lambda event, w: events.append((event, w.url)))
    p = registry.add("127.0.0.1:1", "prefill", bootstrap_port=9000)
    d = registry.add("127.0.0.1:2", "decode")
    assert registry.add("http://127.0.0.1:1/", "prefill") is p, "adding twice is idempotent"
    assert p.bootstrap_host == "127.0.0.1" and p.bootstrap_port == 9000
    assert registry.available("prefill") == registry.available("decode") == [], "workers start unchecked"
    p.healthy = d.healthy = True
    assert registry.available("prefill") == [p] and registry.available("decode") == [d]
    d.breaker.record_failure()
    assert registry.available("decode") == []
    assert registry.remove("127.0.0.1:2") == [d]
    assert events == [("added", p.url), ("added", d.url), ("removed", d.url)]


def test_prefill_gets_default_bootstrap_port() -> None:
    registry = WorkerRegistry()
    assert registry.add("h:1", "prefill").bootstrap_port == 8998
    with pytest.raises(WorkerRegistrationError, match="role"):
        registry.add("h:1", "router")  # type: ignore[arg-type]
