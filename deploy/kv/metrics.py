"""Transfer metrics: counters a process exposes on /metrics (bytes, pages, items, duration)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["TransferMetrics", "TransferResult"]


@dataclass(frozen=True)
class TransferResult:
    """What one completed write moved."""

    peer: str
    bytes: int
    pages: int
    items: int
    batches: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class TransferMetrics:
    """Process-wide counters; thread-safe."""

    transfers: int = 0
    bytes: int = 0
    pages: int = 0
    items: int = 0
    batches: int = 0
    seconds: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, result: TransferResult) -> None:
        with self._lock:
            self.transfers += 1
            self.bytes += result.bytes
            self.pages += result.pages
            self.items += result.items
            self.batches += result.batches
            self.seconds += result.seconds

    def record_failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] = self.failures.get(kind, 0) + 1

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "transfers": self.transfers,
                "bytes": self.bytes,
                "pages": self.pages,
                "items": self.items,
                "batches": self.batches,
                "seconds": self.seconds,
                "failures": dict(self.failures),
            }

    def prometheus(self, prefix: str = "sglang_pd_kv") -> str:
        """The counters in Prometheus' text format."""
        s = self.snapshot()
        lines = []
        for name, help_text in (
            ("transfers", "completed KV writes"),
            ("bytes", "bytes written to peers"),
            ("pages", "KV pages written to peers"),
            ("items", "transfer items (merged page runs x layers) submitted"),
            ("batches", "batch calls into Mooncake"),
            ("seconds", "seconds spent in completed writes"),
        ):
            lines += [f"# HELP {prefix}_{name}_total {help_text}", f"# TYPE {prefix}_{name}_total counter"]
            lines.append(f"{prefix}_{name}_total {s[name]}")
        lines += [
            f"# HELP {prefix}_failures_total failed KV writes by error class",
            f"# TYPE {prefix}_failures_total counter",
        ]
        failures = s["failures"]
        assert isinstance(failures, dict)
        for kind, n in sorted(failures.items()):
            lines.append(f'{prefix}_failures_total{{error="{kind}"}} {n}')
        return "\n".join(lines) + "\n"
