"""Prefix affinity balanced against load (prefill only).

The prompt text is cut into blocks of `block_chars`; each block's hash is chained with the
previous one, so a hash names a whole prefix. For each worker we remember (LRU-bounded) the
prefix hashes it has served. A request goes to the worker holding its longest prefix when that
prefix covers at least `cache_threshold` of the prompt, unless the load is imbalanced (the
busiest worker has more than `balance_abs_threshold` and `balance_rel_threshold` times the idlest
worker's in-flight requests): then, and on a cache miss, the least-loaded worker wins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Policy, RoutingRequest
from .least_load import LeastLoad

if TYPE_CHECKING:
    from ..workers.registry import Worker

__all__ = ["CacheAware", "prefix_hashes"]


def prefix_hashes(text: str, block_chars: int) -> list[int]:
    hashes: list[int] = []
    h = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[start : start + block_chars]))
        hashes.append(h)
    return hashes


class CacheAware(Policy):
    name = "cache_aware"
    needs_text = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        block_chars: int = 64,
        max_entries_per_worker: int = 200_000,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_chars = block_chars
        self.max_entries_per_worker = max_entries_per_worker
        self._trees: dict[str, OrderedDict[int, None]] = {}
        self._fallback = LeastLoad()

    def select(self, workers: Sequence[Worker], request: RoutingRequest) -> Worker:
        hashes = prefix_hashes(request.text, self.block_chars)
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        imbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        chosen: Worker | None = None
        if hashes and not imbalanced:
            best_len = 0
            for w in workers:
                n = self._match(w.url, hashes)
                if n > best_len or (n == best_len and chosen is not None and w.in_flight < chosen.in_flight):
                    best_len, chosen = n, w
            if chosen is not None and best_len / len(hashes) < self.cache_threshold:
                chosen = None
        if chosen is None:
            chosen = self._fallback.select(workers, request)
        self._insert(chosen.url, hashes)
        return chosen

    def forget(self, worker: Worker) -> None:
        self._trees.pop(worker.url, None)

    def remembers(self, worker: Worker) -> bool:
        """Whether a prefix tree is kept for `worker`."""
        return worker.url in self._trees

    def _match(self, url: str, hashes: list[int]) -> int:
        tree = self._trees.get(url)
        if not tree:
            return 0
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _insert(self, url: str, hashes: list[int]) -> None:
        if not hashes:
            return
        tree = self._trees.setdefault(url, OrderedDict())
        for h in hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_entries_per_worker:
            tree.popitem(last=False)
