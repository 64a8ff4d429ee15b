"""Check rendered commands with sglang's own argument resolver, on a machine without GPUs.

sglang validates its arguments in `ServerArgs.resolve_once()` and `check_server_args()`.
Those run on a CPU machine given a few workarounds (docs/upstream-facts.md); they are applied to a
*copy* of each command here, never to what is deployed:

- `--model-path` points at a temporary directory holding only the model's config.json
  (without `auto_map`, so no remote code is fetched), with `HF_HUB_OFFLINE=1`;
- `--device cuda` is added, since device detection raises on a machine without GPUs;
- `--disaggregation-ib-device` is dropped (sglang checks it against /sys/class/infiniband);
- the leader address in `--dist-init-addr` becomes 127.0.0.1.

Commands are checked in a child process (sglang's import is slow and has global state), kept
for every later check of the same GPU generation; the child answers one JSON object per
command: sglang's resolved values, or its error text.

After resolution the child also computes the *effective* view: what sglang will actually run.
It publishes the resolved arguments the way a scheduler does, sets sglang's MoE flags with
sglang's own `initialize_moe_config` (with every installed sglang plugin loaded, ours included),
and evaluates sglang's own predicates: `SboFlags` for the two SBO halves, `is_tbo_enabled`, the
DeepEP mode, the MoE runner, the CUDA-graph batch sizes, the attention backends and the LM-head
mode. The GPU is the topology's: sglang's platform facts and capability queries answer with its
compute capability (as the plugin's tests do on CPU), and the DeepEP the plugin judges is the
image's (deploy/sglang/image_deepep.py) unless the caller asks for this machine's.
`effective_problems` then compares each feature the topology asks for with what sglang will do,
naming the flag that is missing, and `dispatch_problems` holds the batches sglang resolved to the
DeepEP dispatch budget it reads. A fact the installed sglang cannot answer (another version) is
reported as unknown with why.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_pd.deploy.sglang.image_deepep import IMAGE_DEEPEP, judged_as_image
from sglang_pd.deploy.sglang.render import LEADER_HOST_FROM_ENV, NodeCommand, render_plan
from sglang_pd.deploy.sglang.sbo import deepep_caveat, deepep_here
from sglang_pd.deploy.spec.rendered import DISPATCH_BUDGET_ENV
from sglang_pd.deploy.spec.topology import DecodeSpec, SBOMode, Topology

__all__ = [
    "RESOLVED_KEYS",
    "SglangCheck",
    "SglangUnavailable",
    "check_with_sglang",
    "dispatch_problems",
    "effective_problems",
    "sglang_available",
]

# The resolved ServerArgs values a deployment depends on; read back after resolution.
RESOLVED_KEYS = (
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "disaggregation_transfer_backend",
    "tp_size",
    "dp_size",
    "attn_dp_size",
    "ep_size",
    "moe_a2a_backend",
    "deepep_mode",
    "page_size",
    "kv_cache_dtype",
    "enable_two_batch_overlap",
    "enable_single_batch_overlap",
    "cuda_graph_max_bs_decode",
    "moe_runner_backend",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "enable_dp_lm_head",
    "enable_tp_lm_head_all_to_all",
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
    effective: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """sglang accepted the command and runs every feature the topology asks for."""
        return self.ok and not self.problems

    def as_dict(self) -> dict[str, Any]:
        c = self.command
        return {
            "role": c.role,
            "instance": c.instance,
            "node_rank": c.node_rank,
            "ok": self.passed,
            "error": self.error,
            "resolved": self.resolved,
            "effective": self.effective,
            "problems": self.problems,
        }


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


def check_with_sglang(
    t: Topology,
    python: str | None = None,
    local_deepep: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[SglangCheck]:
    """Run sglang's resolver and checks on every distinct node command of the topology.

    The sglang-pd plugin decides SBO from a DeepEP: the image's (deploy/sglang/image_deepep.py), or with
    `local_deepep` the one installed where this runs. `progress` gets a line as the resolver starts and one
    per command checked (sglang's import alone takes seconds).
    """
    if python is None and not sglang_available():
        raise SglangUnavailable(
            "sglang is not installed here, so its own argument checks cannot run; install the "
            "`validate` extra and sglang without its GPU dependencies: "
            "pip install -e '.[validate]' (in the sglang-pd checkout) && pip install --no-deps sglang==0.5.23"
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

    cap = t.hardware.capability()
    with tempfile.TemporaryDirectory(prefix="sglang-pd-check-") as tmp:
        model_dir = _write_model_dir(config, Path(tmp))
        jobs = []
        for c in distinct.values():
            argv, env = _validation_copy(c, model_dir)
            jobs.append(
                {
                    "argv": argv,
                    "env": env,
                    "role": c.role,
                    "capability": list(cap) if cap else None,
                    "deepep": "local" if local_deepep else "image",
                }
            )
        resolver = _resolver(python or sys.executable, cap)
        unit = {"prefill": "instance", "decode": "group"}
        names = [f"{c.role} {unit.get(c.role, 'instance')} {c.instance} node {c.node_rank}" for c in distinct.values()]
        if progress is not None:
            progress(
                f"checking {len(jobs)} distinct command(s) with sglang's resolver"
                + ("" if resolver.used else " (its first run imports sglang: about 10 s)")
            )

        def done(i: int, result: dict[str, Any]) -> None:
            if progress is not None:
                verdict = "accepted" if result.get("ok") else "REFUSED"
                progress(f"  [{i + 1}/{len(jobs)}] {names[i]}: {verdict} by sglang")

        results = resolver.resolve(jobs, on_result=done)
    by_key = dict(zip(distinct, results, strict=True))
    checks = []
    for c in commands:
        r = by_key[json.dumps([c.argv, c.env], sort_keys=True)]
        effective = r.get("effective", {})
        resolved = r.get("resolved", {})
        problems = [*effective_problems(t, c, effective), *dispatch_problems(c, resolved, effective)] if r["ok"] else []
        checks.append(
            SglangCheck(
                command=c,
                ok=r["ok"],
                error=r.get("error"),
                resolved=resolved,
                effective=effective,
                problems=problems,
            )
        )
    return checks


class _Resolver:
    """One child interpreter with sglang imported (`_child`), resolving jobs sent one per line.

    sglang's import takes seconds, so a process keeps its child for every check of one GPU
    generation: the child restores the environment and the platform patches after each job, but
    sglang caches some capability answers for the life of the process, hence one child per
    capability."""

    def __init__(self, python: str) -> None:
        self._cwd = tempfile.TemporaryDirectory(prefix="sglang-pd-resolver-")
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the child)
        self._proc = subprocess.Popen(
            [python, "-m", "sglang_pd.deploy.sglang.check"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"},
            cwd=self._cwd.name,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._lock = threading.Lock()
        self.used = False  # True once it has resolved: sglang is imported

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(_RESULT):  # sglang prints to stdout too
                self._lines.put(line[len(_RESULT) :])
        self._lines.put(None)

    def resolve(
        self, jobs: list[dict[str, Any]], on_result: Callable[[int, dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """sglang's verdict on each job, in order (`on_result` gets each as it comes); raises when the child
        dies or takes too long."""
        self.used = True
        with self._lock:
            assert self._proc.stdin is not None
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            try:
                for job in jobs:
                    self._proc.stdin.write(json.dumps(job) + "\n")
                self._proc.stdin.flush()
                results: list[dict[str, Any]] = []
                while len(results) < len(jobs):
                    line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                    if line is None:
                        break
                    results.append(json.loads(line))
                    if on_result is not None:
                        on_result(len(results) - 1, results[-1])
            except (OSError, queue.Empty):
                results = []
            if len(results) == len(jobs):
                return results
            self._stop()
            self._stderr.seek(0)
            said = self._stderr.read()[-4000:]
            self.close()
            raise RuntimeError(
                f"sglang's resolver process failed (exit {self._proc.returncode}) before checking every command:\n"
                + said
            )

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        self._stop()
        self._stderr.close()
        self._cwd.cleanup()


_RESULT = "sglang-pd-result "
_RESOLVERS: dict[tuple[str, tuple[int, int] | None, int], _Resolver] = {}
_RESOLVERS_LOCK = threading.Lock()


def _resolver(python: str, cap: tuple[int, int] | None) -> _Resolver:
    """The live child for `python` and `cap` started with this environment (a changed environment,
    such as another PYTHONPATH or SGLANG_PLUGINS, makes sglang see other plugins: a new child)."""
    key = (python, cap, hash(frozenset(os.environ.items())))
    with _RESOLVERS_LOCK:
        resolver = _RESOLVERS.get(key)
        if resolver is None or not resolver.alive:
            if resolver is not None:
                resolver.close()  # died on its own: its files go with it
            resolver = _RESOLVERS[key] = _Resolver(python)
        return resolver


@atexit.register
def _close_resolvers() -> None:
    for resolver in _RESOLVERS.values():
        resolver.close()


# --- what the topology asks for, against what sglang will do ------------------------------------


def _flag(fact: dict[str, Any] | None) -> Any:
    return None if fact is None else fact.get("value")


def effective_problems(t: Topology, cmd: NodeCommand, effective: dict[str, Any]) -> list[str]:
    """Each feature the topology asks of this command that sglang will not run, naming what is missing."""
    spec = t.prefill if cmd.role == "prefill" else t.decode
    role = cmd.role
    facts: dict[str, dict[str, Any]] = effective.get("facts", {})
    version = effective.get("sglang_version", "?")
    problems: list[str] = []

    def fact(name: str) -> Any:
        return _flag(facts.get(name))

    def unknown(name: str) -> bool:
        f = facts.get(name)
        return f is None or "error" in f

    # sglang's refusal of SBO makes every MoE fact unknown with the same error: the refusal is reported once
    # (_decode_problems), not again for each fact it hid.
    sbo_asked = isinstance(spec, DecodeSpec) and spec.sbo is not SBOMode.OFF
    hidden_by_refusal = (facts.get("sbo_enabled") or {}).get("error") if sbo_asked else None

    def need(name: str, want: Any, message: str) -> None:
        if unknown(name):
            why = (facts.get(name) or {}).get("error", "not reported")
            if why == hidden_by_refusal and name != "sbo_enabled":
                return
            problems.append(f"{role}: cannot tell whether {message.split(';')[0]} with sglang {version}: {why}")
        elif fact(name) != want:
            problems.append(f"{role}: {message} (sglang {version} says {name} = {fact(name)!r})")

    need(
        "attn_dp_size",
        spec.attn_dp_size,
        f"DP attention of size {spec.attn_dp_size} ({role}.attn_dp_size) is not what sglang runs; "
        f"check --attn-dp-size {spec.attn_dp_size}",
    )
    need(
        "moe_a2a_backend",
        spec.moe_a2a_backend,
        f"{role}.moe_a2a_backend={spec.moe_a2a_backend} is not sglang's MoE all-to-all; check --moe-a2a-backend",
    )
    if spec.moe_a2a_backend == "deepep":
        need(
            "deepep_mode",
            spec.deepep_mode,
            f"DeepEP mode {spec.deepep_mode} ({role}.deepep_mode) is not effective; check --deepep-mode",
        )
    if spec.moe_runner_backend != "auto":
        need(
            "moe_runner_backend",
            spec.moe_runner_backend,
            f"{role}.moe_runner_backend={spec.moe_runner_backend} is not the runner sglang uses; "
            "check --moe-runner-backend",
        )
    need(
        "tbo",
        spec.tbo.enabled,
        f"two-batch overlap ({role}.tbo.enabled={spec.tbo.enabled}) is not what sglang runs; "
        "check --enable-two-batch-overlap",
    )
    if spec.attention_backend is not None:
        phase = "prefill_attention_backend" if role == "prefill" else "decode_attention_backend"
        need(
            phase,
            spec.attention_backend,
            f"attention backend {spec.attention_backend} ({role}.attention_backend) is not effective; "
            "check --attention-backend",
        )
    need(
        "page_size",
        t.model.page_size,
        f"sglang changed the KV page size from model.page_size={t.model.page_size} (its attention backend "
        "snaps it), so prefill and decode pages would differ; choose a page size the backend takes",
    )
    if spec.attn_dp_size > 1:
        need(
            "dp_lm_head",
            spec.dp_lm_head,
            f"LM head mode: {role}.dp_lm_head={spec.dp_lm_head} is not effective; check --enable-dp-lm-head",
        )
    if isinstance(spec, DecodeSpec):
        _decode_problems(t, spec, effective, need, problems)
    return problems


def _decode_problems(t: Topology, d: DecodeSpec, effective: dict[str, Any], need: Any, problems: list[str]) -> None:
    facts: dict[str, Any] = effective.get("facts", {})
    sbo_asked = d.sbo is not SBOMode.OFF
    # On sm_90 the plugin decides the SBO halves from the DeepEP it finds: the one of the machine that checks.
    caveat = f"; {_judged(effective)}" if t.hardware.capability() == (9, 0) else ""
    refusal = (facts.get("sbo_enabled") or {}).get("error")
    if sbo_asked and refusal:
        problems.append(
            f"decode: sglang refuses --enable-single-batch-overlap on {t.hardware.gpu}: {refusal}; "
            f"install the sglang-pd plugin in the image (`sglang-pd doctor` says what is missing){caveat}"
        )
        return
    need(
        "sbo_enabled",
        sbo_asked,
        f"single-batch overlap (decode.sbo={d.sbo.value}) is not what sglang runs; check --enable-single-batch-overlap"
        + (caveat if sbo_asked else ""),
    )
    if sbo_asked:
        need(
            "sbo_shared_overlap",
            True,
            "SBO's shared-expert half is not effective (SboFlags.fuse_shared_experts_inside_sbo); "
            f"check --enable-single-batch-overlap and --moe-a2a-backend deepep{caveat}",
        )
    if d.sbo is SBOMode.FULL:
        need(
            "sbo_combine_down_gemm_overlap",
            True,
            "SBO's down-GEMM/combine overlap is not effective "
            "(SboFlags.enable_combine_down_gemm_two_stream_overlap); add --moe-runner-backend deep_gemm "
            f"(decode.moe_runner_backend: deep_gemm; flashinfer_cutedsl on Blackwell){caveat}",
        )
    per_rank = -(-d.max_running_requests // d.attn_dp_size) if d.max_running_requests else None
    graphs = facts.get("cuda_graph_decode") or {}
    value = graphs.get("value") or {}
    if "error" in graphs:
        problems.append(f"decode: cannot read sglang's decode CUDA-graph sizes: {graphs['error']}")
    elif value.get("backend") == "disabled":
        problems.append(f"decode: sglang runs decode without CUDA graphs: {_why_no_decode_graphs(d)}")
    elif per_rank is not None and value.get("max_bs") is not None and value["max_bs"] < per_rank:
        problems.append(
            f"decode: CUDA graphs are captured up to batch {value['max_bs']}, below the per-rank decode batch "
            f"{per_rank}; set --cuda-graph-max-bs-decode {per_rank} (decode.cuda_graph_max_bs)"
        )


def _judged(effective: dict[str, Any]) -> str:
    """Whose DeepEP an SBO verdict judged: the image's, or (`--local-deepep`) the one where the check ran."""
    if effective.get("deepep_judged") == "image":
        return f"judged with {IMAGE_DEEPEP}; `sglang-pd doctor --expect full` in a pod judges the DeepEP it loads"
    return deepep_caveat(effective.get("deepep"))


# DeepEP's host assert on every low-latency dispatch: `x.size(0) <= num_max_dispatch_tokens_per_rank`
# (csrc/deep_ep.cpp:1555 at the image's revision); sglang checks none of these sizes when it starts.
_OVERFLOW = "DeepEP's host assert (x.size(0) <= num_max_dispatch_tokens_per_rank, csrc/deep_ep.cpp:1555)"


def dispatch_problems(cmd: NodeCommand, resolved: dict[str, Any], effective: dict[str, Any]) -> list[str]:
    """The batches sglang resolved for this command against the DeepEP dispatch budget it reads.

    DeepEP's low-latency buffers hold `SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK` tokens a rank. A decode rank
    dispatches its running batch (and every CUDA-graph batch it captures) at once; a prefill rank on low-latency
    dispatches each chunk (chunked_prefill_size after sglang divides it by attn_dp_size) at once.
    """
    facts: dict[str, Any] = effective.get("facts", {})
    budget = _flag(facts.get("dispatch_budget"))
    if resolved.get("moe_a2a_backend") != "deepep" or budget is None:
        return []
    mode = resolved.get("deepep_mode")
    holds = f"the {budget} tokens a rank DeepEP's low-latency buffers hold ({DISPATCH_BUDGET_ENV}={budget})"
    problems = []
    if cmd.role == "decode" and mode in ("low_latency", "auto"):
        graphs = _flag(facts.get("cuda_graph_decode")) or {}
        largest = max([*(graphs.get("bs") or []), graphs.get("max_bs") or 0])
        if graphs.get("backend") not in (None, "disabled") and largest > budget:
            problems.append(
                f"decode: sglang captures decode CUDA graphs up to batch {largest} a rank, above {holds}; such a "
                f"batch fails {_OVERFLOW}. Set decode.cuda_graph_max_bs to at most {budget}, or raise "
                f"decode.dispatch_token_budget to {largest}."
            )
        running, ranks = resolved.get("max_running_requests"), resolved.get("attn_dp_size") or 1
        if running and -(-running // ranks) > budget:
            problems.append(
                f"decode: sglang runs up to {running} requests over {ranks} attention-DP ranks, "
                f"{-(-running // ranks)} a rank, above {holds}; a full batch fails {_OVERFLOW}. Lower "
                f"decode.max_running_requests to {budget * ranks}, or raise decode.dispatch_token_budget."
            )
    if cmd.role == "prefill" and mode == "low_latency":
        chunk, ranks = resolved.get("chunked_prefill_size"), resolved.get("attn_dp_size") or 1
        if chunk is not None and (chunk <= 0 or chunk > budget):
            size = "whole prompts (chunked prefill off)" if chunk <= 0 else f"chunks of {chunk} tokens a rank"
            problems.append(
                f"prefill: sglang dispatches {size} through DeepEP low-latency, above {holds}; a larger one fails "
                f"{_OVERFLOW}. Set prefill.chunked_prefill_size to at most {budget * ranks}, or "
                "prefill.deepep_mode: normal."
            )
    return problems


# sglang 0.5.23's switches that turn decode CUDA graphs off (server_args.py, arg_groups/fields/exec_.py).
GRAPH_OFF_FLAGS = ("--disable-cuda-graph", "--disable-decode-cuda-graph")
GRAPH_BACKEND_FLAG = "--cuda-graph-backend-decode"


def _graph_off_flag(extra_args: list[str]) -> str | None:
    """The flag among `extra_args` that turns decode CUDA graphs off, as written, or None."""
    for i, arg in enumerate(extra_args):
        if arg in GRAPH_OFF_FLAGS:
            return arg
        if arg == f"{GRAPH_BACKEND_FLAG}=disabled":
            return arg
        if arg == GRAPH_BACKEND_FLAG and extra_args[i + 1 : i + 2] == ["disabled"]:
            return f"{arg} disabled"
    return None


def _why_no_decode_graphs(d: DecodeSpec) -> str:
    """Which topology field turned decode CUDA graphs off, and how to turn them back on."""
    flag = _graph_off_flag(d.extra_args)
    if flag is not None:
        return f"decode.extra_args has {flag}, which turns them off; remove it from decode.extra_args"
    if d.moe_a2a_backend == "deepep" and d.deepep_mode == "normal":
        return (
            "sglang captures no decode graphs with DeepEP's normal mode (decode.deepep_mode: normal); "
            "set decode.deepep_mode: low_latency"
        )
    backend = f"decode.attention_backend: {d.attention_backend}" if d.attention_backend else "the attention backend"
    return (
        f"a setting in decode.extra_args or {backend} makes sglang disable them (its log says which: "
        '"Cuda graph is disabled because ..."); remove that setting'
    )


def _child() -> None:
    """Resolve each {argv, env, role, capability} read from stdin, one JSON line each, until stdin
    ends; print one result line each (`_RESULT` and JSON).

    Runs with sglang importable, in its own process: it patches sglang's platform facts.
    """
    import contextlib
    import io
    import logging

    logging.disable(logging.WARNING)
    base_env = dict(os.environ)
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    for line in sys.stdin:
        job = json.loads(line)
        os.environ.clear()
        os.environ.update({**base_env, **job["env"]})
        cap = tuple(job["capability"]) if job.get("capability") else None
        stderr = io.StringIO()
        try:
            with contextlib.ExitStack() as scope:
                _patch_platform(scope, cap)
                if job.get("deepep") == "image":
                    scope.enter_context(judged_as_image())
                with contextlib.redirect_stderr(stderr):
                    args = prepare_server_args(job["argv"])
                args.resolve_once()
                args.check_server_args()
                view = resolving_view(args)
                resolved = {k: getattr(view, k, None) for k in RESOLVED_KEYS}
                effective = _effective(args, view, job["role"], cap, job.get("deepep") == "image")
            out: dict[str, Any] = {
                "ok": True,
                "resolved": {k: _jsonable(v) for k, v in resolved.items()},
                "effective": effective,
            }
        except SystemExit as exc:  # argparse rejects unknown flags with exit 2 after printing usage
            said = stderr.getvalue().strip().splitlines()
            out = {"ok": False, "error": said[-1] if said else f"sglang's parser exited with {exc.code}"}
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(_RESULT + json.dumps(out), flush=True)
    os.environ.clear()
    os.environ.update(base_env)


def _patch_platform(scope: Any, cap: tuple[int, int] | None) -> None:
    """Make sglang see the topology's GPU: its platform facts and the capability queries it calls.

    Everything patched is undone when `scope` closes. Without a capability (a CPU topology) sglang
    sees this machine.
    """
    if cap is None:
        return
    import importlib

    import torch

    major = cap[0]
    blackwell = major in (10, 11, 12)
    try:
        from sglang.srt.runtime_context import override_platform
    except ImportError:  # an sglang without scoped platform facts: the function patches below still apply
        pass
    else:
        facts = {
            "is_cuda": True,
            "is_hip": False,
            "is_npu": False,
            "is_xpu": False,
            "is_musa": False,
            "is_mps": False,
            "is_sm90": major == 9,
            "is_hopper_with_cuda_12_3": major == 9,
            "is_blackwell": blackwell,
            "is_sm100": major == 10,
            "is_sm100_or_sm110": major in (10, 11),
            "is_sm110": major == 11,
            "is_sm120": major == 12,
            # The image ships FlashInfer (an sglang dependency); CPU wheels here do not.
            "has_flashinfer": True,
            "device_capability": cap,
            "device_sm": major * 10 + cap[1],
        }
        from sglang.srt.runtime_context import get_platform

        known = {k: v for k, v in facts.items() if _platform_knows(get_platform(), k)}
        scope.enter_context(override_platform(**known))

    def patch(obj: Any, name: str, value: Any) -> None:
        if hasattr(obj, name):
            old = getattr(obj, name)
            setattr(obj, name, value)
            scope.callback(setattr, obj, name, old)

    patch(torch.cuda, "get_device_capability", lambda *a, **k: cap)
    # Module-level copies of sglang's probes (`from sglang.srt.utils import is_cuda`) read by the
    # functions evaluated below, and the plugin's own capability query.
    for module_name, name, value in (
        ("sglang.srt.layers.moe.utils", "is_cuda", lambda: True),
        ("sglang.srt.batch_overlap.single_batch_overlap", "is_blackwell", lambda: blackwell),
        ("sglang_pd.sglang_patches.status", "device_capability", lambda: cap),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        patch(module, name, value)


def _platform_knows(platform: Any, name: str) -> bool:
    try:
        getattr(platform, name)
    except AttributeError:
        return False
    except Exception:  # a probe that needs a GPU: the fact exists
        return True
    return True


def _effective(args: Any, view: Any, role: str, cap: tuple[int, int] | None, image_deepep: bool) -> dict[str, Any]:
    """What sglang will run for these resolved arguments, from sglang's own predicates.

    Each fact is {"value": ...} or {"error": "..."} when this sglang cannot answer it. `image_deepep`: the plugin
    judges with the image's DeepEP (`judged_as_image`), else with this process's.
    """
    import importlib.metadata

    facts: dict[str, dict[str, Any]] = {}

    def fact(name: str, fn: Any) -> None:
        try:
            facts[name] = {"value": _jsonable(fn())}
        except Exception as exc:
            facts[name] = {"error": f"{type(exc).__name__}: {exc}"}

    fact("attn_dp_size", lambda: view.attn_dp_size)
    fact("page_size", lambda: view.page_size)
    fact("prefill_attention_backend", lambda: view.prefill_attention_backend or view.attention_backend)
    fact("decode_attention_backend", lambda: view.decode_attention_backend or view.attention_backend)
    fact("dp_lm_head", lambda: bool(view.enable_dp_lm_head))
    fact("lm_head", lambda: _lm_head_mode(view))
    fact("cuda_graph_decode", lambda: _graph_phase(view, "decode"))
    fact("dispatch_budget", _dispatch_budget)

    # A scheduler publishes its arguments, then sets the MoE flags (with plugins' hooks applied).
    from sglang.srt import runtime_context

    runtime_context.reset_context()
    runtime_context.publish(args, role="scheduler" if _role_known("scheduler") else role)
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    except ImportError:
        pass
    from sglang.srt.layers.moe import utils as moe

    try:
        moe.initialize_moe_config()
        refused: str | None = None
    except Exception as exc:
        refused = f"{type(exc).__name__}: {exc}"

    def moe_fact(name: str, fn: Any) -> None:
        if refused is not None:
            facts[name] = {"error": f"sglang's initialize_moe_config raised {refused}"}
        else:
            fact(name, fn)

    moe_fact("moe_a2a_backend", lambda: moe.get_moe_a2a_backend().value)
    moe_fact("moe_runner_backend", lambda: moe.get_moe_runner_backend().value)
    moe_fact("deepep_mode", lambda: moe.get_deepep_mode().value)
    moe_fact("tbo", moe.is_tbo_enabled)
    moe_fact("sbo_enabled", moe.is_sbo_enabled)

    def sbo(predicate: str) -> Any:
        from sglang.srt.batch_overlap.single_batch_overlap import SboFlags

        return getattr(SboFlags, predicate)()

    moe_fact("sbo_combine_down_gemm_overlap", lambda: sbo("enable_combine_down_gemm_two_stream_overlap"))
    moe_fact("sbo_dispatch_shared_overlap", lambda: sbo("enable_dispatch_shared_one_stream_overlap"))
    moe_fact("sbo_combine_shared_overlap", lambda: sbo("enable_combine_shared_two_stream_overlap"))
    moe_fact("sbo_shared_overlap", lambda: sbo("fuse_shared_experts_inside_sbo"))
    runtime_context.reset_context()
    return {
        "sglang_version": importlib.metadata.version("sglang"),
        "capability": f"sm_{cap[0]}{cap[1]}" if cap else None,
        # The DeepEP the plugin chose the SBO halves from.
        "deepep": IMAGE_DEEPEP if image_deepep else deepep_here(),
        "deepep_judged": "image" if image_deepep else "local",
        "facts": facts,
    }


def _dispatch_budget() -> int:
    # What sglang's DeepEP dispatcher sizes its low-latency buffers by, as it reads it
    # (srt/layers/moe/token_dispatcher/deepep.py:404-408; the default in srt/environ.py).
    from sglang.srt.environ import envs

    return int(envs.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK.get())


def _role_known(role: str) -> bool:
    try:
        from sglang.srt.runtime_context import ROLE_NAMESPACE_SETS
    except ImportError:
        return False
    return role in ROLE_NAMESPACE_SETS


def _graph_phase(view: Any, phase: str) -> dict[str, Any]:
    config = getattr(view.cuda_graph_config, phase)
    return {"backend": str(config.backend), "max_bs": config.max_bs, "bs": list(config.bs or [])}


def _lm_head_mode(view: Any) -> str:
    # sglang/srt/layers/logits_processor.py: the head is replicated per attention-TP group with
    # --enable-dp-lm-head, else vocab-sharded over TP (gathered by all-to-all on pure-DP decode).
    if view.enable_dp_lm_head:
        return "replicated (dp-lm-head)"
    if view.attn_dp_size > 1 and view.enable_tp_lm_head_all_to_all:
        return "vocab-sharded, all-to-all"
    return "vocab-sharded, all-gather"


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return str(v)


if __name__ == "__main__":
    _child()
