"""The per-layer roofline of one forward pass, for prefill and for decode (docs/estimate.md).

Each operation costs the larger of its compute time and its memory time at measured kernel
efficiencies; communication costs its bytes over the measured DeepEP or NVLink bandwidth.
Operations that run concurrently (two-batch overlap, SBO's shared-expert half) cost the `max` of
the overlapped parts, not their sum, plus the share of the shorter part that measurements say
does not hide (`tbo_overlap`, `sbo_overlap` in hardware.yaml). SBO's other half, the down GEMM
against DeepEP's combine-send, has a model of its own (`SboCombine`): row-blocks released in
waves, a send capped by its SMs and the link, and a fixed cost. A `Cost` keeps, beside its total,
how much of it each resource accounts for on the critical path, so the estimate can say what
bounds a phase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from sglang_pd.deploy.estimate.hardware import GPUProfile, HardwareData
from sglang_pd.deploy.spec.model_shape import ModelShape
from sglang_pd.deploy.spec.sbo_sms import DownGemmTiles, down_gemm_block_n, expected_m

__all__ = ["BOUNDS", "Cost", "Layout", "Roofline", "SboCombine", "combine_link_gbps", "overlap", "shared_sms"]

# The resources a phase can be bound by (the estimate's "bound" names one).
WEIGHTS, KV, FLOPS, A2A, ALLREDUCE, KV_TRANSFER, OTHER = (
    "weights bandwidth",
    "KV bandwidth",
    "tensor FLOPs",
    "all-to-all",
    "all-reduce",
    "KV transfer",
    "small kernels",
)
BOUNDS = (WEIGHTS, KV, FLOPS, A2A, ALLREDUCE, KV_TRANSFER, OTHER)

# Hopper's wgmma has 64 rows: DeepGEMM's masked grouped GEMM (decode MoE) computes at least 64
# rows per active expert (DeepGEMM PR #183's motivation).
WGMMA_ROWS = 64
FP8_SCALE_GROUP = 128  # one float32 scale per 128 activations (DeepSeek-V3's FP8 recipe)


@dataclass(frozen=True)
class Cost:
    """Microseconds on the critical path, by resource."""

    parts: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of(resource: str, us: float) -> Cost:
        return Cost({resource: us}) if us > 0 else Cost()

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def __add__(self, other: Cost) -> Cost:
        parts = dict(self.parts)
        for k, v in other.parts.items():
            parts[k] = parts.get(k, 0.0) + v
        return Cost(parts)

    def __mul__(self, k: float) -> Cost:
        return Cost({r: v * k for r, v in self.parts.items()})

    __rmul__ = __mul__

    @property
    def bound(self) -> str:
        return max(self.parts.items(), key=lambda kv: kv[1])[0] if self.parts else OTHER


def overlap(a: Cost, b: Cost, hidden: float = 1.0) -> Cost:
    """Two concurrent parts: the longer one, plus what of the shorter one does not hide.

    `hidden` is the fraction of the shorter part that really runs in the shadow of the longer
    (1: a perfect overlap, the `max`; 0: none, the sum).
    """
    longer, shorter = (a, b) if a.total >= b.total else (b, a)
    return longer + shorter * (1 - hidden)


def shared_sms(compute: Cost, comm: Cost, stretch: float, hidden: float) -> Cost:
    """Compute overlapped with a communication kernel that holds some SMs.

    While the communication runs, compute progresses at 1/stretch of its speed (DeepEP normal
    kernels occupy a fixed number of SMs); after it ends, at full speed. Of the shorter of the
    two, the fraction `hidden` runs in the shadow of the longer.
    """
    if comm.total >= compute.total * stretch:
        slowed = compute * stretch
    else:
        slowed = compute + Cost.of(A2A, comm.total * (1 - 1 / stretch))
    return overlap(slowed, comm, hidden)


def ll_transfer_us(hw: HardwareData, gpu: GPUProfile, kind: str, ep: int, gpus_per_node: int, tokens: float) -> float:
    """The size-dependent part of one DeepEP low-latency dispatch or combine for `tokens` tokens per rank (DeepEP's
    shape, even load) on this GPU's link.

    DeepEP's time at 128 tokens for this EP size, its fixed part (`ll_latency_us`) left out, scaled by tokens and
    by the link: the NIC's speed against the measured 400 Gb/s across nodes, NVLink's within one node. Within a
    node NVLink must still carry the copies bound for the other GPUs, which DeepEP's RDMA table scaled to NVLink's
    speed can undercut at small EP sizes; that is the floor.
    """
    table = hw.ll_call_us(kind, ep)
    t = (table - min(hw.assumptions["ll_latency_us"], table)) * tokens / hw.ll_tokens
    if ep > gpus_per_node:
        return t * hw.ll_nic_gbit / gpu.nic_gbit
    nvlink_gbps = gpu.nvlink_gbps * hw.efficiency["nvlink"]
    t *= hw.ll_nic_gbit / 8 / nvlink_gbps
    h = hw.ll_hidden
    token_bytes = h + h / FP8_SCALE_GROUP * 4 if kind == "dispatch" else 2.0 * h
    return max(t, tokens * hw.ll_topk * token_bytes * (ep - 1) / ep / (nvlink_gbps * 1e3))


def combine_link_gbps(hw: HardwareData, gpu: GPUProfile, ep: int, gpus_per_node: int) -> float:
    """GB/s at which DeepEP's low-latency combine moves a GPU's rows (bf16 rows of `ll_hidden`, `ll_topk` copies a
    token) over this GPU's link, its fixed part left out."""
    transfer_us = ll_transfer_us(hw, gpu, "combine", ep, gpus_per_node, hw.ll_tokens)
    return hw.ll_tokens * hw.ll_topk * 2 * hw.ll_hidden / transfer_us / 1e3


@dataclass(frozen=True)
class SboCombine:
    """The down GEMM and DeepEP's combine under full SBO, against running them one after the other.

    The GEMM runs on the SMs the send leaves, in `waves` rounds of tiles (a round more than on the whole GPU
    stretches it by that round). Each round releases its share of the row-blocks, which the send can start on
    once released; it moves them at `send_gbps`, the lesser of its SMs' rate and the link's. The last row-block
    leaves at `send_end_us`; then the combine's fixed part and SBO's own `fixed_us` follow.
    """

    send_sms: int
    waves: int
    whole_gpu_waves: int
    gemm_us: float  # the down GEMM on the SMs the send leaves
    send_gbps: float
    send_end_us: float  # from the GEMM's start to the last byte sent
    fixed_us: float
    serial_us: float  # the down GEMM on every SM, then the combine's transfer

    @property
    def overlapped_us(self) -> float:
        return self.send_end_us + self.fixed_us

    @property
    def gain_us(self) -> float:
        """Per MoE layer; negative: the overlap costs time."""
        return self.serial_us - self.overlapped_us


def sbo_combine(
    down_us: float, combine_bytes: float, link_gbps: float, send_sms: int, sms: int, tiles: DownGemmTiles,
    per_sm_gbps: float, fixed_us: float,
) -> SboCombine:  # fmt: skip
    """The wave-and-send-rate model of SBO's down-GEMM/combine half (docs/estimate.md)."""
    if not 0 < send_sms < sms:
        raise ValueError(f"SBO's combine-send needs 1 to {sms - 1} SMs of {sms}, got {send_sms}")
    whole = tiles.waves(sms)
    waves = tiles.waves(max(1, sms - send_sms))
    gemm = down_us * waves / whole
    rate = min(send_sms * per_sm_gbps, link_gbps) * 1e3  # bytes per µs
    # Wave k releases its share at k x gemm / waves; the send is done when the latest-bound share is.
    send_end = max(k * gemm / waves + (waves - k + 1) * combine_bytes / waves / rate for k in range(1, waves + 1))
    return SboCombine(
        send_sms=send_sms,
        waves=waves,
        whole_gpu_waves=whole,
        gemm_us=gemm,
        send_gbps=rate / 1e3,
        send_end_us=send_end,
        fixed_us=fixed_us,
        serial_us=down_us + combine_bytes / (link_gbps * 1e3),
    )


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout, as the roofline needs it."""

    tp: int
    attn_dp: int
    ep: int
    gpus_per_node: int
    physical_experts: int
    a2a: str  # "none", "normal" or "low_latency"
    tbo: bool = False
    sbo: str = "off"  # "off", "full", "shared-only"
    dp_lm_head: bool = False
    sbo_send_sms: int = 0  # combine-send SMs under full SBO (decode.sbo_send_sms or its default)

    @property
    def attn_tp(self) -> int:
        return self.tp // self.attn_dp

    @property
    def experts_per_gpu(self) -> float:
        return self.physical_experts / self.ep

    @property
    def dense_tp(self) -> int:
        # DP attention pairs with data-parallel dense layers (sglang --moe-dense-tp-size 1).
        return 1 if self.attn_dp > 1 else self.tp

    @property
    def lm_head_tp(self) -> int:
        # sglang shards the LM head over the vocabulary unless --enable-dp-lm-head replicates it.
        return 1 if self.dp_lm_head else self.tp


@dataclass(frozen=True)
class Roofline:
    """Costs of the model's operations on one GPU type."""

    hw: HardwareData
    gpu: GPUProfile
    shape: ModelShape
    kv_bytes: float

    # --- rates (per µs) -----------------------------------------------------------------------
    def _eff(self, name: str) -> float:
        return self.hw.efficiency[name]

    def _assume(self, name: str) -> float:
        return self.hw.assumptions[name]

    @property
    def _copy_bytes_per_us(self) -> float:
        return self.gpu.hbm_gbps * 1e3 * self._eff("hbm_copy")

    @property
    def _stream_bytes_per_us(self) -> float:
        return self._copy_bytes_per_us * self._eff("moe_gemm_bandwidth")

    @property
    def _nvlink_bytes_per_us(self) -> float:
        return self.gpu.nvlink_gbps * 1e3 * self._eff("nvlink")

    def gemm(self, flops: float, weight_bytes: float, dtype: str = "fp8") -> Cost:
        """A weight GEMM: tensor-core time or weight-streaming time, whichever is longer."""
        peak = self.gpu.fp8_tflops if dtype == "fp8" else self.gpu.bf16_tflops
        t_flops = flops / (peak * 1e6 * self._eff(f"{dtype}_gemm"))
        t_bytes = weight_bytes / self._stream_bytes_per_us
        return Cost.of(FLOPS, t_flops) if t_flops >= t_bytes else Cost.of(WEIGHTS, t_bytes)

    @property
    def _wdtype(self) -> str:
        return "fp8" if self.shape.weight_bytes == 1 else "bf16"

    # --- attention ----------------------------------------------------------------------------
    def attention(self, lay: Layout, tokens: float, context: float, decode: bool) -> Cost:
        """MLA on one attention rank: projections, the attention itself, the TP collective, small kernels.

        Decode runs the absorbed form (queries against the 576-wide latent, FlashMLA); prefill
        the expanded form (192-wide keys, 128-wide values, causal). `context` is the mean number
        of keys a query attends to.
        """
        s = self.shape
        replicated, sharded = s.attention_params(lay.attn_tp)
        params = replicated + sharded
        cost = self.gemm(2 * tokens * params, params * s.weight_bytes, self._wdtype)
        heads = s.heads / lay.attn_tp
        if decode:
            flops = 2 * tokens * heads * context * (s.kv_width + s.kv_lora_rank)
            kv_bytes = tokens * context * s.kv_width * self.kv_bytes
            t_flops = flops / (self.gpu.bf16_tflops * 1e6 * self._eff("mla_decode_compute"))
            t_bytes = kv_bytes / (self.gpu.hbm_gbps * 1e3 * self._eff("mla_decode_bandwidth"))
            cost += Cost.of(FLOPS, t_flops) if t_flops >= t_bytes else Cost.of(KV, t_bytes)
        else:
            flops = 2 * tokens * heads * context * (s.qk_nope_dim + s.qk_rope_dim + s.v_head_dim)
            cost += Cost.of(FLOPS, flops / (self.gpu.bf16_tflops * 1e6 * self._eff("attention_prefill")))
        if lay.attn_tp > 1:
            # Reduce-scatter after o_proj plus all-gather before the next layer: an all-reduce's bytes.
            volume = 2 * (lay.attn_tp - 1) / lay.attn_tp * tokens * s.hidden * 2
            cost += Cost.of(ALLREDUCE, volume / self._nvlink_bytes_per_us)
        return cost + self.small_kernels(tokens)

    def small_kernels(self, tokens: float) -> Cost:
        moved = tokens * self._assume("elementwise_kib_per_token") * 1024
        return Cost.of(OTHER, moved / self._copy_bytes_per_us + self._assume("kernel_gap_us"))

    # --- MLPs ---------------------------------------------------------------------------------
    def dense_mlp(self, lay: Layout, tokens: float) -> Cost:
        params = self.shape.dense_mlp_params / lay.dense_tp
        return self.gemm(2 * tokens * params, params * self.shape.weight_bytes, self._wdtype)

    def shared_expert(self, lay: Layout, tokens: float) -> Cost:
        params: float = self.shape.shared_experts * self.shape.expert_params
        if lay.a2a == "none":
            params /= lay.tp
        return self.gemm(2 * tokens * params, params * self.shape.weight_bytes, self._wdtype)

    def routed_experts(self, lay: Layout, tokens_total: float, masked: bool) -> tuple[Cost, Cost]:
        """(gate+up, down) GEMMs of the routed experts on the most loaded GPU.

        `tokens_total` is the number of tokens entering the MoE layer across the EP group. The
        hottest GPU carries `expert_imbalance` times the mean; an active expert with fewer rows
        than wgmma's 64 still costs 64 in the masked (decode) layout.
        """
        s = self.shape
        slice_ = 1 / lay.tp if lay.a2a == "none" else 1.0
        active, pairs = self._expert_load(lay, tokens_total)
        flops_rows = active * max(pairs / active, WGMMA_ROWS) if masked else pairs
        gate_up_params = 2 * s.hidden * s.moe_intermediate * slice_
        down_params = s.hidden * s.moe_intermediate * slice_
        gate_up = self.gemm(2 * flops_rows * gate_up_params, active * gate_up_params * s.weight_bytes)
        down = self.gemm(2 * flops_rows * down_params, active * down_params * s.weight_bytes)
        return gate_up, down

    def _expert_load(self, lay: Layout, tokens_total: float) -> tuple[float, float]:
        """(active experts, expert-token pairs) on the most loaded GPU."""
        s = self.shape
        if lay.a2a == "none":
            # Tensor-parallel MoE: every GPU holds a 1/tp slice of every expert.
            experts, pairs = float(s.routed_experts), tokens_total * s.topk
        else:
            experts = lay.experts_per_gpu
            pairs = tokens_total * s.topk / lay.ep * self._assume("expert_imbalance")
        # Experts that got no token this step are not read (Poisson arrivals).
        return experts * -math.expm1(-pairs / experts), pairs

    def lm_head(self, lay: Layout, tokens: float) -> Cost:
        params = self.shape.lm_head_params / lay.lm_head_tp
        return self.gemm(2 * tokens * params, params * 2, "bf16")

    # --- all-to-all ---------------------------------------------------------------------------
    def _token_bytes(self) -> tuple[float, float]:
        """Bytes of one token copy: FP8 with its scales on dispatch, bf16 on combine."""
        h = self.shape.hidden
        return h + h / FP8_SCALE_GROUP * 4, 2.0 * h

    def low_latency(self, lay: Layout, kind: str, tokens_per_rank: float) -> tuple[Cost, Cost]:
        """(fixed, transfer) parts of one DeepEP low-latency dispatch or combine call.

        DeepEP's measured time at 128 tokens for this EP size, its size-independent part
        (`ll_latency_us`) kept, the rest on this GPU's link (`ll_transfer_us`) scaled by the
        hottest rank's load.
        """
        t_table = self.hw.ll_call_us(kind, lay.ep)
        t0 = min(self._assume("ll_latency_us"), t_table)
        link = ll_transfer_us(self.hw, self.gpu, kind, lay.ep, lay.gpus_per_node, tokens_per_rank)
        transfer = link * self._assume("expert_imbalance")
        return Cost.of(A2A, t0), Cost.of(A2A, transfer)

    def normal(self, lay: Layout, tokens_per_gpu: float) -> tuple[Cost, Cost]:
        """(dispatch, combine) of DeepEP's normal kernels for `tokens_per_gpu` tokens sent by one GPU.

        Across nodes a token crosses the NIC once per remote node holding one of its experts
        (node-limited routing: `topk_group` of `n_group` groups), at DeepEP's measured RDMA
        bandwidth for this EP size; within a node once per other GPU, over NVLink.
        """
        s = self.shape
        disp, comb = self._token_bytes()
        imb = self._assume("expert_imbalance")
        if lay.ep > lay.gpus_per_node:
            nodes = lay.ep / lay.gpus_per_node
            groups_per_node = s.n_group / nodes
            if groups_per_node >= 1 and float(groups_per_node).is_integer() and s.topk_group <= s.n_group:
                miss = math.comb(s.n_group - int(groups_per_node), s.topk_group) / math.comb(s.n_group, s.topk_group)
            else:
                miss = (1 - 1 / nodes) ** s.topk
            copies = (nodes - 1) * (1 - miss)
            rate = self.hw.normal_rdma(lay.ep) * 1e3 * self.gpu.nic_gbit / self.hw.normal_nic_gbit
        else:
            copies = (lay.ep - 1) * (1 - (1 - 1 / lay.ep) ** s.topk)
            rate = self._nvlink_bytes_per_us
        per_byte = tokens_per_gpu * copies * imb / rate
        return Cost.of(A2A, disp * per_byte), Cost.of(A2A, comb * per_byte)

    def tp_moe_allreduce(self, lay: Layout, tokens: float) -> Cost:
        volume = 2 * (lay.tp - 1) / lay.tp * tokens * self.shape.hidden * 2
        return Cost.of(ALLREDUCE, volume / self._nvlink_bytes_per_us)

    # --- one forward pass ---------------------------------------------------------------------
    def decode_step(self, lay: Layout, batch: float, context: float) -> Cost:
        """One decode step on one attention rank holding `batch` requests of `context` tokens."""
        s = self.shape
        if lay.tbo:
            half = replace(lay, tbo=False, sbo="off")
            return self._decode_tbo(half, batch / 2, context)
        total = Cost()
        for _ in range(s.dense_layers):
            total += self.attention(lay, batch, context, decode=True) + self.dense_mlp(lay, batch)
        total += s.moe_layers * self._decode_moe_layer(lay, batch, context)
        return total + self.lm_head(lay, batch) + self.small_kernels(batch)

    def _decode_moe_layer(self, lay: Layout, batch: float, context: float) -> Cost:
        attn = self.attention(lay, batch, context, decode=True)
        shared = self.shared_expert(lay, batch / lay.attn_tp)
        gate_up, down = self.routed_experts(lay, batch * lay.attn_dp, masked=True)
        if lay.a2a == "none":
            return attn + shared + gate_up + down + self.tp_moe_allreduce(lay, batch)
        tokens = batch / lay.attn_tp
        d0, d = self.low_latency(lay, "dispatch", tokens)
        c0, c = self.low_latency(lay, "combine", tokens)
        if lay.a2a != "low_latency":
            return attn + d0 + d + shared + gate_up + down + c0 + c
        # The shared expert runs while the dispatch is in flight, whatever the SBO mode: without SBO and
        # with full SBO as rendered, on the alternate stream from before the dispatch (sglang's
        # `DeepseekV2MoE.forward_deepep`; sglang_patches/shared_stream.py); with shared-only SBO, on the
        # compute stream between dispatch-send and -receive. The dispatch's send and receive copies keep SMs
        # busy and stay on the critical path. SBO's gain is therefore the down-GEMM/combine half alone.
        dispatch = d0 + d
        sm_part = dispatch * self.hw.ll_sm_fraction
        hidden = self._eff("sbo_overlap")
        layer = attn + sm_part + overlap(dispatch * (1 - self.hw.ll_sm_fraction), shared, hidden) + gate_up
        if lay.sbo == "full":
            # The down GEMM signals finished row blocks; combine-send, on SMs of its own, ships
            # them while the GEMM runs. The combine's fixed part follows the last block.
            m = self.sbo_combine(lay, down, c, batch * lay.attn_dp)
            return (
                layer
                + down * (m.gemm_us / down.total)
                + Cost.of(A2A, m.send_end_us - m.gemm_us)
                + c0
                + Cost.of(OTHER, m.fixed_us)
            )
        return layer + down + c0 + c

    def sbo_combine(self, lay: Layout, down: Cost, transfer: Cost, tokens_total: float) -> SboCombine:
        """SBO's down-GEMM/combine half on the most loaded GPU, `tokens_total` tokens entering the layer across
        the EP group: `transfer` is the combine's size-dependent part (`low_latency`)."""
        s = self.shape
        active, pairs = self._expert_load(lay, tokens_total)
        m = expected_m(max(1, round(tokens_total / lay.ep)), lay.ep, s.topk, lay.physical_experts)
        tiles = DownGemmTiles(
            experts=max(1, math.ceil(active - 1e-9)), rows=math.ceil(pairs / active), hidden=s.hidden,
            block_n=down_gemm_block_n(self.gpu.key, m),
        )  # fmt: skip
        combine_bytes = pairs * self._token_bytes()[1]
        return sbo_combine(
            down.total, combine_bytes, combine_bytes / transfer.total / 1e3, lay.sbo_send_sms, self.gpu.sms, tiles,
            self.hw.sbo_send_gbps_per_sm, self.hw.sbo_fixed_us,
        )  # fmt: skip

    def _decode_tbo(self, half: Layout, batch: float, context: float) -> Cost:
        """Two micro-batches: one's communication in flight while the other computes."""
        s = self.shape
        total = Cost()
        for _ in range(s.dense_layers):
            total += 2 * (self.attention(half, batch, context, decode=True) + self.dense_mlp(half, batch))
        attn = self.attention(half, batch, context, decode=True)
        shared = self.shared_expert(half, batch / half.attn_tp)
        gate_up, down = self.routed_experts(half, batch * half.attn_dp, masked=True)
        compute = 2 * (attn + shared + gate_up + down)
        tokens = batch / half.attn_tp
        d0, d = self.low_latency(half, "dispatch", tokens)
        c0, c = self.low_latency(half, "combine", tokens)
        comm = 2 * (d0 + d + c0 + c)
        # Sending and receiving keep SMs busy; only the in-flight part hides behind compute.
        sm_part = comm * self.hw.ll_sm_fraction
        layer = sm_part + overlap(compute, comm * (1 - self.hw.ll_sm_fraction), self._eff("tbo_overlap"))
        total += s.moe_layers * layer
        return total + 2 * (self.lm_head(half, batch) + self.small_kernels(batch))

    def prefill_pass(self, lay: Layout, tokens: float, ranks: int, prompt: int) -> Cost:
        """One prefill forward pass: `tokens` per attention rank, from prompts of `prompt` tokens,
        on `ranks` busy attention ranks. A causal query attends to (prompt + 1) / 2 keys on average;
        the LM head runs on each prompt's last token only."""
        s = self.shape
        context = (prompt + 1) / 2
        if lay.tbo:
            half = replace(lay, tbo=False)
            return self._prefill_tbo(half, tokens / 2, ranks, context, tokens / 2 / prompt)
        total = Cost()
        for _ in range(s.dense_layers):
            total += self.attention(lay, tokens, context, decode=False) + self.dense_mlp(lay, tokens)
        attn = self.attention(lay, tokens, context, decode=False)
        mlp = self._prefill_experts(lay, tokens, ranks)
        if lay.a2a == "none":
            layer = attn + mlp + self.tp_moe_allreduce(lay, tokens)
        else:
            disp, comb = self.normal(lay, tokens / lay.attn_tp)
            layer = attn + disp + mlp + comb
        total += s.moe_layers * layer
        return total + self.lm_head(lay, tokens / prompt)

    def _prefill_experts(self, lay: Layout, tokens: float, ranks: int) -> Cost:
        gate_up, down = self.routed_experts(lay, tokens * ranks, masked=False)
        return self.shared_expert(lay, tokens / lay.attn_tp) + gate_up + down

    def _prefill_tbo(self, half: Layout, tokens: float, ranks: int, context: float, requests: float) -> Cost:
        """Two micro-batches, DeepSeek's prefill overlap: each stage pairs one micro-batch's
        computation with the other's dispatch or combine (attention | dispatch, experts |
        dispatch, experts | combine, attention | combine); DeepEP's SMs slow the computation."""
        s = self.shape
        total = Cost()
        for _ in range(s.dense_layers):
            total += 2 * (self.attention(half, tokens, context, decode=False) + self.dense_mlp(half, tokens))
        attn = self.attention(half, tokens, context, decode=False)
        mlp = self._prefill_experts(half, tokens, ranks)
        if half.a2a == "none":
            layer = 2 * (attn + mlp + self.tp_moe_allreduce(half, tokens))
        else:
            disp, comb = self.normal(half, tokens / half.attn_tp)
            stretch = self.gpu.sms / (self.gpu.sms - self.hw.normal_sms)
            hidden = self._eff("tbo_overlap")
            layer = (
                shared_sms(attn, disp, stretch, hidden)
                + shared_sms(mlp, disp, stretch, hidden)
                + shared_sms(mlp, comb, stretch, hidden)
                + shared_sms(attn, comb, stretch, hidden)
            )
        total += s.moe_layers * layer
        return total + 2 * self.lm_head(half, requests)
