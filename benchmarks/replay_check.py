"""Bit-for-bit replay checks: each replay's output against the baseline's, and the verdict.

A CUDA graph replayed many times on one input, with its outputs left in place between replays,
cannot show a consumer that read a row before the producer wrote it: the row still holds the
previous replay's value, which is the right one. So `benchmarks/bench_moe_layer.py` copies a fresh
random input into the graphs' static input before every replay, fills the output buffers with NaN,
replays the baseline (no overlap) and each checked variant on that input, and counts the elements
whose bits differ. This module holds the counting and the verdicts; it runs on the CPU as well.

A check is trusted only if it can fail: a *must-fail* control (a variant that skips one signal
wait on purpose) has to produce at least one mismatching replay, or the run fails.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReplayTally", "bits", "merge_tallies", "mismatched_elements", "run_replays", "summarize"]

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of the same width: NaN equals the same NaN, -0.0 differs from 0.0."""
    try:
        return t.view(_SAME_WIDTH_INT[t.element_size()])
    except KeyError:
        raise ValueError(f"cannot compare {t.dtype} bit for bit: elements of {t.element_size()} bytes") from None


def mismatched_elements(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The number of elements whose bits differ, as a 0-dim int64 tensor on their device (no host
    synchronisation, so it can be queued after every replay)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        raise ValueError(
            f"output {tuple(out.shape)} {out.dtype} and baseline {tuple(ref.shape)} {ref.dtype} differ in shape or "
            "dtype: compare a variant's output with the baseline's of the same input"
        )
    return (bits(out) != bits(ref)).sum()


@dataclass
class ReplayTally:
    """One variant's replays: how many, how many differed from the baseline, and where first."""

    name: str
    must_fail: bool = False
    replays: int = 0
    mismatched_replays: int = 0
    mismatched_elements: int = 0
    first_mismatch: int | None = None
    #: replays whose baseline output was not finite: the baseline itself read a poisoned row
    baseline_nonfinite: int = 0

    def add(self, replay: int, mismatched: int, baseline_nonfinite: int = 0) -> None:
        if mismatched < 0 or baseline_nonfinite < 0:
            raise ValueError(f"{self.name}: counts must be >= 0, got {mismatched} and {baseline_nonfinite}")
        self.replays += 1
        if baseline_nonfinite:
            self.baseline_nonfinite += 1
        if mismatched:
            self.mismatched_replays += 1
            self.mismatched_elements += mismatched
            if self.first_mismatch is None:
                self.first_mismatch = replay

    def verdict(self) -> dict[str, Any]:
        """``ok`` and why: a checked variant equals the baseline in every replay; a must-fail control
        differs in at least one (it is caught)."""
        if self.replays == 0:
            return {"ok": False, "why": f"{self.name}: no replay ran"}
        if self.baseline_nonfinite:
            return {
                "ok": False,
                "why": f"{self.name}: the baseline's output was not finite in {self.baseline_nonfinite} of "
                f"{self.replays} replays (it read a poisoned row itself)",
            }
        if self.must_fail:
            if self.mismatched_replays:
                return {
                    "ok": True,
                    "why": f"control {self.name} caught: {self.mismatched_replays} of {self.replays} replays differed "
                    f"(first at replay {self.first_mismatch})",
                }
            return {
                "ok": False,
                "why": f"control {self.name} NOT caught: all {self.replays} replays equalled the baseline, so "
                "this check cannot see a skipped signal wait",
            }
        if self.mismatched_replays:
            return {
                "ok": False,
                "why": f"{self.name}: {self.mismatched_replays} of {self.replays} replays differed from the baseline "
                f"({self.mismatched_elements} elements; first at replay {self.first_mismatch})",
            }
        return {"ok": True, "why": f"{self.name}: bit-equal to the baseline in all {self.replays} replays"}

    def as_dict(self) -> dict[str, Any]:
        return {
            "must_fail": self.must_fail,
            "replays": self.replays,
            "mismatched_replays": self.mismatched_replays,
            "mismatched_elements": self.mismatched_elements,
            "first_mismatch": self.first_mismatch,
            "baseline_nonfinite": self.baseline_nonfinite,
            **self.verdict(),
        }


def run_replays(
    replays: int,
    *,
    load_input: Callable[[int], object],
    poison: Callable[[], None],
    baseline: Callable[[], torch.Tensor],
    variants: dict[str, Callable[[], torch.Tensor]],
    must_fail: Collection[str] = (),
    every: tuple[int, Callable[[int], None]] | None = None,
) -> dict[str, ReplayTally]:
    """``replays`` rounds of: ``load_input(i)`` (a fresh input into the static input), then the
    baseline and each variant, each after ``poison()`` and each returning its output buffer; every
    variant's output is compared bit for bit with the baseline's of the same round. The counts stay
    on the outputs' device until the end (no synchronisation per replay); ``every = (n, f)`` calls
    ``f(i)`` after every n rounds (a hang check)."""
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    unknown = set(must_fail) - set(variants)
    if unknown:
        raise ValueError(f"must-fail controls {sorted(unknown)} are not among the variants {sorted(variants)}")
    kept: torch.Tensor | None = None
    counts = nonfinite = torch.empty(0)
    for i in range(replays):
        load_input(i)
        poison()
        out = baseline()
        if kept is None:
            kept = torch.empty_like(out)
            counts = torch.zeros(replays, len(variants), dtype=torch.int64, device=out.device)
            nonfinite = torch.zeros(replays, dtype=torch.int64, device=out.device)
        kept.copy_(out)
        if kept.is_floating_point():
            nonfinite[i] = (~torch.isfinite(kept)).sum()
        for j, run in enumerate(variants.values()):
            poison()
            counts[i, j] = mismatched_elements(run(), kept)
        if every is not None and (i + 1) % every[0] == 0:
            every[1](i + 1)
    tallies = {name: ReplayTally(name, must_fail=name in must_fail) for name in variants}
    per_replay, bad = counts.cpu().tolist(), nonfinite.cpu().tolist()
    for i in range(replays):
        for j, tally in enumerate(tallies.values()):
            tally.add(i, per_replay[i][j], bad[i])
    return tallies


def merge_tallies(per_rank: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several ranks' ``as_dict`` results into one per variant. ``mismatched_replays`` is the most
    any one rank saw (a lower bound of the replays that differed on some rank); the per-rank counts
    are kept beside it."""
    merged: dict[str, dict[str, Any]] = {}
    for name in per_rank[0]:
        rows = [r[name] for r in per_rank]
        tally = ReplayTally(name, must_fail=rows[0]["must_fail"])
        tally.replays = min(r["replays"] for r in rows)
        tally.mismatched_replays = max(r["mismatched_replays"] for r in rows)
        tally.mismatched_elements = sum(r["mismatched_elements"] for r in rows)
        firsts = [r["first_mismatch"] for r in rows if r["first_mismatch"] is not None]
        tally.first_mismatch = min(firsts) if firsts else None
        tally.baseline_nonfinite = max(r["baseline_nonfinite"] for r in rows)
        merged[name] = tally.as_dict() | {"per_rank_mismatched_replays": [r["mismatched_replays"] for r in rows]}
    return merged


def summarize(tallies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run's verdict over its checks (``as_dict`` results): ok only if every checked variant
    passed and there was at least one must-fail control and every control was caught."""
    checks = {k: v for k, v in tallies.items() if not v["must_fail"]}
    controls = {k: v for k, v in tallies.items() if v["must_fail"]}
    problems = [v["why"] for v in tallies.values() if not v["ok"]]
    if not controls:
        problems.append("no must-fail control ran: nothing shows that this check can fail")
    if not checks:
        problems.append("no variant was checked")
    return {"ok": not problems, "checked": sorted(checks), "controls": sorted(controls), "problems": problems}
