"""Render a topology into the exact sglang 0.5.23 command and environment of every node.

`plan`, `up`, `launch` and the Helm chart all go through `render_plan` / `render_node` (docs/topology.md:
the topology is the only source of truth). It writes only the options and environment variables that
deploy/spec/rendered.py declares with the topology field each comes from; the rules read the same
declarations to keep `extra_args` and `env` from overriding them.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field

from sglang_pd.deploy.common.contract import ENV_SBO_SHARED_OUTSIDE, Role
from sglang_pd.deploy.spec.rendered import DISPATCH_BUDGET_ENV, RENDERED_ENV, RENDERED_FLAGS
from sglang_pd.deploy.spec.sbo_sms import COMBINE_SEND_SMS_ENV, rendered_send_sms
from sglang_pd.deploy.spec.topology import DecodeSpec, SBOMode, Topology
from sglang_pd.sglang_patches.status import SBO_MODE_ENV

__all__ = [
    "DIST_INIT_PORT",
    "LEADER_HOST_FROM_ENV",
    "NodeCommand",
    "Role",
    "ib_device_arg",
    "render_node",
    "render_plan",
]

# The module, not an interpreter: `launch` and `up` run it with their own Python.
SGLANG_ENTRY = ["-m", "sglang.launch_server"]
# torch.distributed rendezvous on the instance's leader (node rank 0) for multi-node roles.
DIST_INIT_PORT = 5000
# Stands for the leader's address until the launcher knows it (LeaderWorkerSet sets
# LWS_LEADER_ADDRESS in every pod); a shell expands it in `plan --format shell`.
LEADER_HOST_FROM_ENV = "${LWS_LEADER_ADDRESS}"


@dataclass(frozen=True)
class NodeCommand:
    """What one node of one instance (prefill) or group (decode) runs."""

    role: Role
    instance: int
    node_rank: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.argv[self.argv.index("--port") + 1])

    def shell(self, python: str = "python3") -> str:
        """One shell line: env assignments then `python` running the command; the leader address stays a
        shell variable."""

        def quote(s: str) -> str:
            if LEADER_HOST_FROM_ENV in s:
                return '"' + s + '"'
            return shlex.quote(s)

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        cmd = " ".join(quote(a) for a in [python, *self.argv])
        return f"{env} {cmd}" if env else cmd


def render_node(
    t: Topology,
    role: Role,
    node_rank: int = 0,
    instance: int = 0,
    leader_host: str = LEADER_HOST_FROM_ENV,
) -> NodeCommand:
    """The sglang argv and env of one node. `leader_host` is the instance leader's address."""
    spec = t.prefill if role == "prefill" else t.decode
    if not 0 <= node_rank < spec.nodes:
        raise ValueError(f"node_rank {node_rank} is outside 0..{spec.nodes - 1} for {role}.nodes={spec.nodes}")
    m = t.model
    endpoint = t.instance_endpoints(role)[instance]

    a = [*SGLANG_ENTRY, *_opt("--model-path", t.model_path())]
    if m.served_name:
        a += _opt("--served-model-name", m.served_name)
    if m.trust_remote_code:
        a += _opt("--trust-remote-code")
    if m.quantization:
        a += _opt("--quantization", m.quantization)
    if m.context_length:
        a += _opt("--context-length", str(m.context_length))
    a += _opt("--page-size", str(m.page_size))
    if m.kv_cache_dtype != "auto":
        a += _opt("--kv-cache-dtype", m.kv_cache_dtype)
    a += _opt("--host", "127.0.0.1" if t.is_local else "0.0.0.0") + _opt("--port", str(endpoint.port))
    # Prometheus metrics (TTFT, ITL, queues, KV transfer) for the chart's PodMonitor and dashboard.
    a += _opt("--enable-metrics")

    a += _opt("--disaggregation-mode", role) + _opt("--disaggregation-transfer-backend", t.transfer.backend)
    if role == "prefill":
        a += _opt("--disaggregation-bootstrap-port", str(endpoint.bootstrap_port))
    if t.transfer.protocol == "rdma" and t.transfer.ib_devices:
        a += _opt("--disaggregation-ib-device", ib_device_arg(t.transfer.ib_devices))

    # Full option names: sglang's parser would take `--tp` only as an abbreviation of `--tp-size`.
    a += _opt("--tp-size", str(spec.tp))
    if spec.attn_dp_size > 1:
        # DP attention with DeepSeek's MLA: the dense MLP layers run data-parallel too. The LM head
        # stays sglang's choice unless the topology asks for a replicated one (dp_lm_head).
        a += _opt("--attn-dp-size", str(spec.attn_dp_size)) + _opt("--moe-dense-tp-size", "1")
        if spec.dp_lm_head:
            a += _opt("--enable-dp-lm-head")
    if spec.ep > 1:
        a += _opt("--ep-size", str(spec.ep))
    if spec.moe_a2a_backend != "none":
        a += _opt("--moe-a2a-backend", spec.moe_a2a_backend) + _opt("--deepep-mode", spec.deepep_mode)
    if spec.moe_runner_backend != "auto":
        a += _opt("--moe-runner-backend", spec.moe_runner_backend)
    if spec.attention_backend is not None:
        a += _opt("--attention-backend", spec.attention_backend)
    if spec.nodes > 1:
        a += _opt("--nnodes", str(spec.nodes)) + _opt("--node-rank", str(node_rank))
        a += _opt("--dist-init-addr", f"{leader_host}:{DIST_INIT_PORT}")
    if spec.tbo.enabled:
        a += _opt("--enable-two-batch-overlap")
        a += _opt("--tbo-token-distribution-threshold", str(spec.tbo.token_distribution_threshold))
    if spec.mem_fraction_static is not None:
        a += _opt("--mem-fraction-static", str(spec.mem_fraction_static))
    if spec.max_running_requests is not None:
        a += _opt("--max-running-requests", str(spec.max_running_requests))
    if spec.chunked_prefill_size is not None:
        a += _opt("--chunked-prefill-size", str(spec.chunked_prefill_size))
    if spec.max_prefill_tokens is not None:
        a += _opt("--max-prefill-tokens", str(spec.max_prefill_tokens))

    env: dict[str, str] = {}
    if isinstance(spec, DecodeSpec):
        if spec.sbo is not SBOMode.OFF:
            a += _opt("--enable-single-batch-overlap")
            # Read by the sglang-pd plugin (sglang_patches), which sglang loads from its entry point in
            # every process. SGLANG_PLUGINS is left unset: it is a whitelist and would switch off any
            # other plugin installed in the image.
            _export(env, SBO_MODE_ENV, spec.sbo.value)
            if t.hardware.gpu.upper() == "H20" and spec.sbo is SBOMode.FULL:
                # Read only by sglang's DeepGEMM runner when the down GEMM overlaps combine: it narrows
                # the GEMM's N blocks (160) for the H20's fewer SMs.
                _export(env, "SGLANG_DEEPGEMM_ON_H20", "1")
            if (send_sms := rendered_send_sms(t)) is not None:  # decode.sbo_send_sms (deploy/spec/sbo_sms.py)
                _export(env, COMBINE_SEND_SMS_ENV, str(send_sms))
            if spec.sbo is SBOMode.FULL:
                # The shared expert on the alternate stream, as without SBO, while the down GEMM overlaps the
                # combine-send. sglang honours this switch only on Blackwell; the plugin's shared-stream hook
                # makes sm_90 honour it too (sglang_patches/shared_stream.py says what it measured).
                _export(env, ENV_SBO_SHARED_OUTSIDE, "1")
        if spec.cuda_graph_max_bs is not None:
            a += _opt("--cuda-graph-max-bs-decode", str(spec.cuda_graph_max_bs))
        if spec.moe_a2a_backend == "deepep":
            _export(env, DISPATCH_BUDGET_ENV, str(spec.dispatch_token_budget))
    if spec.moe_a2a_backend != "none" and spec.tp == 1:
        # A server with an MoE all-to-all syncs each batch's shape across its ranks, also when it has
        # one. sglang 0.5.17's sync then writes into a buffer that aliases its own fallback row and
        # raises at the first idle step (`MLPSyncBatchInfo.all_gather`,
        # srt/managers/scheduler_components/dp_attn.py); 0.5.23 skips the sync for one rank by itself.
        # This is sglang's own switch for that skip.
        _export(env, "SGLANG_SCHEDULER_SKIP_ALL_GATHER", "1")
    # The role's own extra_args and env come last; the rules refuse any that would replace a value above
    # (deploy/spec/rendered.py).
    a += spec.extra_args

    if t.transfer.backend == "mooncake" and t.transfer.protocol == "tcp":
        # sglang and Mooncake compare the value with "1" (mooncake_transfer_engine.py).
        _export(env, "MC_FORCE_TCP", "1")
    env.update(spec.env)
    return NodeCommand(role=role, instance=instance, node_rank=node_rank, argv=a, env=env)


def _opt(name: str, *values: str) -> list[str]:
    """`name` and its values. The renderer writes only options that RENDERED_FLAGS declares with the field
    they come from, so that the rules know each one and refuse it in extra_args."""
    if name not in RENDERED_FLAGS:
        raise KeyError(f"{name} is not in RENDERED_FLAGS (deploy/spec/rendered.py); declare it with its field")
    return [name, *values]


def _export(env: dict[str, str], key: str, value: str) -> None:
    """Set `key`, which RENDERED_ENV must declare with the field it comes from (as `_opt` for options)."""
    if key not in RENDERED_ENV:
        raise KeyError(f"{key} is not in RENDERED_ENV (deploy/spec/rendered.py); declare it with its field")
    env[key] = value


def ib_device_arg(ib_devices: Mapping[int, str]) -> str:
    """`--disaggregation-ib-device`: one device for every GPU, or sglang's per-GPU JSON map."""
    devices = set(ib_devices.values())
    if len(devices) == 1:
        return devices.pop()
    return json.dumps({str(gpu): ib_devices[gpu] for gpu in sorted(ib_devices)}, separators=(",", ":"))


def render_plan(t: Topology, leader_host: str = LEADER_HOST_FROM_ENV) -> dict[Role, list[NodeCommand]]:
    """Every node's command, per role: prefill instances x nodes, decode groups x nodes."""
    prefill = [
        render_node(t, "prefill", rank, i, leader_host)
        for i in range(t.prefill.instances)
        for rank in range(t.prefill.nodes)
    ]
    decode = [
        render_node(t, "decode", rank, g, leader_host) for g in range(t.decode.groups) for rank in range(t.decode.nodes)
    ]
    return {"prefill": prefill, "decode": decode}
