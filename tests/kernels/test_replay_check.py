"""benchmarks/replay_check.py: the bit-for-bit comparison, the tallies and their verdicts, on the CPU.

The replay loop is driven here by a toy producer/consumer chain in plain torch: a consumer that
skips its wait and copies rows before the producer writes them. The old way of checking (one input
for every replay, outputs left in place) cannot see that stale read, nor can fresh inputs alone
while the baseline fills the shared buffers first; NaN in the buffers before every variant can.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import replay_check  # noqa: E402
from replay_check import ReplayTally  # noqa: E402


def test_bits_tell_apart_what_float_equality_does_not() -> None:
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert not torch.equal(nan, nan)  # float equality: NaN is never equal
    assert int(replay_check.mismatched_elements(nan, nan.clone())) == 0  # the same bits
    zero, neg_zero = torch.zeros(1, dtype=torch.bfloat16), torch.tensor([-0.0], dtype=torch.bfloat16)
    assert torch.equal(zero, neg_zero)
    assert int(replay_check.mismatched_elements(zero, neg_zero)) == 1
    assert replay_check.bits(torch.zeros(2, dtype=torch.float32)).dtype == torch.int32


def test_bad_inputs_are_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        replay_check.mismatched_elements(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="bit for bit"):
        replay_check.bits(torch.zeros(1, dtype=torch.complex128))
    with pytest.raises(ValueError, match=">= 0"):
        ReplayTally("full@3").add(0, -1)


def test_a_checked_variant_passes_only_if_every_replay_equals_the_baseline() -> None:
    clean = ReplayTally("full@3")
    for i in range(5):
        clean.add(i, 0)
    assert clean.verdict()["ok"], clean.verdict()
    dirty = ReplayTally("full@3")
    for i in range(5):
        dirty.add(i, 7 if i == 3 else 0)
    verdict = dirty.verdict()
    assert not verdict["ok"] and "1 of 5 replays differed" in verdict["why"] and "replay 3" in verdict["why"]
    assert dirty.as_dict()["mismatched_elements"] == 7


def test_a_control_passes_only_if_it_is_caught() -> None:
    caught = ReplayTally("full_skip_wait@3", must_fail=True)
    for i in range(4):
        caught.add(i, 1 if i else 0)
    assert caught.verdict()["ok"] and "3 of 4" in caught.verdict()["why"]
    missed = ReplayTally("full_skip_wait@3", must_fail=True)
    for i in range(4):
        missed.add(i, 0)
    assert not missed.verdict()["ok"] and "NOT caught" in missed.verdict()["why"]


def test_no_replay_or_a_poisoned_baseline_fails_the_check() -> None:
    assert not ReplayTally("shared").verdict()["ok"]
    tally = ReplayTally("shared")
    tally.add(0, 0, baseline_nonfinite=12)
    assert not tally.verdict()["ok"] and "not finite" in tally.verdict()["why"]


def test_the_run_fails_without_a_control_or_with_one_not_caught() -> None:
    ok, bad_control = ReplayTally("full@3"), ReplayTally("skip", must_fail=True)
    ok.add(0, 0)
    bad_control.add(0, 0)
    assert not replay_check.summarize({"full@3": ok.as_dict()})["ok"]  # nothing shows the check can fail
    verdict = replay_check.summarize({"full@3": ok.as_dict(), "skip": bad_control.as_dict()})
    assert not verdict["ok"] and any("NOT caught" in p for p in verdict["problems"])
    bad_control.add(1, 3)
    assert replay_check.summarize({"full@3": ok.as_dict(), "skip": bad_control.as_dict()})["ok"]


def test_ranks_merge_into_one_verdict() -> None:
    a, b = ReplayTally("full@3"), ReplayTally("full@3")
    for i in range(3):
        a.add(i, 0)
        b.add(i, 2 if i == 1 else 0)
    merged = replay_check.merge_tallies([{"full@3": a.as_dict()}, {"full@3": b.as_dict()}])["full@3"]
    assert not merged["ok"] and merged["per_rank_mismatched_replays"] == [0, 1] and merged["first_mismatch"] == 1


class ToyChain:
    """A producer that writes ``down = 2 x + 1`` from the static input ``x`` and a consumer that copies
    ``down`` into ``out`` after it; with ``skip`` the consumer copies the first two rows *before* the
    producer runs, as a combine that skipped a signal wait would."""

    def __init__(self) -> None:
        self.x = torch.zeros(8, 4)
        self.down = torch.zeros(8, 4)
        self.out = torch.zeros(8, 4)

    def run(self, skip: bool) -> torch.Tensor:
        if skip:
            self.out[:2] = self.down[:2]  # read before the write below: a stale read
        self.down.copy_(self.x * 2 + 1)
        self.out[2 if skip else 0 :] = self.down[2 if skip else 0 :]
        return self.out

    def poison(self) -> None:
        self.down.fill_(float("nan"))
        self.out.fill_(float("nan"))


def _check(chain: ToyChain, replays: int, *, fresh: bool, poison: bool) -> dict[str, ReplayTally]:
    gen = torch.Generator().manual_seed(3)
    chain.run(skip=False)  # a warm-up, as the benchmark's eager calls before capture
    return replay_check.run_replays(
        replays,
        load_input=(lambda _: chain.x.copy_(torch.randn(8, 4, generator=gen))) if fresh else (lambda _: None),
        poison=chain.poison if poison else (lambda: None),
        baseline=lambda: chain.run(skip=False),
        variants={"ordered": lambda: chain.run(skip=False), "skip_wait": lambda: chain.run(skip=True)},
        must_fail=["skip_wait"],
    )


def test_one_input_and_untouched_buffers_cannot_see_a_stale_read() -> None:
    """The old check: the stale rows hold the previous replay's values, which are the right ones."""
    tallies = _check(ToyChain(), 20, fresh=False, poison=False)
    assert tallies["skip_wait"].mismatched_replays == 0
    assert not tallies["skip_wait"].verdict()["ok"]  # the control is not caught: the check has no teeth


def test_fresh_inputs_alone_miss_it_where_the_baseline_wrote_the_buffer_first() -> None:
    """The baseline runs first on the same input and leaves the right rows in the shared buffer:
    without poison before each variant the stale read is invisible."""
    tallies = _check(ToyChain(), 20, fresh=True, poison=False)
    assert tallies["skip_wait"].mismatched_replays == 0


@pytest.mark.parametrize("fresh", [False, True])
def test_poison_before_every_variant_catches_it_in_every_replay(fresh: bool) -> None:
    poison = True
    tallies = _check(ToyChain(), 20, fresh=fresh, poison=poison)
    assert tallies["skip_wait"].mismatched_replays == 20, tallies["skip_wait"].as_dict()
    assert tallies["ordered"].verdict()["ok"], tallies["ordered"].as_dict()
    assert replay_check.summarize({k: t.as_dict() for k, t in tallies.items()})["ok"]


def test_run_replays_refuses_a_control_that_is_not_a_variant() -> None:
    chain = ToyChain()
    with pytest.raises(ValueError, match="not among the variants"):
        replay_check.run_replays(
            1, load_input=lambda _: None, poison=chain.poison, baseline=lambda: chain.run(False),
            variants={"ordered": lambda: chain.run(False)}, must_fail=["skip"],
        )  # fmt: skip
