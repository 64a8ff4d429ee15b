"""The plugin's cases against whichever sglang this interpreter imports, run in one child process; prints JSON.

`python tests/sglang_patches/release_cases.py ANTGROUP_ROOT` (with PYTHONPATH pointing at a side
install of another sglang release): sglang's real `initialize_moe_config` at compute capability (9, 0),
first without the plugin, then under its hooks as sglang's own `load_plugins()` applies them (mode
full), then with every hook applied (the effect probes, and the shared-only case). The
DeepEP is the installed sgl-deep-ep, or DeepEP antgroup-opt's sources under ANTGROUP_ROOT for the
cases that name it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any


def main(antgroup_root: str) -> dict[str, Any]:
    import importlib.metadata

    import sglang.srt.layers.moe.utils as moe_utils
    import torch
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_flags, publish

    from sglang_pd.sglang_patches import down_gemm, plugin, probes, status

    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("sglang_pd.sglang_patches").addHandler(Collect())
    logging.getLogger("sglang_pd.sglang_patches").setLevel(logging.INFO)

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # type: ignore[assignment]
    moe_utils.is_cuda = lambda: True
    status.device_capability = lambda: (9, 0)

    two_nodes = (
        "--tp",
        "2",
        "--ep-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        "127.0.0.1:5000",
    )
    takes_args = probes._takes_server_args(moe_utils.initialize_moe_config)

    def deepep(name: str) -> None:
        """Make `name` ("antgroup-opt" or "sgl-deep-ep") the DeepEP the plugin reads."""
        if antgroup_root in sys.path:
            sys.path.remove(antgroup_root)
        sys.modules.pop("deep_ep", None)  # sglang's dispatcher imports it; find_spec would answer from there
        if name == "antgroup-opt":
            sys.path.insert(0, antgroup_root)
        status.deepep_layout.cache_clear()
        down_gemm.route_layout.cache_clear()

    def run(mode: str, layout: str, *flags: str) -> dict[str, Any]:
        os.environ[status.SBO_MODE_ENV] = mode
        deepep(layout)
        args = probes._server_args(flags)
        if not takes_args:  # 0.5.23 reads the published bags: publish this case's arguments
            publish(args, role="test")
        get_flags().moe.sbo_enabled = False
        del records[:]
        try:
            moe_utils.initialize_moe_config(args) if takes_args else moe_utils.initialize_moe_config()
        except ValueError as exc:
            return {"accepted": False, "error": str(exc), "log": list(records)}
        from sglang_pd.sglang_patches.moe_config import effective_sbo

        return {
            "accepted": True,
            "sbo_enabled": get_flags().moe.sbo_enabled,
            "asked_still_recorded": bool(args.enable_single_batch_overlap),
            "layout": status.deepep_layout().layout,
            "effective": effective_sbo(),
            "log": list(records),
        }

    out: dict[str, Any] = {"sglang": importlib.metadata.version("sglang"), "takes_server_args": takes_args}
    out["unhooked"] = run("full", "antgroup-opt")
    # sglang's own plugin loader, as every sglang process runs it: our entry point, mode full.
    os.environ[status.SBO_MODE_ENV] = "full"
    os.environ.pop("SGLANG_PLUGINS", None)
    load_plugins()
    out["patched_by_load_plugins"] = sorted(
        name for name, spec in plugin.HOOKS.items() if spec.target in HookRegistry._patched
    )
    out["full"] = run("full", "antgroup-opt")
    out["full-two-nodes"] = run("full", "antgroup-opt", *two_nodes)
    out["full-triton-runner"] = run("full", "antgroup-opt", "--moe-runner-backend", "triton")
    out["full-sgl-deep-ep-two-nodes"] = run("full", "sgl-deep-ep", *two_nodes)
    out["full-sgl-deep-ep-3-send-sms"] = run("full", "sgl-deep-ep")
    # Every hook at once (the shared-only one too); re-wrapping the full mode's hooks is harmless, since
    # each passes through what is not its own (a masked SBO flag, an adapted buffer, a signal it set).
    out["probes"] = probes.probe_all(plugin.HOOKS)
    out["shared-only"] = run("shared-only", "sgl-deep-ep", *two_nodes)
    os.environ[status.COMBINE_SEND_SMS_ENV] = str(status.DEEPEP_LAYOUT_SEND_SMS)
    out["full-sgl-deep-ep-32-send-sms"] = run("full", "sgl-deep-ep")
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    print("\n" + json.dumps(result), flush=True)
