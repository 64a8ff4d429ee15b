"""`sglang-pd plan`: a topology's nodes, GPUs, per-node commands and warnings, as a table, JSON, YAML or shell.

With `--check`, `check_plan` adds sglang's own verdict on every command and the effective view:
what sglang will run (SBO halves, TBO, DP attention, DeepEP mode, MoE runner, CUDA graphs,
attention backends, LM head), each feature the topology asks for but sglang would not run
being an error that names the missing flag, as is a resolved batch beyond DeepEP's dispatch
budget. SBO is judged with the image's DeepEP unless `--local-deepep` asks for this machine's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import yaml

from sglang_pd.deploy.common.contract import EXIT_INVALID, EXIT_OK
from sglang_pd.deploy.common.contract import EXIT_UNAVAILABLE as EXIT_CHECK_UNAVAILABLE
from sglang_pd.deploy.sglang.compat import FlagReport, flag_summary
from sglang_pd.deploy.sglang.render import NodeCommand, Role, render_plan
from sglang_pd.deploy.spec.topology import RuleReport, SBOMode, Topology

__all__ = ["EXIT_CHECK_UNAVAILABLE", "EXIT_INVALID", "EXIT_OK", "Plan", "build_plan", "check_plan", "format_plan"]

FORMATS = ("table", "json", "yaml", "shell")


@dataclass(frozen=True)
class Plan:
    """A checked topology and what it renders to."""

    topology: Topology
    rules: RuleReport
    commands: dict[Role, list[NodeCommand]]
    sglang_checks: list[dict[str, Any]] | None = None  # filled by `plan --check` when sglang is importable
    sglang_flags: FlagReport | None = None  # `plan --check`: the installed sglang against the rendered flags
    deepep_judged: str | None = None  # `plan --check`: whose DeepEP the SBO verdicts judged

    # Colocated roles (`Topology.colocated`) run every instance on the same node and GPUs, so each
    # role uses one node and `tp` GPUs, and the totals count those shared ones once.
    @property
    def nodes(self) -> dict[str, int]:
        t = self.topology
        if t.colocated:
            return {"prefill": 1, "decode": 1}
        return {"prefill": t.prefill.instances * t.prefill.nodes, "decode": t.decode.groups * t.decode.nodes}

    @property
    def gpus(self) -> dict[str, int]:
        t = self.topology
        if t.is_local:  # the reference engines run on this host's CPUs
            return {"prefill": 0, "decode": 0}
        if t.colocated:
            return {"prefill": t.prefill.tp, "decode": t.decode.tp}
        return {"prefill": t.prefill.instances * t.prefill.tp, "decode": t.decode.groups * t.decode.tp}

    @property
    def total_nodes(self) -> int:
        return 1 if self.topology.colocated else sum(self.nodes.values())

    @property
    def total_gpus(self) -> int:
        return max(self.gpus.values()) if self.topology.colocated else sum(self.gpus.values())


def build_plan(t: Topology, rules: RuleReport) -> Plan:
    return Plan(topology=t, rules=rules, commands=render_plan(t))


def check_plan(
    p: Plan, local_deepep: bool = False, progress: Callable[[str], None] | None = None
) -> tuple[Plan, int, str | None]:
    """`plan --check`: sglang's resolver and effective view on every command.

    SBO is judged with the DeepEP the image builds (deploy/sglang/image_deepep.py), or with `local_deepep`
    with the one installed here. Returns the plan with the verdicts, an exit status (EXIT_INVALID when sglang
    rejects a command, would not run a feature the topology asks for, or would overflow DeepEP's dispatch
    buffers), and a note when the check cannot run here. `progress` gets a line per step as it goes.
    """
    from sglang_pd.deploy.sglang.check import SglangUnavailable, check_with_sglang
    from sglang_pd.deploy.sglang.compat import flag_report
    from sglang_pd.deploy.sglang.image_deepep import IMAGE_DEEPEP, judged_as_image
    from sglang_pd.deploy.sglang.sbo import deepep_here, sbo_topology_errors, sbo_topology_warnings

    t = p.topology
    if local_deepep:
        p = replace(p, deepep_judged=f"this machine's DeepEP ({deepep_here()}), not necessarily the image's")
    else:
        p = replace(p, deepep_judged=f"{IMAGE_DEEPEP}; --local-deepep judges this machine's")
    with contextlib.nullcontext() if local_deepep else judged_as_image():
        # SBO asked for on a GPU type this build cannot serve it on (warnings, not errors).
        sbo_warnings = sbo_topology_warnings(t)
        # Full SBO with a DeepEP that would trap or hang on this decode EP (errors: the deployment must not start).
        sbo_errors = sbo_topology_errors(t)
    if sbo_warnings:
        p = replace(p, rules=replace(p.rules, warnings=[*p.rules.warnings, *sbo_warnings]))
    if sbo_errors:
        p = replace(p, rules=replace(p.rules, errors=[*p.rules.errors, *sbo_errors]))
    try:
        checks = check_with_sglang(t, local_deepep=local_deepep, progress=progress)
    except SglangUnavailable as exc:
        return p, (EXIT_INVALID if sbo_errors else EXIT_CHECK_UNAVAILABLE), str(exc)
    if progress is not None:
        progress("comparing the rendered flags with the installed sglang's")
    flags = flag_report(c.argv for cmds in p.commands.values() for c in cmds)
    p = replace(p, sglang_checks=[c.as_dict() for c in checks], sglang_flags=flags)
    passed = all(c.passed for c in checks) and not sbo_errors
    return p, (EXIT_OK if passed else EXIT_INVALID), None


def estimate_report(t: Topology, fmt: str, input_len: int, output_len: int, decode_batch: int | None) -> str:
    """`plan --estimate`: the topology's predicted performance as a table or JSON (docs/estimate.md)."""
    from sglang_pd.deploy.estimate import estimate_topology, format_estimate

    return format_estimate(estimate_topology(t, input_len, output_len, decode_batch), fmt)


def _command_dict(c: NodeCommand) -> dict[str, Any]:
    return {"instance": c.instance, "node_rank": c.node_rank, "argv": c.argv, "env": c.env}


def plan_document(p: Plan) -> dict[str, Any]:
    t = p.topology
    doc: dict[str, Any] = {
        "name": t.name,
        "model": t.model.path,
        "served_model_name": t.model.name,
        "gpu": t.hardware.gpu,
        "colocated": t.colocated,
        "nodes": {**p.nodes, "total": p.total_nodes},
        "gpus": {**p.gpus, "total": p.total_gpus},
        "roles": {role: [_command_dict(c) for c in cmds] for role, cmds in p.commands.items()},
        "router": t.router.model_dump(),
        "warnings": p.rules.warnings,
    }
    if p.rules.errors:
        doc["errors"] = p.rules.errors
    if p.sglang_checks is not None:
        doc["sglang_check"] = p.sglang_checks
    if p.sglang_flags is not None:
        doc["sglang_flags"] = p.sglang_flags
    if p.deepep_judged is not None:
        doc["deepep_judged"] = p.deepep_judged
    return doc


def _parallelism(role: Role, t: Topology) -> str:
    s = t.prefill if role == "prefill" else t.decode
    parts = [f"TP{s.tp}"]
    if s.attn_dp_size > 1:
        parts.append(f"attn-DP{s.attn_dp_size}")
    if s.ep > 1:
        parts.append(f"EP{s.ep}")
    if s.moe_a2a_backend != "none":
        parts.append(f"{s.moe_a2a_backend}/{s.deepep_mode}")
    if s.tbo.enabled:
        parts.append("TBO")
    if role == "decode" and t.decode.sbo is not SBOMode.OFF:
        parts.append(f"SBO({t.decode.sbo.value})")
    return " ".join(parts)


def _table(p: Plan) -> str:
    t = p.topology
    ports = {
        "prefill": f"http {t.prefill.port}, bootstrap {t.prefill.bootstrap_port}",
        "decode": f"http {t.decode.port}",
    }
    counts = {"prefill": t.prefill.instances, "decode": t.decode.groups}
    rows = [("role", "count", "nodes", "GPUs", "parallelism", "ports")]
    rows += [
        (role, str(counts[role]), str(p.nodes[role]), str(p.gpus[role]), _parallelism(role, t), ports[role])
        for role in ("prefill", "decode")
    ]
    policies = f"prefill {t.router.prefill_policy}, decode {t.router.decode_policy}"
    rows.append(("router", "1", "-", "-", policies, f"http {t.router.port}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    shared = ", shared by prefill and decode" if t.colocated and not t.is_local else ""
    lines = [
        f"topology {t.name}: {t.model.path} served as {t.model.name!r} on {t.hardware.gpu} "
        f"x{t.hardware.gpus_per_node} per node; {_count(p.total_nodes, 'node')}, {_count(p.total_gpus, 'GPU')}{shared}",
        "",
    ]
    if t.is_local:
        lines += [
            f"`sglang-pd up {t.name}` (and `make run`) runs these roles with the reference engine "
            "(`sglang-pd engine`, PyTorch on this machine's CPU), not with the sglang commands below, which "
            "show what sglang would be given.",
            "",
        ]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    for role, cmds in p.commands.items():
        for c in cmds:
            lines += [
                "",
                f"{role} {'instance' if role == 'prefill' else 'group'} {c.instance} node {c.node_rank}:",
            ]
            lines += [f"  {k}={v}" for k, v in sorted(c.env.items())]
            lines.append("  " + " ".join(c.argv))
    if p.rules.errors:
        lines += ["", "errors:"] + [f"  - {e}" for e in p.rules.errors]
    if p.rules.warnings:
        lines += ["", "warnings:"] + [f"  - {w}" for w in p.rules.warnings]
    if p.sglang_checks is not None:
        lines += ["", "sglang's own checks and what it will run (the effective view):"]
        for chk in p.sglang_checks:
            where = f"{chk['role']} {chk['instance']} node {chk['node_rank']}"
            if chk["error"]:
                lines.append(f"  {where}: REJECTED: {chk['error']}")
                continue
            lines.append(f"  {where}: {'ok' if chk['ok'] else 'NOT AS ASKED'}; {_effective_line(chk['effective'])}")
            lines += [f"    - {problem}" for problem in chk["problems"]]
    if p.sglang_flags is not None:
        lines += ["", f"sglang flags: {flag_summary(p.sglang_flags)}"]
    if p.deepep_judged is not None:
        lines += [f"DeepEP judged: {p.deepep_judged}"]
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"no {noun}" if n == 0 else f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _effective_line(effective: dict[str, Any]) -> str:
    facts = effective.get("facts", {})

    def show(name: str) -> str:
        f = facts.get(name, {})
        return "?" if "value" not in f else str(f["value"])

    graphs = facts.get("cuda_graph_decode", {}).get("value") or {}
    parts = [
        f"sglang {effective.get('sglang_version')} on {effective.get('capability')}",
        f"attn-DP {show('attn_dp_size')}",
        f"a2a {show('moe_a2a_backend')}/{show('deepep_mode')}",
        f"runner {show('moe_runner_backend')}",
        f"TBO {show('tbo')}",
        f"SBO {show('sbo_enabled')} (shared {show('sbo_shared_overlap')}, "
        f"down-GEMM/combine {show('sbo_combine_down_gemm_overlap')}; {_deepep_words(effective)})",
        f"attention {show('prefill_attention_backend')}/{show('decode_attention_backend')}",
        f"LM head {show('lm_head')}",
        f"decode graphs {graphs.get('backend', '?')} <= {graphs.get('max_bs', '?')}",
    ]
    return ", ".join(parts)


def _deepep_words(effective: dict[str, Any]) -> str:
    if effective.get("deepep_judged") == "image":
        return f"with {effective.get('deepep')}"
    return f"with this machine's DeepEP, {effective.get('deepep', '?')}, not necessarily the image's"


def _shell(p: Plan) -> str:
    lines = [f"# sglang-pd plan for {p.topology.name}: one line per node; run each on its node."]
    for role, cmds in p.commands.items():
        for c in cmds:
            lines.append(f"# {role} {c.instance} node {c.node_rank}")
            lines.append(c.shell())
    return "\n".join(lines)


def format_plan(p: Plan, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(plan_document(p), indent=2)
    if fmt == "yaml":
        return yaml.safe_dump(plan_document(p), sort_keys=False)
    if fmt == "shell":
        return _shell(p)
    if fmt == "table":
        return _table(p)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
