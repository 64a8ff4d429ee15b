"""`plan --estimate` words an overlap's effect on the ITL so that a negative saving reads as a cost
("TBO would cost 15.5% more ITL", never "would save -15.5%")."""

from __future__ import annotations

import re

import pytest

from sglang_pd.deploy.cli import main


def _overlaps(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", "deepseek-r1-h200-1p1d", "--estimate", *args]) == 0
    return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("decode overlaps: "))


def test_a_negative_saving_reads_as_a_cost(capsys: pytest.CaptureFixture[str]) -> None:
    line = _overlaps(capsys)  # the preset's own batch: TBO slows decode down
    assert re.search(r"TBO would cost \d+\.\d% more ITL$", line), line
    line = _overlaps(capsys, "--decode-batch", "1")  # one request per rank: SBO costs too
    assert re.search(r"SBO costs \d+\.\d% more ITL, TBO would cost \d+\.\d% more ITL$", line), line


def test_a_positive_saving_reads_as_a_saving(capsys: pytest.CaptureFixture[str]) -> None:
    line = _overlaps(capsys, "--decode-batch", "1024")
    assert re.search(r"SBO saves \d+\.\d% of the ITL, TBO would save \d+\.\d% of the ITL$", line), line


@pytest.mark.parametrize("batch", ["1", "8", "64", "256", "1024"])
def test_no_saving_is_printed_with_a_minus_sign(capsys: pytest.CaptureFixture[str], batch: str) -> None:
    line = _overlaps(capsys, "--decode-batch", batch)
    assert "-" not in line.replace("low-latency", ""), line
