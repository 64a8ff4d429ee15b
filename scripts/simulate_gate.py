"""Monte Carlo of the gsm8k gate's baseline rule: how often it fails an unchanged model, and how often
it catches a real drop, at a given number of questions.

Each simulated rollout pairs a baseline run and a candidate run on the same n questions. The model
is right on `--accuracy` of them; two runs of the same model disagree on `--flips` of the questions
(half lost, half gained: temperature-0 serving is not bit-identical across batches and restarts);
a regression of D points loses D more. Only the 2x2 counts matter to the rule, so they are drawn
as one multinomial per rollout and judged with the gate's own interval (`sglang_pd.deploy.evals.stats`).

For contrast, the unpaired one-sided Wald test with a 1-point margin that the gate used before is
run on the same draws.

    .venv/bin/python scripts/simulate_gate.py                  # the README table (200 and 1314 questions)
    .venv/bin/python scripts/simulate_gate.py --n 500 --reps 20000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

from sglang_pd.deploy.evals.stats import Interval, paired_interval

DEFAULT_NS = (200, 1314)
DEFAULT_DROPS = (0.0, 0.03, 0.05)


def binomial(rng: random.Random, n: int, p: float) -> int:
    """A Binomial(n, p) draw by geometric skips over the rarer outcome (fast when p is near 0 or 1)."""
    if p <= 0.0 or n == 0:
        return 0
    if p >= 1.0:
        return n
    if p > 0.5:
        return n - binomial(rng, n, 1.0 - p)
    log_q = math.log1p(-p)
    count, position = 0, -1
    while True:
        position += int(math.log(1.0 - rng.random()) / log_q) + 1
        if position >= n:
            return count
        count += 1


@dataclass(frozen=True, slots=True)
class Table2x2:
    """One paired rollout: lost (b10), gained (b01), right in both, wrong in both."""

    b10: int
    b01: int
    both: int
    neither: int

    @property
    def n(self) -> int:
        return self.b10 + self.b01 + self.both + self.neither


def draw(rng: random.Random, n: int, accuracy: float, flips: float, drop: float) -> Table2x2:
    p10, p01 = flips / 2 + drop, flips / 2
    p11 = accuracy - p10
    if p11 < 0 or accuracy + p01 > 1:
        raise ValueError(f"accuracy {accuracy}, flips {flips} and drop {drop} do not fit in one 2x2 table")
    b10 = binomial(rng, n, p10)
    b01 = binomial(rng, n - b10, p01 / (1 - p10))
    both = binomial(rng, n - b10 - b01, p11 / (1 - p10 - p01))
    return Table2x2(b10, b01, both, n - b10 - b01 - both)


def paired_fails(t: Table2x2, max_drop: float, confidence: float, interval: Interval) -> bool:
    """The gate's default rule: fail unless the upper bound of the paired drop is below max_drop."""
    upper = paired_interval(t.b10, t.b01, t.n, confidence=confidence, method=interval, both=t.both)[1]
    return upper >= max_drop


def unpaired_wald_fails(t: Table2x2, max_drop: float = 0.01, confidence: float = 0.95) -> bool:
    """The earlier rule: one-sided two-proportion Wald test of 'drop > max_drop', runs treated as independent."""
    p0, p1 = (t.both + t.b10) / t.n, (t.both + t.b01) / t.n
    se = math.sqrt(p0 * (1 - p0) / t.n + p1 * (1 - p1) / t.n)
    if se == 0:
        return p0 - p1 > max_drop
    return (p0 - p1 - max_drop) / se > NormalDist().inv_cdf(confidence)


@dataclass(frozen=True, slots=True)
class Cell:
    n: int
    drop: float
    fail_rate: float
    unpaired_fail_rate: float
    reps: int


def simulate(
    n: int,
    drop: float,
    *,
    reps: int,
    accuracy: float = 0.95,
    flips: float = 0.02,
    max_drop: float = 0.02,
    confidence: float = 0.95,
    interval: Interval = "tango",
    seed: int = 0,
) -> Cell:
    """Fail rates of the paired rule and of the earlier unpaired rule over `reps` simulated rollouts."""
    rng = random.Random(f"{seed}|{n}|{drop}|{accuracy}|{flips}")
    fails = unpaired = 0
    for _ in range(reps):
        t = draw(rng, n, accuracy, flips, drop)
        fails += paired_fails(t, max_drop, confidence, interval)
        unpaired += unpaired_wald_fails(t)
    return Cell(n, drop, fails / reps, unpaired / reps, reps)


def _label(drop: float) -> str:
    return "no change (false fail)" if drop == 0 else f"{drop * 100:g}-point drop (power)"


def markdown(cells: list[Cell], args: argparse.Namespace) -> str:
    ns = sorted({c.n for c in cells})
    drops = sorted({c.drop for c in cells})
    by = {(c.n, c.drop): c for c in cells}
    head = "| true change | " + " | ".join(f"{n} questions: paired (old unpaired)" for n in ns) + " |"
    lines = [head, "|---|" + "---|" * len(ns)]
    for d in drops:
        row = [f"{by[n, d].fail_rate:.1%} ({by[n, d].unpaired_fail_rate:.1%})" for n in ns]
        lines.append(f"| {_label(d)} | " + " | ".join(row) + " |")
    note = (
        f"Fail rate of the gate over {args.reps} simulated rollouts per cell: {args.accuracy:.0%} model, "
        f"{args.flips:.0%} run-to-run flips, --max-drop {args.max_drop:g}, --confidence {args.confidence:g}, "
        f"{args.interval} interval (`scripts/simulate_gate.py --reps {args.reps}`)."
    )
    return "\n".join([*lines, "", note])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=list(DEFAULT_NS), help="questions per run")
    parser.add_argument("--drop", type=float, nargs="+", default=list(DEFAULT_DROPS), help="true drops to simulate")
    parser.add_argument("--reps", type=int, default=10000, help="rollouts per cell (default: 10000)")
    parser.add_argument("--accuracy", type=float, default=0.95)
    parser.add_argument("--flips", type=float, default=0.02, help="run-to-run disagreement of one model")
    parser.add_argument("--max-drop", type=float, default=0.02)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--interval", choices=("tango", "newcombe"), default="tango")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the cells here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    cells = [
        simulate(
            n,
            d,
            reps=args.reps,
            accuracy=args.accuracy,
            flips=args.flips,
            max_drop=args.max_drop,
            confidence=args.confidence,
            interval=args.interval,
            seed=args.seed,
        )
        for n in args.n
        for d in args.drop
    ]
    print(markdown(cells, args))
    result: dict[str, Any] = {
        "benchmark": "simulate_gate",
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "cells": [asdict(c) for c in cells],
        "seconds": round(time.perf_counter() - start, 1),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left early; not an error
        sys.stderr.close()
        sys.exit(0)
