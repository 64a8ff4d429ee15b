"""`plan --check` judges SBO with the DeepEP the image builds, names it, and judges this machine's only when asked."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.common.contract import DEEPEP_REVISION
from sglang_pd.deploy.sglang.check import sglang_available
from sglang_pd.sglang_patches import status

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not sglang_available(), reason="sglang is not installed (the `validate` extra)"),
]


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(autouse=True)
def _fresh_layout():
    # The plugin decides the local DeepEP's layout once per process; a test may change what is installed.
    status.deepep_layout.cache_clear()
    yield
    status.deepep_layout.cache_clear()


def test_plan_check_judges_the_images_deepep_and_names_its_revision(capsys: pytest.CaptureFixture[str]) -> None:
    # Whatever DeepEP this machine has (sgl-deep-ep here, which full SBO across nodes would trap with),
    # the default verdict is the image's.
    assert main(["plan", "deepseek-r1-h200-1p1d", "--check"]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("DeepEP judged: ")]
    assert line == (
        f"DeepEP judged: the image's DeepEP (antgroup-opt at {DEEPEP_REVISION}, deploy/common/contract.py "
        "DEEPEP_REVISION); --local-deepep judges this machine's"
    )


@pytest.mark.skipif(not _installed("sgl-deep-ep"), reason="sgl-deep-ep is not installed here (dev extra)")
def test_local_deepep_judges_this_machines_and_refuses_it(capsys: pytest.CaptureFixture[str]) -> None:
    """The control: sgl-deep-ep's combine traps on a peer across nodes, and the R1 decode spans two."""
    assert main(["plan", "deepseek-r1-h200-1p1d", "--check", "--local-deepep", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["deepep_judged"].startswith("this machine's DeepEP (sgl-deep-ep ")
    assert any(e.startswith("decode.sbo: full on H200 with decode.nodes=2: ") for e in doc["errors"])
    decode = [c for c in doc["sglang_check"] if c["role"] == "decode"]
    assert decode and all(c["effective"]["deepep_judged"] == "local" for c in decode)
