"""Serving takes start-up's objects out of the garbage collector's passes and collects young
objects less often; cycles made while serving are still collected."""

from __future__ import annotations

import gc
import weakref

from sglang_pd.deploy.router import server


def test_start_up_objects_are_frozen_and_young_collections_are_rarer() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0  # the control: nothing frozen before
    try:
        server._settle_garbage_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (server._GC_YOUNG_THRESHOLD, *before[1:])

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
