"""The plugin against the DeepEP revision that `scripts/gpu/build_deepep.sh` builds.

That revision is deepseek-ai/DeepEP branch `antgroup-opt` at 76f0271 (DeepEP PR #483, "Single
Batch Overlap (SBO)"). Its `Buffer.low_latency_combine` takes sglang's sm_90 row-block contract
(`overlap, packed_recv_count, comp_signal, block_m, threshold, num_sms`), so the plugin must pick
the "sglang" signal layout and leave sglang's combine call alone. The signature is quoted
verbatim from that commit's `deep_ep/buffer.py` in `tests/support/deepep_revision.py` (the build's
source copy is not in the repository); where the copy is present, a test checks the quote against it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.sglang_patches import combine, down_gemm, status
from tests.support import deepep_revision
from tests.support.deepep_revision import REVISION, REVISION_SOURCE, SOURCE_COPY


def _combine_def(source: str) -> ast.FunctionDef:
    [fn] = [
        n
        for cls in ast.walk(ast.parse(source))
        if isinstance(cls, ast.ClassDef) and cls.name == "Buffer"
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name == "low_latency_combine"
    ]
    return fn


def _revision_combine() -> Any:
    """The revision's method with its parameters and defaults and a body that returns what it was called with."""
    fn = _combine_def(REVISION_SOURCE)
    for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs):
        a.annotation = None
    fn.returns, fn.decorator_list = None, []
    fn.body = [ast.Return(ast.Call(ast.Name("locals", ast.Load()), [], []))]
    namespace: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), "<deepep-revision>", "exec"), namespace)
    return namespace["low_latency_combine"]


def _revision_params() -> list[str]:
    args = _combine_def(REVISION_SOURCE).args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)][1:]


@pytest.fixture
def revision_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A `deep_ep` package on the path whose buffer.py holds the revision's method (parsed, never imported)."""
    yield deepep_revision.install(tmp_path, monkeypatch)
    status.deepep_layout.cache_clear()


@pytest.mark.skipif(not SOURCE_COPY.is_file(), reason="the DeepEP source copy (.gpu_bundle/deepep-src) is not here")
def test_quote_matches_the_source_copy() -> None:
    quoted, copied = _combine_def(REVISION_SOURCE), _combine_def(SOURCE_COPY.read_text(encoding="utf-8"))
    assert ast.dump(quoted.args) == ast.dump(copied.args)
    revision = SOURCE_COPY.parents[1] / "REVISION"
    assert REVISION in revision.read_text(encoding="utf-8")


def test_revision_takes_the_sglang_row_block_contract() -> None:
    params = _revision_params()
    assert set(status.COMBINE_KWARGS_SGLANG) <= set(params)
    assert "src_signals" not in params and "src_signal_expect_value" not in params
    assert status.layout_for_params(params) == "sglang"


def test_layout_is_read_from_the_uninstalled_revision(revision_installed: Path) -> None:
    decision = status.deepep_layout()
    assert decision.layout == "sglang", decision
    assert Path(decision.source) == revision_installed
    assert decision.params == tuple(_revision_params())


def test_plugin_leaves_sglang_combine_and_signal_alone(
    revision_installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With this DeepEP the down GEMM signals in sglang's layout and the combine's keywords pass unchanged."""
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    monkeypatch.setattr(status, "kernel_status", lambda: status.Availability(True))
    down_gemm.route_layout.cache_clear()
    try:
        assert down_gemm.route_layout() == "sglang"
        seen: list[dict[str, object]] = []

        class Buffer:
            def low_latency_combine(self, **kwargs: object) -> None:
                seen.append(kwargs)

        kwargs = {"x": "<x>", "comp_signal": "<signal>", "block_m": 64, "threshold": 2, "num_sms": 3}
        combine.get_buffer(lambda self: Buffer(), object()).low_latency_combine(**kwargs)
        assert seen == [kwargs]  # only counted (sglang_patches/engagement.py), never re-spelled
        # sglang's int32 row-block signal is kept: the hook returns None, HookRegistry keeps sglang's result
        assert combine.compute_overlap_args((object(), object(), {}), object(), None) is None
    finally:
        down_gemm.route_layout.cache_clear()


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
def test_sglang_sm90_combine_call_binds_to_the_revision() -> None:
    """Every keyword of sglang 0.5.23's sm_90 `low_latency_combine` call is a parameter of this revision."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import _DeepEPDispatcherImplLowLatency

    tree = ast.parse(textwrap.dedent(inspect.getsource(_DeepEPDispatcherImplLowLatency._combine_core)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    [sm90] = [c for c in calls if any(k.arg == "comp_signal" for k in c.keywords)]
    [base] = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "low_latency_combine"]
    kwargs = {k.arg: f"<{k.arg}>" for c in (base, sm90) for k in c.keywords if k.arg is not None}
    assert {"comp_signal", "block_m", "threshold", "num_sms", "packed_recv_count"} <= set(kwargs)

    bound = _revision_combine()(object(), **kwargs)  # a keyword it does not take raises TypeError
    for name in ("overlap", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms", "handle", "x"):
        assert bound[name] == f"<{name}>"
