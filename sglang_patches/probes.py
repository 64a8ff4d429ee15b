"""Effect probes: each hook's sglang function, hooked, called on a probe input, to show the hook takes effect.

A target that exists with the right parameters can still be a hook without effect: sglang 0.5.17's
`initialize_moe_config(server_args)` reads `server_args.enable_single_batch_overlap`, so a hook that
masks the published config bag (0.5.23's source of that flag) leaves the refusal in place. Each
probe here calls the function sglang calls (through the name sglang calls it by), on an input where
the hook must change the outcome, and says what it saw when it did not.

The probes need no GPU: the device is faked as sm_90 (the capability the hooks act on), the
machine-dependent verdicts (`status`: our kernel, DeepEP's layout) are fixed to "usable", and our
kernel entry and DeepEP's buffer are recording doubles: what is probed is the hook's wiring into
sglang, while `sglang-pd doctor` reports the machine's own verdicts beside it. They patch sglang's
modules, so they run in a child process: `python -m sglang_pd.sglang_patches.probes [--hooks MOD:ATTR]`
prints one JSON object, hook name -> "ok" or what is wrong; `hook_effects()` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

from sglang_pd.sglang_patches import combine, down_gemm, moe_config, shared_stream, status
from sglang_pd.sglang_patches.targets import HookSpec, check_target

__all__ = ["DEFAULT_HOOKS", "OK", "PROBES", "apply_hooks", "hook_effects", "probe_all"]

OK = "ok"
#: The hook table the plugin registers; `--hooks` names another (a candidate for a new sglang).
DEFAULT_HOOKS = "sglang_pd.sglang_patches.plugin:HOOKS"

#: A DeepSeek-V3-shaped config (sglang's resolver reads only config.json): enough for ServerArgs.
_PROBE_MODEL = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
#: An SBO decode command for one GPU, valid on both releases' argument parsers.
_PROBE_ARGV = [
    "--device", "cuda", "--tp", "1", "--moe-a2a-backend", "deepep", "--deepep-mode", "low_latency",
    "--moe-runner-backend", "deep_gemm", "--enable-single-batch-overlap",
    "--mem-fraction-static", "0.8", "--max-running-requests", "64",
]  # fmt: skip


@contextlib.contextmanager
def _sm90_and_usable() -> Iterator[None]:
    """sm_90 as sglang and the plugin see it; our kernel and a DeepEP signal layout usable."""
    import torch

    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")
    usable = status.Availability(True, detail={"layout": "sglang", "source": "probe"})
    with (
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)),
        mock.patch.object(moe_utils, "is_cuda", lambda: True),
        mock.patch.object(status, "device_capability", lambda: (9, 0)),
        mock.patch.object(status, "shared_half", lambda: usable),
        mock.patch.object(status, "combine_half", lambda ep_nodes=1: usable),
        mock.patch.object(status, "deepep_layout", lambda: status.LayoutDecision("sglang", "probe")),
        mock.patch.object(down_gemm, "route_layout", lambda: "sglang"),
    ):
        yield


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    with mock.patch.dict(os.environ, {status.SBO_MODE_ENV: mode}):
        yield


@contextlib.contextmanager
def _moe_flags(**values: Any) -> Iterator[Any]:
    from sglang.srt.runtime_context import get_flags

    moe = get_flags().moe
    saved = {k: getattr(moe, k) for k in values}
    for k, v in values.items():
        setattr(moe, k, v)
    try:
        yield moe
    finally:
        for k, v in saved.items():
            setattr(moe, k, v)


def _server_args(extra: Sequence[str] = ()) -> Any:
    """Real ServerArgs of an SBO decode (plus `extra` flags), resolved as a scheduler has them."""
    from sglang.srt.server_args import prepare_server_args

    with tempfile.TemporaryDirectory(prefix="sglang-pd-probe-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_PROBE_MODEL))
        with mock.patch.dict(os.environ, {"HF_HUB_OFFLINE": "1"}):
            args = prepare_server_args(["--model-path", tmp, *_PROBE_ARGV, *extra])
            resolve = getattr(args, "resolve_once", None)
            if resolve is not None:
                resolve()
    return args


def _takes_server_args(fn: Callable[..., Any]) -> bool:
    import inspect

    target = getattr(fn, "__wrapped__", fn)
    return "server_args" in inspect.signature(target).parameters


def probe_moe_config() -> str:
    """sglang's refusal of SBO on sm_90 is lifted: `initialize_moe_config` returns and SBO is on."""
    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")
    from sglang.srt import runtime_context

    args = _server_args()
    fn = moe_utils.initialize_moe_config
    positional = _takes_server_args(fn)
    if not positional:
        runtime_context.publish(args, role="test")
    try:
        with _sm90_and_usable(), _mode("full"), _moe_flags(sbo_enabled=False):
            try:
                fn(args) if positional else fn()
            except ValueError as exc:
                return f"no effect: sglang's initialize_moe_config still refuses SBO on sm_90 under the hook ({exc})"
            if runtime_context.get_flags().moe.sbo_enabled is not True:
                return "no effect: initialize_moe_config returned with SBO off in sglang's MoE flags"
    finally:
        if not positional:
            runtime_context.reset_context()
    return OK


def probe_down_gemm() -> str:
    """The down GEMM with overlap arguments, called as sglang's DeepGEMM runner calls it, reaches our kernel."""
    import torch

    wrapper = importlib.import_module("sglang.srt.layers.deep_gemm_wrapper")
    calls: list[dict[str, Any]] = []

    def entry(*args: Any, **kwargs: Any) -> tuple[int, int]:
        calls.append(kwargs)
        return 64, 1

    e, m, n, k = 2, 64, 128, 128
    lhs = (torch.zeros(e, m, k), torch.ones(e, m, k // 128))
    rhs = (torch.zeros(e, n, k), torch.ones(e, n // 128, k // 128))
    signal = torch.zeros(e, dtype=torch.int32)
    overlap = SimpleNamespace(signal=signal, num_sms=1, start_event=None)
    with _sm90_and_usable(), mock.patch.object(down_gemm, "_kernel_entry", lambda: entry):
        try:
            wrapper.grouped_gemm_nt_f8f8bf16_masked(
                lhs, rhs, torch.zeros(e, m, n), torch.zeros(e, dtype=torch.int32), m,
                overlap_args=overlap, max_block_n=256, recipe_a=None, recipe_b=None,
            )  # fmt: skip
        except Exception as exc:  # sglang's own wrapper ran (it needs DeepGEMM and CUDA): no effect
            return f"no effect: sglang's own grouped_gemm_nt_f8f8bf16_masked ran ({type(exc).__name__}: {exc})"
    if not calls or calls[0].get("signal") is not signal:
        return "no effect: the down GEMM with overlap arguments did not reach our kernel with sglang's signal"
    return OK


def probe_combine_signal() -> str:
    """`compute_overlap_args` hands the down GEMM and the combine one per-expert uint32 signal (the "deepep" layout)."""
    import torch

    sbo = importlib.import_module("sglang.srt.batch_overlap.single_batch_overlap")
    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")
    e, t = 2, 128
    dispatch_output = SimpleNamespace(hidden_states=torch.zeros(e, t, 8))
    with (
        _sm90_and_usable(),
        _mode("full"),
        _moe_flags(sbo_enabled=True, runner_backend=moe_utils.MoeRunnerBackend.DEEP_GEMM),
        mock.patch.object(down_gemm, "route_layout", lambda: "deepep"),
        mock.patch.object(torch.cuda, "get_device_properties", lambda *a, **k: SimpleNamespace(multi_processor_count=132)),  # noqa: E501
        mock.patch.object(torch.cuda, "Event", lambda *a, **k: SimpleNamespace()),
    ):  # fmt: skip
        combine_args, down_args, _ = sbo.compute_overlap_args(dispatch_output, object())
    if down_args is None:
        return "no effect: sglang built no down-GEMM overlap arguments (SboFlags' combine half is off)"
    signal = down_args.signal
    if signal.dtype != torch.uint32 or tuple(signal.shape) != (e,) or combine_args.signal is not signal:
        return (
            f"no effect: the signal is sglang's own ({signal.dtype}, shape {tuple(signal.shape)}), "
            "not one uint32 counter per local expert shared with the combine"
        )
    return OK


def probe_combine_call() -> str:
    """The low-latency dispatcher's DeepEP buffer takes sglang's sm_90 combine keywords (the "deepep" layout)."""
    deepep = importlib.import_module("sglang.srt.layers.moe.token_dispatcher.deepep")
    impl = deepep._DeepEPDispatcherImplLowLatency
    buffer = SimpleNamespace(low_latency_combine=lambda *a, **k: k)
    me = SimpleNamespace(group=None, hidden_size=0, params_bytes=0, deepep_mode=None,
                         num_max_dispatch_tokens_per_rank=0, num_experts=0)  # fmt: skip
    with (
        _sm90_and_usable(),
        mock.patch.object(down_gemm, "route_layout", lambda: "deepep"),
        mock.patch.object(deepep.DeepEPBuffer, "get_deepep_buffer", lambda *a, **k: buffer),
        mock.patch.object(deepep.DeepEPBuffer, "set_dispatch_mode_as_low_latency", lambda *a, **k: None),
    ):
        got = impl._get_buffer(me)
    if not isinstance(got, combine.DeepEPCombineAdapter):
        return f"no effect: _get_buffer returned sglang's own buffer ({type(got).__name__}), not our combine adapter"
    sent = got.low_latency_combine(comp_signal="s", threshold=129, block_m=64, num_sms=3, packed_recv_count=None)
    if sent != {"src_signals": "s", "src_signal_expect_value": 129}:
        return f"no effect: the combine keywords reached DeepEP as {sorted(sent)}"
    return OK


def probe_shared_only() -> str:
    """In shared-only mode `SboFlags` switches the down-GEMM/combine half off, with the DeepGEMM runner."""
    sbo = importlib.import_module("sglang.srt.batch_overlap.single_batch_overlap")
    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")
    with (
        _mode("shared-only"),
        _moe_flags(sbo_enabled=True, runner_backend=moe_utils.MoeRunnerBackend.DEEP_GEMM),
    ):
        if sbo.SboFlags.enable_combine_down_gemm_two_stream_overlap():
            return "no effect: SboFlags.enable_combine_down_gemm_two_stream_overlap() is still true in shared-only mode"
        if not sbo.SboFlags.fuse_shared_experts_inside_sbo():
            return "the shared-expert half is off too: SboFlags.fuse_shared_experts_inside_sbo() is false"
    return OK


def probe_shared_stream() -> str:
    """In full mode with sglang's outside-SBO switch, the shared expert leaves the dispatch window (sm_90)."""
    sbo = importlib.import_module("sglang.srt.batch_overlap.single_batch_overlap")
    moe_utils = importlib.import_module("sglang.srt.layers.moe.utils")

    def flags() -> contextlib.AbstractContextManager[Any]:
        return _moe_flags(sbo_enabled=True, runner_backend=moe_utils.MoeRunnerBackend.DEEP_GEMM)

    with _sm90_and_usable(), _mode("full"), flags(), mock.patch.dict(os.environ, {shared_stream.OUTSIDE_SBO_ENV: "1"}):
        if sbo.SboFlags.fuse_shared_experts_inside_sbo():
            return (
                "no effect: with the outside-SBO switch SboFlags.fuse_shared_experts_inside_sbo() is still true, "
                "so the shared expert runs inside the dispatch window"
            )
        if not sbo.SboFlags.enable_combine_down_gemm_two_stream_overlap():
            return "the down-GEMM/combine half is off: SboFlags.enable_combine_down_gemm_two_stream_overlap() is false"
    with _sm90_and_usable(), _mode("full"), flags(), mock.patch.dict(os.environ, {shared_stream.OUTSIDE_SBO_ENV: "0"}):
        if not sbo.SboFlags.enable_dispatch_shared_one_stream_overlap():
            return "the hook acts without the switch: the dispatch-window overlap is off although it is unset"
    return OK


#: The probe of each hook in `plugin.HOOKS`, by hook name.
PROBES: dict[str, Callable[[], str]] = {
    "moe-config": probe_moe_config,
    "down-gemm": probe_down_gemm,
    "combine-signal": probe_combine_signal,
    "combine-call": probe_combine_call,
    "shared-stream": probe_shared_stream,
    "shared-only": probe_shared_only,
}


def apply_hooks(specs: Mapping[str, HookSpec]) -> dict[str, str]:
    """Register every hook whose target exists with sglang's HookRegistry and apply them; the others' problems."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    problems: dict[str, str] = {}
    HookRegistry.reset()
    for name, spec in specs.items():
        problem = check_target(spec)
        if problem is not None:
            problems[name] = problem
            continue
        HookRegistry.register(spec.target, spec.hook, HookType(spec.hook_type))
    HookRegistry.apply_hooks()
    return problems


def probe_all(specs: Mapping[str, HookSpec]) -> dict[str, str]:
    """Apply `specs` (every mode at once: each hook asks the mode when called) and probe each: name -> "ok" or why."""
    results = apply_hooks(specs)
    moe_config.missing_targets.clear()
    for name in specs:
        if name in results:
            continue
        probe = PROBES.get(name)
        if probe is None:
            results[name] = f"hook {name!r} has no effect probe in {__name__}.PROBES"
            continue
        try:
            results[name] = probe()
        except Exception as exc:  # a probe that breaks says so; it never passes silently
            results[name] = f"the effect probe failed: {type(exc).__name__}: {exc}"
    return results


def hook_effects(
    hooks: str = DEFAULT_HOOKS, python: str | None = None, env: Mapping[str, str] | None = None, timeout: float = 300
) -> dict[str, str]:
    """Run the probes in a child process (they patch sglang); hook name -> "ok" or what is wrong."""
    cmd = [python or sys.executable, "-m", __name__, "--hooks", hooks]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=None if env is None else dict(env))
    lines = proc.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        doc = None
    if proc.returncode != 0 or not isinstance(doc, dict):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"*": f"the effect probes did not run (exit {proc.returncode}): {' | '.join(tail)}"}
    return {str(k): str(v) for k, v in doc.items()}


def _load_hooks(ref: str) -> Mapping[str, HookSpec]:
    module, _, attr = ref.partition(":")
    table = getattr(importlib.import_module(module), attr)
    if not isinstance(table, Mapping):
        raise TypeError(f"--hooks {ref}: {attr} is a {type(table).__name__}, not a mapping of hook name to HookSpec")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__)
    parser.add_argument("--hooks", default=DEFAULT_HOOKS, help="MODULE:ATTR of the hook table to probe")
    args = parser.parse_args(argv)
    results = probe_all(_load_hooks(args.hooks))
    # sglang logs to stdout as it imports; the verdict is the last line.
    print("\n" + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
