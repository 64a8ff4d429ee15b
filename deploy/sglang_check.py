"""Check rendered commands with sglang's own argument resolver, on a machine without GPUs.

sglang validates its arguments in `ServerArgs.resolve_once()` and `check_server_args()`.
Those run on a CPU machine given a few workarounds (REFERENCE.md §1); they are applied to a
*copy* of each command here, never to what is deployed:

- `--model-path` points at a temporary directory holding only the model's config.json
  (without `auto_map`, so no remote code is fetched), with `HF_HUB_OFFLINE=1`;
- `--device cuda` is added, since device detection raises on a machine without GPUs;
- `--disaggregation-ib-device` is dropped (sglang checks it against /sys/class/infiniband);
- the leader address in `--dist-init-addr` becomes 127.0.0.1.

Each topology is checked in one child process (sglang's import is slow and has global state);
the child prints one JSON object per command: sglang's resolved values, or its error text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_pd.deploy.sglang_args import LEADER_HOST_FROM_ENV, NodeCommand, render_plan
from sglang_pd.deploy.topology import Topology

__all__ = ["RESOLVED_KEYS", "SglangCheck", "SglangUnavailable", "check_with_sglang", "sglang_available"]

# The resolved ServerArgs values a deployment depends on; read back after resolution.
RESOLVED_KEYS = (
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "disaggregation_transfer_backend",
    "tp_size",
    "attn_dp_size",
    "ep_size",
    "moe_a2a_backend",
    "deepep_mode",
    "page_size",
    "kv_cache_dtype",
    "enable_two_batch_overlap",
    "enable_single_batch_overlap",
    "cuda_graph_max_bs_decode",
    "max_running_requests",
    "chunked_prefill_size",
    "nnodes",
    "node_rank",
)

CHILD_TIMEOUT_S = 300


class SglangUnavailable(RuntimeError):
    """sglang is not importable here, so its resolver cannot run."""


@dataclass(frozen=True)
class SglangCheck:
    """sglang's verdict on one node's command."""

    command: NodeCommand
    ok: bool
    error: str | None = None
    resolved: dict[str, Any] = field(default_factory=dict)


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _validation_copy(cmd: NodeCommand, model_dir: str) -> tuple[list[str], dict[str, str]]:
    argv = list(cmd.argv[cmd.argv.index("sglang.launch_server") + 1 :])
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--disaggregation-ib-device":
            skip = True
            continue
        if arg == "--model-path":
            out += [arg, model_dir]
            skip = True
            continue
        if i > 0 and argv[i - 1] == "--dist-init-addr":
            arg = arg.replace(LEADER_HOST_FROM_ENV, "127.0.0.1")
        out.append(arg)
    if "--device" not in out:
        out += ["--device", "cuda"]
    env = {**cmd.env, "HF_HUB_OFFLINE": "1"}
    return out, env


def _write_model_dir(config: dict[str, Any], root: Path) -> str:
    config = {k: v for k, v in config.items() if k != "auto_map"}
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def check_with_sglang(t: Topology, python: str | None = None) -> list[SglangCheck]:
    """Run sglang's resolver and checks on every distinct node command of the topology."""
    if python is None and not sglang_available():
        raise SglangUnavailable(
            "sglang is not installed here, so its own argument checks cannot run; install the "
            "`validate` extra and sglang without its GPU dependencies: "
            "pip install 'sglang-pd[validate]' && pip install --no-deps sglang==0.5.23"
        )
    config = t.load_model_config()
    if config is None:
        local = Path(t.model.path) / "config.json"
        if not local.is_file():
            raise SglangUnavailable(
                "sglang's resolver reads the model's config.json: set model.config_json in the topology "
                f"(model.path {t.model.path!r} is not a local directory with a config.json)."
            )
        config = json.loads(local.read_text())

    commands = [c for cmds in render_plan(t).values() for c in cmds]
    # Instances of a role render the same argv in a cluster: check each distinct command once.
    distinct: dict[str, NodeCommand] = {}
    for c in commands:
        distinct.setdefault(json.dumps([c.argv, c.env], sort_keys=True), c)

    with tempfile.TemporaryDirectory(prefix="sglang-pd-check-") as tmp:
        model_dir = _write_model_dir(config, Path(tmp))
        jobs = [_validation_copy(c, model_dir) for c in distinct.values()]
        payload = json.dumps([{"argv": a, "env": e} for a, e in jobs])
        proc = subprocess.run(
            [python or sys.executable, "-m", "sglang_pd.deploy.sglang_check"],
            input=payload,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
            cwd=tmp,
        )
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(results) != len(jobs):
        raise RuntimeError(
            f"sglang's resolver process failed (exit {proc.returncode}) before checking every command:\n"
            + proc.stderr[-4000:]
        )
    by_key = dict(zip(distinct, results, strict=True))
    checks = []
    for c in commands:
        r = by_key[json.dumps([c.argv, c.env], sort_keys=True)]
        checks.append(SglangCheck(command=c, ok=r["ok"], error=r.get("error"), resolved=r.get("resolved", {})))
    return checks


def _child() -> None:
    """Resolve each {argv, env} read from stdin; print one JSON line each. Runs with sglang importable."""
    import contextlib
    import io
    import logging

    logging.disable(logging.WARNING)
    jobs = json.loads(sys.stdin.read())
    base_env = dict(os.environ)
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    for job in jobs:
        os.environ.clear()
        os.environ.update({**base_env, **job["env"]})
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                args = prepare_server_args(job["argv"])
            args.resolve_once()
            args.check_server_args()
            view = resolving_view(args)
            resolved = {k: getattr(view, k, None) for k in RESOLVED_KEYS}
            out: dict[str, Any] = {"ok": True, "resolved": {k: _jsonable(v) for k, v in resolved.items()}}
        except SystemExit as exc:  # argparse rejects unknown flags with exit 2 after printing usage
            said = stderr.getvalue().strip().splitlines()
            out = {"ok": False, "error": said[-1] if said else f"sglang's parser exited with {exc.code}"}
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)


if __name__ == "__main__":
    _child()
