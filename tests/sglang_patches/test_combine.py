"""Hook (b), combine side: the layout checked against the real `low_latency_combine` of the installed sgl-deep-ep.

sgl-deep-ep cannot import without a CUDA driver, so its method is rebuilt from its installed
source: same parameters and defaults, a body that returns what it was called with. sglang's sm_90
combine keywords are read from sglang's own `_combine_core`.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang_pd.sglang_patches import combine, engagement, status

needs_deepep = pytest.mark.skipif(
    status.distribution_version("sgl-deep-ep") is None,
    reason="sgl-deep-ep is not installed (dev extra: sgl-deep-ep==0.1.2.post1, installed with --no-deps)",
)
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed"),
]


def _real_low_latency_combine() -> Any:
    """`deep_ep.Buffer.low_latency_combine` from the installed source, its body replaced by `return locals()`."""
    params, source = status.deepep_method_params("low_latency_combine")
    assert params is not None, source
    tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    [fn] = [
        n
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef) and cls.name == "Buffer"
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name == "low_latency_combine"
    ]
    for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs):
        a.annotation = None
    fn.returns, fn.decorator_list = None, []
    fn.body = [ast.Return(ast.Call(ast.Name("locals", ast.Load()), [], []))]
    namespace: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), source, "exec"), namespace)
    return namespace["low_latency_combine"]


def _sglang_sm90_combine_kwargs() -> dict[str, Any]:
    """The keywords sglang 0.5.23's low-latency `_combine_core` passes to DeepEP on sm_90, plus its base call."""
    from sglang.srt.layers.moe.token_dispatcher.deepep import _DeepEPDispatcherImplLowLatency

    tree = ast.parse(textwrap.dedent(inspect.getsource(_DeepEPDispatcherImplLowLatency._combine_core)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    [sm90] = [c for c in calls if any(k.arg == "comp_signal" for k in c.keywords)]
    [base] = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "low_latency_combine"]
    kwargs: dict[str, Any] = {k.arg: f"<{k.arg}>" for k in base.keywords if k.arg is not None}
    kwargs.update({k.arg: f"<{k.arg}>" for k in sm90.keywords if k.arg is not None})
    kwargs["threshold"] = 129
    return kwargs


class RecordingBuffer:
    def __init__(self) -> None:
        self.real = _real_low_latency_combine()
        self.calls: list[dict[str, Any]] = []

    def low_latency_combine(self, **kwargs: Any) -> dict[str, Any]:
        bound = self.real(self, **kwargs)  # raises TypeError on a keyword the real method does not take
        self.calls.append(bound)
        return bound

    def low_latency_dispatch(self) -> str:
        return "dispatched"


@needs_deepep
def test_installed_deepep_takes_per_expert_signals() -> None:
    assert importlib.metadata.version("sgl-deep-ep") == "0.1.2.post1"
    decision = status.deepep_layout()
    assert decision.layout == "deepep", decision
    assert not set(status.COMBINE_KWARGS_SGLANG) & set(decision.params)
    assert set(status.COMBINE_KWARGS_DEEPEP) <= set(decision.params)


@needs_deepep
def test_sglang_sm90_keywords_do_not_fit_the_installed_deepep() -> None:
    """Why the combine hook exists: sglang's sm_90 call would fail against this DeepEP."""
    with pytest.raises(TypeError, match=r"unexpected keyword argument"):
        _real_low_latency_combine()(object(), **_sglang_sm90_combine_kwargs())


@needs_deepep
def test_translated_keywords_bind_to_the_installed_deepep(monkeypatch: pytest.MonkeyPatch, deepep_32_send_sms) -> None:
    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    buffer = RecordingBuffer()
    adapted = combine.get_buffer(lambda self: buffer, object())
    assert isinstance(adapted, combine.DeepEPCombineAdapter)
    assert adapted.low_latency_dispatch() == "dispatched"  # everything else passes through

    kwargs = _sglang_sm90_combine_kwargs()
    adapted.low_latency_combine(**kwargs)
    [bound] = buffer.calls
    assert bound["overlap"] == "<overlap>"
    assert bound["src_signals"] == "<comp_signal>"
    assert bound["src_signal_expect_value"] == 129  # our kernel's num_programs, via meta_overlap_args
    assert bound["handle"] == "<handle>" and bound["x"] == "<x>"


def test_sglang_layout_combines_pass_through_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    params = ("x", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms")
    monkeypatch.setattr(status, "deepep_layout", lambda: status.LayoutDecision("sglang", "test", params))
    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    seen: list[dict[str, Any]] = []

    class Buffer:
        def low_latency_combine(self, **kwargs: Any) -> str:
            seen.append(kwargs)
            return "combined"

    before = engagement.snapshot().signal_combine
    adapted = combine.get_buffer(lambda self: Buffer(), object())
    kwargs = {"x": "<x>", "comp_signal": "<signal>", "block_m": 64, "threshold": 129, "num_sms": 3}
    assert adapted.low_latency_combine(**kwargs) == "combined"
    assert seen == [kwargs]  # sglang's keywords reach a DeepEP that takes them unchanged
    assert adapted.low_latency_combine(x="<x>") == "combined"  # a combine without a signal is not counted
    assert engagement.snapshot().signal_combine == before + 1


def test_buffers_are_left_alone_without_full_sbo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))
    monkeypatch.setenv(status.SBO_MODE_ENV, "shared-only")
    buffer = object()
    assert combine.get_buffer(lambda self: buffer, object()) is buffer


def test_per_expert_signal_replaces_row_block_signal(monkeypatch: pytest.MonkeyPatch, deepep_32_send_sms) -> None:
    from types import SimpleNamespace

    from sglang.srt.batch_overlap.single_batch_overlap import CombineOverlapArgs, DownGemmOverlapArgs

    monkeypatch.setattr(status, "device_capability", lambda: (9, 0))
    monkeypatch.setenv(status.SBO_MODE_ENV, "full")
    if status.deepep_layout().layout != "deepep":
        pytest.skip("the installed DeepEP does not take per-expert signals")
    row_blocks = torch.zeros(8 * 2, dtype=torch.int32)  # sglang's sm_90 allocation: E * ceil(T / 64)
    c = CombineOverlapArgs(overlap=True, stream=None, wait_event=None, signal=row_blocks, threshold=129)  # type: ignore[arg-type]
    d = DownGemmOverlapArgs(num_sms=129, signal=row_blocks, start_event=None)  # type: ignore[arg-type]
    dispatch_output = SimpleNamespace(hidden_states=torch.empty(8, 128, 16))
    out = combine.compute_overlap_args((c, d, {"compute_num_sms": 129}), dispatch_output, None)
    assert out is not None
    assert d.signal is c.signal and d.signal.dtype == torch.uint32 and d.signal.shape == (8,)
    assert int(d.signal.to(torch.int64).sum()) == 0
