"""The image's DeepEP as `plan --check` judges it: its Buffer parameters, and the plugin's answers for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_pd.deploy.common.contract import DEEPEP_REVISION
from sglang_pd.deploy.sglang.image_deepep import COMBINE_PARAMS, DISPATCH_PARAMS, IMAGE_DEEPEP, judged_as_image
from sglang_pd.sglang_patches import status
from tests.support import deepep_revision


def _params(buffer_py: Path, method: str) -> tuple[str, ...]:
    found = status._params_from_source(buffer_py, "Buffer", method)
    assert found is not None, (buffer_py, method)
    return tuple(found)


def test_the_quoted_parameters_are_the_revisions(tmp_path: Path) -> None:
    buffer_py = deepep_revision.write_package(tmp_path)  # the revision's signatures as the plugin's tests quote them
    assert _params(buffer_py, "low_latency_combine") == COMBINE_PARAMS
    assert _params(buffer_py, "low_latency_dispatch") == DISPATCH_PARAMS


@pytest.mark.skipif(not deepep_revision.SOURCE_COPY.is_file(), reason="no copy of DeepEP's sources (.gpu_bundle)")
def test_the_quoted_parameters_match_a_source_copy() -> None:
    copy = deepep_revision.SOURCE_COPY
    assert (copy.parents[1] / "REVISION").read_text().strip() == DEEPEP_REVISION
    assert _params(copy, "low_latency_combine") == COMBINE_PARAMS
    assert _params(copy, "low_latency_dispatch") == DISPATCH_PARAMS


def test_inside_the_block_the_plugin_answers_for_the_image() -> None:
    before = status.deepep_layout, status.shared_half
    with judged_as_image():
        decision = status.deepep_layout()
        assert decision.layout == "sglang" and DEEPEP_REVISION in decision.source
        assert status.shared_half().ok
        # sglang's own sm_90 signals: full SBO is safe across nodes and with sglang's default send SMs.
        assert status.layout_contract(decision.layout, ep_nodes=2, send_sms=3).ok
    assert (status.deepep_layout, status.shared_half) == before
    assert DEEPEP_REVISION in IMAGE_DEEPEP


def test_a_deepep_without_sglangs_signals_would_be_judged_otherwise() -> None:
    """The control: the plugin's decision code, which the block feeds the quoted parameters, does tell them apart."""
    without = [p for p in COMBINE_PARAMS if p not in status.COMBINE_KWARGS_SGLANG]
    assert status.layout_for_params(COMBINE_PARAMS) == "sglang"
    assert status.layout_for_params(without) is None
