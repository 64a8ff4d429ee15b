"""Real Mooncake TCP between this process and a peer process on loopback."""

from __future__ import annotations

import ctypes
import random
import time
import zlib
from collections.abc import Iterator

import pytest

from sglang_pd.deploy.kv import (
    BadAddress,
    KVTransferEngine,
    PagedLayout,
    PeerUnreachable,
    RegistrationRefused,
    get_engine,
)
from sglang_pd.deploy.kv.peer import PeerProcess, start_peer

PAGE = 4096
PAGES = 3000
LAYERS = 1


@pytest.fixture(scope="module")
def engine() -> KVTransferEngine:
    return get_engine()


@pytest.fixture(scope="module")
def source(engine: KVTransferEngine) -> tuple[int, memoryview]:
    buf = (ctypes.c_char * (PAGE * PAGES))()
    view = memoryview(buf).cast("B")
    rng = random.Random(0)
    view[:] = rng.randbytes(len(view))
    base = ctypes.addressof(buf)
    engine.register(base, len(view))
    source._keep = buf  # type: ignore[attr-defined]
    return base, view


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    with start_peer(PAGE * PAGES) as p:
        yield p


def test_write_fragmented_pages_over_1024_items(engine, source, peer) -> None:
    base, view = source
    src = PagedLayout((base,), PAGE, PAGES)
    dst = PagedLayout((peer.info.base,), PAGE, PAGES)
    src_pages = list(range(0, 2 * 1500, 2))  # 1500 runs of one page: two batches
    dst_pages = list(range(1500))
    before = engine.metrics.snapshot()
    result = engine.write_pages(peer.info.session_id, src, dst, src_pages, dst_pages)
    assert (result.items, result.batches, result.pages, result.bytes) == (1500, 2, 1500, 1500 * PAGE)
    expected = b"".join(bytes(view[p * PAGE : (p + 1) * PAGE]) for p in src_pages)
    assert peer.crc(0, 1500 * PAGE) == zlib.crc32(expected)
    after = engine.metrics.snapshot()
    assert after["bytes"] - before["bytes"] == 1500 * PAGE  # type: ignore[operator]
    assert after["batches"] - before["batches"] == 2  # type: ignore[operator]


def test_contiguous_pages_merge_into_one_item(engine, source, peer) -> None:
    base, view = source
    src = PagedLayout((base,), PAGE, PAGES)
    dst = PagedLayout((peer.info.base,), PAGE, PAGES)
    result = engine.write_pages(peer.info.session_id, src, dst, list(range(10, 110)), list(range(500, 600)))
    assert result.items == 1
    assert peer.crc(500 * PAGE, 100 * PAGE) == zlib.crc32(bytes(view[10 * PAGE : 110 * PAGE]))


def test_address_outside_peer_region_is_bad_address(engine, source, peer) -> None:
    base, _ = source
    t0 = time.monotonic()
    with pytest.raises(BadAddress, match="outside the peer's registered region"):
        engine.write(peer.info.session_id, [(base, peer.info.base + peer.info.length, PAGE)])
    assert time.monotonic() - t0 < 2
    # the layout check catches it before Mooncake does
    dst = PagedLayout((peer.info.base,), PAGE, 4)
    with pytest.raises(BadAddress, match="destination page 4"):
        engine.write_pages(peer.info.session_id, PagedLayout((base,), PAGE, PAGES), dst, [0], [4])
    # and the peer still takes good writes afterwards
    engine.write(peer.info.session_id, [(base, peer.info.base, PAGE)])


def test_unregistered_source_is_bad_address(engine, peer) -> None:
    with pytest.raises(BadAddress, match="not inside a region registered"):
        engine.write(peer.info.session_id, [(16, peer.info.base, PAGE)])


def test_dead_peer_is_reported_within_two_seconds(engine, source, peer) -> None:
    base, _ = source
    engine.write(peer.info.session_id, [(base, peer.info.base, PAGE)])  # connection established
    peer.kill()
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        engine.write(peer.info.session_id, [(base, peer.info.base, PAGE)] * 8)
    assert time.monotonic() - t0 < 2
    assert info.value.peer == peer.info.session_id
    assert engine.metrics.snapshot()["failures"]["PeerUnreachable"] >= 1  # type: ignore[index]
    with pytest.raises(PeerUnreachable):
        engine.probe(peer.info.session_id)


def test_never_started_peer_is_unreachable(engine, source) -> None:
    base, _ = source
    with pytest.raises(PeerUnreachable):
        engine.write("127.0.0.1:1", [(base, 4096, PAGE)])


def test_regions_register_once(engine, source) -> None:
    base, view = source
    engine.register(base, len(view))  # the same region again: a no-op
    with pytest.raises(RegistrationRefused, match="overlaps"):
        engine.register(base + PAGE, PAGE)


def test_one_engine_per_process(engine) -> None:
    from sglang_pd.deploy.kv import KVConfig

    assert get_engine() is engine
    with pytest.raises(RuntimeError, match="one engine per process"):
        get_engine(KVConfig(timeout_s=engine.config.timeout_s + 1))


def test_closed_engine_refuses_work() -> None:
    from sglang_pd.deploy.kv import KVConfig

    e = KVTransferEngine(KVConfig())
    e.close()
    with pytest.raises(RuntimeError, match="Cannot start a transfer, as the transfer engine has been closed"):
        e.write("127.0.0.1:1", [])
