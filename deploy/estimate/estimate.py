"""A topology's predicted prefill and decode performance, the P:D ratio and the KV-capacity check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_pd.deploy.estimate.capacity import KVCapacity, kv_bytes_per_element, kv_capacity
from sglang_pd.deploy.estimate.hardware import load_hardware
from sglang_pd.deploy.estimate.roofline import KV_TRANSFER, Cost, Layout, Roofline
from sglang_pd.deploy.spec.model_shape import ModelShape
from sglang_pd.deploy.spec.sbo_sms import sglang_send_sms
from sglang_pd.deploy.spec.topology import DecodeSpec, PrefillSpec, Topology, TopologyError

__all__ = ["DEFAULT_INPUT_LEN", "DEFAULT_OUTPUT_LEN", "Estimate", "EstimateError", "estimate_topology"]

DEFAULT_INPUT_LEN = 4096
DEFAULT_OUTPUT_LEN = 1536
# sglang's --chunked-prefill-size default on 80 GB+ GPUs: tokens of one prefill forward pass.
DEFAULT_PREFILL_TOKENS = 8192
REDUNDANT_EXPERTS_FLAG = "--ep-num-redundant-experts"


class EstimateError(TopologyError):
    """The topology cannot be estimated (no GPU profile, no config.json, no decode batch)."""


@dataclass(frozen=True)
class PhaseEstimate:
    """One phase's figures and where its time goes."""

    tokens_per_s_per_gpu: float
    latency_ms: float  # TTFT for prefill, ITL for decode
    bound: str
    breakdown_ms: dict[str, float]


@dataclass(frozen=True)
class SboTerms:
    """What SBO gains per MoE layer (negative: loses), by half, at the decode batch."""

    mode: str  # the topology's decode.sbo ("off": what full SBO would do)
    runs: str  # the halves sglang would run: "full" or "shared-only"
    send_sms: int
    send_sms_source: str
    shared_us_per_layer: float  # the shared expert against the dispatch in flight
    combine_us_per_layer: float  # the down GEMM against combine-send (0 without it)
    moe_layers: int

    @property
    def us_per_layer(self) -> float:
        return self.shared_us_per_layer + self.combine_us_per_layer

    @property
    def ms_per_step(self) -> float:
        return self.us_per_layer * self.moe_layers / 1e3

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "runs": self.runs,
            "send_sms": self.send_sms if self.runs == "full" else None,
            "send_sms_source": self.send_sms_source if self.runs == "full" else None,
            "gain_us_per_layer": round(self.us_per_layer, 1),
            "shared_us_per_layer": round(self.shared_us_per_layer, 1),
            "combine_us_per_layer": round(self.combine_us_per_layer, 1),
            "gain_ms_per_step": round(self.ms_per_step, 2),
            "moe_layers": self.moe_layers,
        }


@dataclass(frozen=True)
class Estimate:
    """What `plan --estimate` reports."""

    topology: str
    gpu: str
    input_len: int
    output_len: int
    decode_batch: int
    prefill: PhaseEstimate
    decode: PhaseEstimate
    sbo_saving: float
    sbo_applies: bool
    sbo: SboTerms | None
    tbo_saving: float
    pd_ratio: float
    kv: KVCapacity
    assumptions: list[str]
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefill": {
                "tokens_per_s_per_gpu": round(self.prefill.tokens_per_s_per_gpu, 1),
                "ttft_ms": round(self.prefill.latency_ms, 1),
                "bound": self.prefill.bound,
                "breakdown_ms": self.prefill.breakdown_ms,
            },
            "decode": {
                "itl_ms": round(self.decode.latency_ms, 2),
                "tokens_per_s_per_gpu": round(self.decode.tokens_per_s_per_gpu, 1),
                "bound": self.decode.bound,
                "sbo_saving": round(self.sbo_saving, 4),
                "sbo": self.sbo.as_dict() if self.sbo else None,
                "tbo_saving": round(self.tbo_saving, 4),
                "breakdown_ms": self.decode.breakdown_ms,
            },
            "pd_ratio": round(self.pd_ratio, 3),
            "assumptions": self.assumptions,
            "kv_capacity": self.kv.as_dict(),
            "inputs": {
                "topology": self.topology,
                "gpu": self.gpu,
                "input_len": self.input_len,
                "output_len": self.output_len,
                "decode_batch_per_rank": self.decode_batch,
            },
            "warnings": self.warnings,
        }


def _redundant_experts(spec: PrefillSpec | DecodeSpec) -> int:
    args = spec.extra_args
    for i, arg in enumerate(args):
        if arg == REDUNDANT_EXPERTS_FLAG and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith(REDUNDANT_EXPERTS_FLAG + "="):
            return int(arg.split("=", 1)[1])
    return 0


def role_layout(t: Topology, role: str, shape: ModelShape) -> Layout:
    """The roofline's view of a role: parallel sizes, all-to-all kind, overlaps."""
    spec = t.prefill if role == "prefill" else t.decode
    if spec.moe_a2a_backend == "none":
        a2a = "none"
    elif spec.deepep_mode == "auto":
        a2a = "normal" if role == "prefill" else "low_latency"
    else:
        a2a = spec.deepep_mode
    return Layout(
        tp=spec.tp,
        attn_dp=spec.attn_dp_size,
        ep=spec.ep if a2a != "none" else 1,
        gpus_per_node=t.hardware.gpus_per_node,
        physical_experts=shape.routed_experts + _redundant_experts(spec),
        a2a=a2a,
        tbo=spec.tbo.enabled,
        sbo=_effective_sbo(t) if role == "decode" else "off",
        dp_lm_head=spec.dp_lm_head,
        sbo_send_sms=sglang_send_sms(t)[0] if role == "decode" else 0,
    )


def _effective_sbo(t: Topology) -> str:
    # sglang overlaps the down GEMM with combine-send only with the DeepGEMM MoE runner
    # (SboFlags in batch_overlap/single_batch_overlap.py); otherwise only the shared-expert half runs.
    sbo = t.decode.sbo.value
    if sbo == "full" and t.decode.moe_runner_backend != "deep_gemm":
        return "shared-only"
    return sbo


def _phase(cost: Cost, tokens_per_s_per_gpu: float, latency_us: float, bound: str | None = None) -> PhaseEstimate:
    return PhaseEstimate(
        tokens_per_s_per_gpu=tokens_per_s_per_gpu,
        latency_ms=latency_us / 1e3,
        bound=bound or cost.bound,
        breakdown_ms={k: round(v / 1e3, 3) for k, v in sorted(cost.parts.items(), key=lambda kv: -kv[1])},
    )


def _decode_batch(t: Topology, asked: int | None) -> tuple[int, str]:
    d = t.decode
    if asked is not None:
        return asked, "--decode-batch"
    if d.max_running_requests:
        return math.ceil(d.max_running_requests / d.attn_dp_size), "decode.max_running_requests / attn_dp_size"
    if d.cuda_graph_max_bs:
        return d.cuda_graph_max_bs, "decode.cuda_graph_max_bs"
    raise EstimateError(
        "decode: no per-rank batch to estimate at; set decode.max_running_requests (or cuda_graph_max_bs) "
        "in the topology, or pass --decode-batch."
    )


def _prefill_tokens(spec: PrefillSpec) -> tuple[int, bool]:
    """Tokens of one prefill forward pass per attention rank (sglang splits the chunk over DP ranks)."""
    limits = []
    if spec.chunked_prefill_size and spec.chunked_prefill_size > 0:
        limits.append(spec.chunked_prefill_size // spec.attn_dp_size)
    if spec.max_prefill_tokens:
        limits.append(spec.max_prefill_tokens)
    return (min(limits), False) if limits else (DEFAULT_PREFILL_TOKENS, True)


def estimate_topology(
    t: Topology,
    input_len: int = DEFAULT_INPUT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    decode_batch: int | None = None,
) -> Estimate:
    """Predict prefill throughput and TTFT, decode ITL and throughput, the P:D ratio and the KV fit."""
    if input_len < 1 or output_len < 1:
        raise EstimateError(f"--input-len and --output-len must be >= 1 (got {input_len} and {output_len}).")
    hw = load_hardware()
    try:
        gpu = hw.gpu(t.hardware.gpu)
    except ValueError as exc:
        raise EstimateError(str(exc)) from exc
    cfg = t.load_model_config()
    if cfg is None:
        raise EstimateError(
            "model.config_json: the estimate needs the model's config.json for its shapes; "
            "set model.config_json (e.g. deepseek-v3-config.json)."
        )
    try:
        shape = ModelShape.from_config(cfg)
    except ValueError as exc:
        raise EstimateError(str(exc)) from exc
    kv_bytes = kv_bytes_per_element(t.model.kv_cache_dtype, cfg.get("torch_dtype"))
    model = Roofline(hw=hw, gpu=gpu, shape=shape, kv_bytes=kv_bytes)
    assumptions = [hw.assumption_texts[k] for k in hw.assumptions if k != "mem_fraction_static"]
    assumptions += [f"{gpu.key} {a}" for a in gpu.assumed]
    warnings: list[str] = []
    limit = t.model.context_length or cfg.get("max_position_embeddings")
    if limit and input_len + output_len > limit:
        warnings.append(
            f"input {input_len} + output {output_len} tokens exceed the model's context length {limit}; "
            "sglang would refuse or truncate such requests. Pass shorter --input-len/--output-len."
        )

    # Prefill: throughput with every attention rank busy, TTFT of one request alone.
    p_lay = role_layout(t, "prefill", shape)
    tokens, defaulted = _prefill_tokens(t.prefill)
    if defaulted:
        assumptions.append(
            f"prefill forward passes of {tokens} tokens per attention rank (sglang's chunked-prefill size)"
        )
    p_cost = model.prefill_pass(p_lay, tokens, p_lay.attn_dp, input_len)
    p_tps_gpu = tokens * p_lay.attn_dp / (p_cost.total / 1e6) / p_lay.tp
    kv_token_bytes = shape.layers * shape.kv_width * kv_bytes
    nic_bytes_per_s = gpu.nic_gbps * 1e9 * hw.assumptions["kv_transfer_efficiency"]
    # Each prefill GPU sends the KV of the requests its attention rank computed.
    kv_limit_tps_gpu = nic_bytes_per_s / kv_token_bytes
    p_bound = None
    if kv_limit_tps_gpu < p_tps_gpu:
        p_tps_gpu, p_bound = kv_limit_tps_gpu, KV_TRANSFER
    ttft_cost = model.prefill_pass(p_lay, input_len, 1, input_len)
    ttft_cost += Cost.of(KV_TRANSFER, input_len * kv_token_bytes / nic_bytes_per_s * 1e6)
    prefill = _phase(p_cost, p_tps_gpu, ttft_cost.total, p_bound)

    # Decode: one step of a full batch at the mean context of a request's life.
    d_lay = role_layout(t, "decode", shape)
    batch, batch_source = _decode_batch(t, decode_batch)
    d_context = input_len + output_len / 2
    d_cost = model.decode_step(d_lay, batch, d_context)
    d_tps_gpu = batch * d_lay.attn_dp / (d_cost.total / 1e6) / d_lay.tp
    decode = _phase(d_cost, d_tps_gpu, d_cost.total)
    plain = replace(d_lay, tbo=False, sbo="off")
    t_plain = model.decode_step(plain, batch, d_context).total
    sbo_applies = d_lay.a2a == "low_latency" and d_lay.attn_dp > 1
    sbo = "full" if d_lay.sbo == "off" else d_lay.sbo  # what SBO would save where it is off
    t_sbo = model.decode_step(replace(plain, sbo=sbo), batch, d_context).total
    sbo_saving = 1 - t_sbo / t_plain
    sbo_terms = None
    if sbo_applies:
        t_shared = model.decode_step(replace(plain, sbo="shared-only"), batch, d_context).total
        send_sms, send_source = sglang_send_sms(t)
        sbo_terms = SboTerms(
            mode=t.decode.sbo.value,
            runs=sbo,
            send_sms=send_sms,
            send_sms_source=send_source,
            shared_us_per_layer=(t_plain - t_shared) / shape.moe_layers,
            combine_us_per_layer=(t_shared - t_sbo) / shape.moe_layers,
            moe_layers=shape.moe_layers,
        )
    else:
        sbo_saving = 0.0
    tbo_saving = 1 - model.decode_step(replace(plain, tbo=True), batch, d_context).total / t_plain

    # P:D: prefill instances per decode group that keep both busy at these lengths.
    prefill_req_s = p_tps_gpu * t.prefill.tp / input_len
    decode_req_s = d_tps_gpu * t.decode.tp / output_len
    pd_ratio = decode_req_s / prefill_req_s

    mem_fraction = t.decode.mem_fraction_static or hw.assumptions["mem_fraction_static"]
    if t.decode.mem_fraction_static is None:
        assumptions.append(hw.assumption_texts["mem_fraction_static"])
    kv = kv_capacity(
        shape,
        d_lay,
        gpu_memory_gib=t.hardware.gpu_memory_gib,
        mem_fraction_static=mem_fraction,
        kv_bytes=kv_bytes,
        page_size=t.model.page_size,
        batch_per_rank=batch,
        sequence_len=input_len + output_len,
    )
    if not kv.fits:
        warnings.append(
            f"decode KV cache: a batch of {batch} per rank ({batch_source}) at {input_len}+{output_len} tokens "
            f"needs {kv.tokens_needed_per_gpu:,} tokens of KV per GPU, but only {kv.tokens_per_gpu:,} fit "
            f"({t.hardware.gpu_memory_gib:g} GiB x mem_fraction_static {mem_fraction:g} minus "
            f"{kv.weights_gib:.1f} GiB of weights, {int(kv.kv_bytes_per_token):,} B per token, "
            f"{t.model.page_size}-token pages): at most {kv.max_batch_per_rank} requests per rank fit. Lower the "
            "decode batch (decode.max_running_requests), use an fp8 KV cache, raise mem_fraction_static, "
            "or add decode GPUs."
        )
    return Estimate(
        topology=t.name,
        gpu=gpu.key,
        input_len=input_len,
        output_len=output_len,
        decode_batch=batch,
        prefill=prefill,
        decode=decode,
        sbo_saving=sbo_saving,
        sbo_applies=sbo_applies,
        sbo=sbo_terms,
        tbo_saving=tbo_saving,
        pd_ratio=pd_ratio,
        kv=kv,
        assumptions=assumptions,
        warnings=warnings,
    )
