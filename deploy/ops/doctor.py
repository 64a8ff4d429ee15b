"""`sglang-pd doctor`: what this machine can serve, and why not.

Versions of sglang, DeepEP, DeepGEMM, torch, Triton and sglang-pd; the GPU and its compute
capability; whether our sm_90 kernel is usable; which signal layout the installed DeepEP takes;
whether the sglang plugin is installed, its hook targets exist and each hook takes effect (probed
in a child process: `sglang_patches/probes.py`); whether the NVIDIA driver is set up for DeepEP across
nodes; and, for each SBO mode, whether it can run here, for a decode EP over `--ep-nodes` nodes (full
SBO on sm_90 refuses sgl-deep-ep's signal layout across nodes or where its send SMs do not match).
`--expect MODE` makes it a pre-flight check (exit 1 when MODE cannot run); `--capability 9.0` judges
for a GPU that is not visible (an image build). `--server-log FILE` reads what full SBO ran inside a
serving sglang from its log (`sglang_patches/engagement.py`); with `--expect full` it must have run.
`sbo_topology_warnings()` and `sbo_topology_errors()` are the topology-side half, used by `sglang-pd plan --check`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sglang_pd.deploy.common.argtypes import positive_int
from sglang_pd.deploy.common.contract import ENV_LWS_GROUP_SIZE, EXIT_INVALID, EXIT_OK, SBOMode
from sglang_pd.deploy.common.node import deepep_driver
from sglang_pd.deploy.sglang.compat import FlagReport, flag_report, flag_summary
from sglang_pd.deploy.sglang.sbo import PLUGIN_ENTRY_POINT

__all__ = [
    "add_arguments",
    "collect",
    "format_table",
    "run",
]


DISTRIBUTIONS = ("sglang", "sgl-deep-ep", "sgl-deep-gemm", "sglang-kernel", "sglang-pd", "torch", "triton")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("table", "json"), default="table")
    parser.add_argument(
        "--expect",
        choices=[m.value for m in SBOMode if m is not SBOMode.OFF],
        help="exit 1 unless this SBO mode can run here (a pod's pre-flight check)",
    )
    parser.add_argument(
        "--skip-targets",
        action="store_true",
        help="do not import sglang to check the plugin's hook targets and probe their effect (faster)",
    )
    parser.add_argument(
        "--ep-nodes",
        type=positive_int,
        default=None,
        help=f"nodes the decode EP group spans (default: ${ENV_LWS_GROUP_SIZE} in a pod, else 1)",
    )
    parser.add_argument(
        "--capability",
        type=_capability,
        default=None,
        metavar="MAJOR.MINOR",
        help="judge SBO for a GPU of this compute capability instead of the visible one (an image build has none)",
    )
    parser.add_argument(
        "--server-log",
        type=Path,
        default=None,
        metavar="FILE",
        help="a running sglang server's log: report how often its decode ran our signal GEMM and DeepEP's "
        "signal combine (with --expect full, exit 1 unless both ran)",
    )


def _capability(value: str) -> tuple[int, int]:
    major, dot, minor = value.partition(".")
    if not (major.isdigit() and minor.isdigit() and dot):
        raise argparse.ArgumentTypeError(f"--capability has value {value!r}. Not MAJOR.MINOR, e.g. 9.0.")
    return int(major), int(minor)


def default_ep_nodes() -> int:
    """The nodes of this pod's LeaderWorkerSet group (a decode group's EP spans them), else 1."""
    value = os.environ.get(ENV_LWS_GROUP_SIZE, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _gpu() -> dict[str, Any]:
    from sglang_pd.sglang_patches import status

    cap = status.device_capability()
    info: dict[str, Any] = {"capability": f"sm_{cap[0]}{cap[1]}" if cap else None, "name": None, "count": 0}
    if status.assumed_capability() is not None:
        info["name"] = "assumed (--capability)"
    elif cap is not None:
        import torch

        info["name"] = torch.cuda.get_device_name()
        info["count"] = torch.cuda.device_count()
    return info


def _plugin() -> dict[str, Any]:
    from sglang_pd.sglang_patches import status

    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    names = sorted(ep.name for ep in eps)
    whitelist = [x.strip() for x in os.environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    return {
        "entry_point": PLUGIN_ENTRY_POINT in names,
        "plugins_installed": names,
        "loaded_by_sglang": PLUGIN_ENTRY_POINT in names and (not whitelist or PLUGIN_ENTRY_POINT in whitelist),
        "SGLANG_PLUGINS": os.environ.get("SGLANG_PLUGINS"),
        status.SBO_MODE_ENV: os.environ.get(status.SBO_MODE_ENV),
    }


def _targets(hooks: str | None = None) -> dict[str, str | None]:
    """Each hook's problem (None: its target exists and the hook takes effect when sglang calls it)."""
    from sglang_pd.sglang_patches import probes
    from sglang_pd.sglang_patches.plugin import HOOKS
    from sglang_pd.sglang_patches.targets import check_target

    problems = {name: check_target(spec) for name, spec in HOOKS.items()}
    effects = probes.hook_effects(hooks or probes.DEFAULT_HOOKS)
    for name in HOOKS:
        effect = effects.get(name, effects.get("*", f"no effect probe ran for hook {name!r}"))
        if problems[name] is None and effect != probes.OK:
            problems[name] = f"hook {name!r} does not take effect in the installed sglang: {effect}"
    return problems


def _sbo_modes(
    cap: str | None, plugin: dict[str, Any], targets: dict[str, str | None] | None, ep_nodes: int = 1
) -> dict[str, Any]:
    from sglang_pd.sglang_patches import status

    def verdict(mode: str) -> dict[str, Any]:
        if cap is None:
            return {"ok": False, "reason": "no CUDA device is visible"}
        if cap.startswith("sm_10"):
            return {"ok": True, "reason": "", "by": "sglang (Blackwell; the plugin is not needed)"}
        if not cap.startswith("sm_9"):
            return {"ok": False, "reason": f"SBO needs Hopper (sm_90, with this plugin) or Blackwell; this is {cap}"}
        if not plugin["loaded_by_sglang"]:
            why = "not installed" if not plugin["entry_point"] else "excluded by SGLANG_PLUGINS"
            return {"ok": False, "reason": f"the sglang-pd plugin is {why}"}
        needed = (
            ("moe-config", "shared-only")
            if mode == "shared-only"
            else ("moe-config", "down-gemm", "combine-signal", "combine-call")
        )
        missing = [m for name in needed if targets and (m := targets.get(name))]
        if missing:
            return {"ok": False, "reason": " ".join(missing)}
        shared = status.shared_half()
        if not shared.ok:
            return {"ok": False, "reason": shared.reason}
        if mode == "full":
            half = status.combine_half(ep_nodes=ep_nodes)
            if not half.ok:
                return {"ok": False, "reason": half.reason}
            return {"ok": True, "reason": "", "by": f"sglang-pd plugin, {half.detail['layout']} signal layout"}
        return {"ok": True, "reason": "", "by": "sglang-pd plugin (dispatch-recv half only)"}

    return {"full": verdict("full"), "shared-only": verdict("shared-only")}


def collect(check_targets: bool = True, ep_nodes: int | None = None) -> dict[str, Any]:
    """Everything `doctor` reports, as one JSON-able document (SBO judged for a decode EP over `ep_nodes` nodes)."""
    from sglang_pd.sglang_patches import status

    nodes = default_ep_nodes() if ep_nodes is None else ep_nodes
    versions = {name: status.distribution_version(name) for name in DISTRIBUTIONS}
    gpu = _gpu()
    kernel = status.kernel_status()
    decision = status.deepep_layout()
    plugin = _plugin()
    targets = _targets() if check_targets and importlib.util.find_spec("sglang") is not None else None
    return {
        "versions": versions,
        "gpu": gpu,
        "kernel": {
            "module": status.KERNEL_MODULE,
            "usable": kernel.ok,
            "reason": kernel.reason,
            "warp_specialized": kernel.detail.get("warp_specialized", False),
        },
        "deepep_combine": {
            "layout": decision.layout,
            "read_from": decision.source,
            "params": list(decision.params),
            "reason": decision.reason,
        },
        "plugin": plugin,
        "deepep_driver": deepep_driver(),
        "hook_targets": None if targets is None else {k: v or "ok" for k, v in targets.items()},
        "ep_nodes": nodes,
        "sbo": _sbo_modes(gpu["capability"], plugin, targets, nodes),
        "sglang_flags": _preset_flags() if check_targets else None,
    }


def _preset_flags() -> FlagReport | None:
    """The installed sglang against every flag the shipped presets render (None: no sglang here)."""
    from sglang_pd.deploy.sglang.render import render_plan
    from sglang_pd.deploy.spec.topology import PRESETS_DIR, load_topology

    argvs = []
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        t = load_topology(path)
        argvs += [c.argv for cmds in render_plan(t).values() for c in cmds]
    return flag_report(argvs)


def format_table(doc: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [(name, v or "-") for name, v in doc["versions"].items()]
    g = doc["gpu"]
    if g["count"] == 0 and g["capability"]:  # `--capability`: no GPU is looked at
        rows.append(("GPU", f"none looked at; judged as {g['capability']} (--capability)"))
    else:
        rows.append(("GPU", f"{g['name']} x{g['count']} ({g['capability']})" if g["capability"] else "none visible"))
    k = doc["kernel"]
    if k["usable"]:
        gluon = "yes" if k["warp_specialized"] else "no (Triton only: needs triton.experimental.gluon on sm_90)"
        rows.append(("our sm_90 kernel", f"usable; warp-specialized (Gluon): {gluon}"))
    else:
        rows.append(("our sm_90 kernel", f"unusable: {k['reason']}"))
    d = doc["deepep_combine"]
    layouts = {"sglang": "sglang (sm_90 row-block signals: DeepEP antgroup-opt)", "deepep": "deepep (sgl-deep-ep)"}
    rows.append(("DeepEP combine signals", layouts.get(d["layout"], d["layout"]) or f"unknown: {d['reason']}"))
    p = doc["plugin"]
    rows.append(("sglang plugin", "loaded by sglang" if p["loaded_by_sglang"] else "not loaded"))
    drv = doc["deepep_driver"]
    verdict = {True: "ok", False: "NOT SET", None: "n/a"}[drv["ok"]]
    rows.append(("DeepEP driver options", f"{verdict}: {drv['detail']}"))
    if doc["hook_targets"] is not None:
        for name, state in doc["hook_targets"].items():
            rows.append((f"  hook {name}", state))
    for mode, v in doc["sbo"].items():
        where = f", decode EP over {_count_nodes(doc['ep_nodes'])}" if mode == "full" else ""
        rows.append((f"SBO {mode}", f"yes ({v['by']}{where})" if v["ok"] else f"no: {v['reason']}"))
    if doc.get("sglang_flags"):
        rows.append(("sglang flags (presets)", flag_summary(doc["sglang_flags"])))
    if "server_engagement" in doc:
        rows.append(_engagement_row(doc["server_engagement"]))
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a.ljust(width)}  {b}" for a, b in rows)


def _count_nodes(n: int) -> str:
    return "1 node" if n == 1 else f"{n} nodes"


def server_engagement(path: Path) -> dict[str, Any]:
    """What a server log says full SBO ran: summed counts, or why there are none."""
    from sglang_pd.sglang_patches import engagement

    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            counts = engagement.read_log(f)
    except OSError as exc:
        return {"log": str(path), "engaged": False, "reason": f"cannot read the server log: {exc.strerror}"}
    if counts is None:
        return {
            "log": str(path),
            "engaged": False,
            "reason": "no sglang-pd engagement line: the server has not run a decode step with full SBO "
            "(plugin not loaded, SBO mode not full, or no request decoded yet)",
        }
    doc: dict[str, Any] = {"log": str(path), **asdict(counts), "engaged": counts.engaged}
    if not counts.engaged:
        doc["reason"] = (
            f"signal GEMM calls {counts.signal_gemm}, signalled combines {counts.signal_combine}: "
            "both must be nonzero for the down-GEMM/combine overlap to have run"
        )
    return doc


def _engagement_row(e: dict[str, Any]) -> tuple[str, str]:
    if "signal_gemm" not in e:
        return ("SBO engaged (server log)", f"no: {e['reason']}")
    counts = (
        f"signal GEMM {e['signal_gemm']}, signalled combines {e['signal_combine']} "
        f"({e['captured']} while capturing CUDA graphs; {e['processes']} process(es))"
    )
    return ("SBO engaged (server log)", ("yes: " if e["engaged"] else "no: ") + counts)


def run(args: argparse.Namespace) -> int:
    from sglang_pd.sglang_patches import status

    # sglang warns at import about its quantization backends on a machine without their GPU ("Only CUDA,
    # HIP and XPU support AWQ currently.", srt/layers/quantization/awq/awq.py); doctor reports what this
    # machine can run in its own rows, and only sglang's own UserWarnings are left out.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang(\.|$)")
    if args.capability is not None:
        status.assume_capability(args.capability)
    doc = collect(check_targets=not args.skip_targets, ep_nodes=args.ep_nodes)
    if args.server_log is not None:
        doc["server_engagement"] = server_engagement(args.server_log)
    print(json.dumps(doc, indent=2) if args.format == "json" else format_table(doc))
    if args.expect and not doc["sbo"][args.expect]["ok"]:
        print(f"error: SBO {args.expect} cannot run here: {doc['sbo'][args.expect]['reason']}", file=sys.stderr)
        return EXIT_INVALID
    engaged = doc.get("server_engagement")
    if args.expect == SBOMode.FULL.value and engaged is not None and not engaged["engaged"]:
        print(f"error: full SBO did not run in the server of {args.server_log}: {engaged['reason']}", file=sys.stderr)
        return EXIT_INVALID
    return EXIT_OK
