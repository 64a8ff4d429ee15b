"""Whether this build can serve a topology's SBO mode: its GPU, the sglang plugin, and the DeepEP
installed where the check runs (`plan --check` and `doctor` both ask here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

from sglang_pd.deploy.spec.sbo_sms import sglang_send_sms
from sglang_pd.deploy.spec.topology import GPU_CAPABILITY, SBOMode, Topology

__all__ = [
    "HOPPER",
    "PLUGIN_ENTRY_POINT",
    "deepep_caveat",
    "deepep_here",
    "sbo_topology_errors",
    "sbo_topology_warnings",
]

#: GPU types by architecture, from the topology's one GPU table. sm_90 needs this plugin for SBO;
#: sglang serves SBO on Blackwell itself.
HOPPER = frozenset(gpu for gpu, (major, _) in GPU_CAPABILITY.items() if major == 9)
#: The name of our entry point in sglang's `sglang.srt.plugins` group (pyproject.toml).
PLUGIN_ENTRY_POINT = "sglang_pd"


def deepep_here() -> str:
    """The DeepEP this process would load, without importing it: its distribution and version, and its module's
    location ("none" when no `deep_ep` module is importable)."""
    from sglang_pd.sglang_patches.status import distribution_version

    spec = importlib.util.find_spec("deep_ep")
    if spec is None:
        return "none"
    versions = ((dist, distribution_version(dist)) for dist in ("sgl-deep-ep", "deep-ep", "deep_ep"))
    version = next((f"{dist} {v}" for dist, v in versions if v is not None), "no distribution metadata")
    where = spec.origin or next(iter(spec.submodule_search_locations or []), "?")
    return f"{version} at {where}"


def deepep_caveat(deepep: str | None = None) -> str:
    """The clause every DeepEP-dependent SBO verdict of `plan --check` carries: whose DeepEP it judged.

    `deepep` is `deepep_here()` as the process that judged saw it (sglang's resolver runs in a child).
    """
    return (
        f"judged with the DeepEP installed where this check runs ({deepep or deepep_here()}), not the cluster "
        "image's; `sglang-pd doctor --expect full` in the image judges the DeepEP the pods load"
    )


def sbo_topology_errors(t: Topology) -> list[str]:
    """Errors for a topology whose full SBO on Hopper would trap or hang with the DeepEP installed where this runs.

    The verdict is about this machine's DeepEP (read from its sources): run `plan --check` where the
    image's DeepEP is, or `sglang-pd doctor --expect full --ep-nodes N` in the image.
    """
    if t.decode.sbo is not SBOMode.FULL or t.hardware.capability() != (9, 0):
        return []
    from sglang_pd.sglang_patches import status

    decision = status.deepep_layout()
    if decision.layout is None:
        return []  # sbo_topology_warnings says so
    send_sms, _ = sglang_send_sms(t)  # what the renderer exports (decode.sbo_send_sms or its default), else sglang's
    contract = status.layout_contract(decision.layout, ep_nodes=t.decode.nodes, send_sms=send_sms)
    if contract.ok:
        return []
    version = status.distribution_version("sgl-deep-ep") or status.distribution_version("deep-ep") or "unknown"
    return [
        f"decode.sbo: full on {t.hardware.gpu} with decode.nodes={t.decode.nodes}: {contract.reason} "
        f"(judged from the DeepEP installed where this check runs: {version}, {decision.source}; the image's "
        "DeepEP decides in the pods: `sglang-pd doctor --expect full` there)."
    ]


def sbo_topology_warnings(t: Topology) -> list[str]:
    """Warnings for a topology asking for SBO on a GPU type this build cannot serve it on."""
    mode = t.decode.sbo
    if mode is SBOMode.OFF:
        return []
    # The capability, not the name: `hardware.compute_capability` places a GPU type the table lacks.
    cap = t.hardware.capability()
    if cap is not None and cap[0] == 10:
        return []
    if cap != (9, 0):
        return [
            f"decode.sbo: {mode.value} on hardware.gpu {t.hardware.gpu}: this build serves SBO on Hopper "
            f"({', '.join(sorted(HOPPER))}, through its sglang plugin) and on Blackwell (sglang itself); "
            "set decode.sbo: off."
        ]
    from sglang_pd.sglang_patches import status
    from sglang_pd.sglang_patches.targets import SGLANG_TARGET_VERSION, SUPPORTED_SGLANG_VERSIONS

    warnings = []
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if PLUGIN_ENTRY_POINT not in {ep.name for ep in eps}:
        warnings.append(
            f"decode.sbo: {mode.value} on {t.hardware.gpu} (sm_90) needs the sglang-pd sglang plugin, and its entry "
            "point is not installed here: pip install sglang-pd (the image must have it too)."
        )
    if mode is SBOMode.FULL and importlib.util.find_spec(status.KERNEL_MODULE) is None:
        warnings.append(
            f"decode.sbo: full on {t.hardware.gpu} (sm_90) needs {status.KERNEL_MODULE}, which this build lacks; "
            "set decode.sbo: shared-only."
        )
    installed = status.distribution_version("sglang")
    if installed is not None and installed not in SUPPORTED_SGLANG_VERSIONS:
        warnings.append(
            f"decode.sbo: {mode.value} on {t.hardware.gpu} (sm_90) relies on hooks written for sglang "
            f"{SGLANG_TARGET_VERSION}; sglang {installed} is installed here (run `sglang-pd doctor`)."
        )
    if mode is SBOMode.FULL and status.distribution_version("sgl-deep-ep") is not None:
        decision = status.deepep_layout()
        if decision.layout is None:
            warnings.append(
                f"decode.sbo: full on {t.hardware.gpu}: {decision.reason}; set decode.sbo: shared-only "
                f"({deepep_caveat()})."
            )
    return warnings
