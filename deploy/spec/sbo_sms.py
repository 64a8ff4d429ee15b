"""SBO's combine-send SM count (`decode.sbo_send_sms`): its default per GPU type, and the rule that neither the
send nor the down GEMM starves.

With full SBO on Hopper, sglang splits the GPU between two kernels that run at once: DeepEP's low-latency combine
sends each row-block of the down GEMM's output as soon as the GEMM signals it, on
`SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS` SMs, and the down GEMM gets the rest (`compute_overlap_args`,
srt/batch_overlap/single_batch_overlap.py:81-144 in sglang 0.5.23 and 0.5.17). Without the variable sglang gives
the send 3 SMs on Hopper and 32 on Blackwell (lines 96-99; environ.py declares `EnvInt(32)`, but the code reads the
variable only when it is set). Too few send SMs and the send trails the link, so the last row-blocks leave long
after the GEMM; too many and the GEMM runs more waves of tiles. The rule below says where both hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang_pd.deploy.common.contract import SBOMode
from sglang_pd.sglang_patches.status import COMBINE_SEND_SMS_ENV, SM90_DEFAULT_SEND_SMS

if TYPE_CHECKING:
    from sglang_pd.deploy.spec.topology import Topology

__all__ = [
    "BLACKWELL_DEFAULT_SEND_SMS",
    "COMBINE_SEND_SMS_ENV",
    "DEFAULT_SEND_SMS",
    "EXTRA_WAVES",
    "ROW_BLOCK",
    "SM90_DEFAULT_SEND_SMS",
    "DownGemmTiles",
    "SendSMRange",
    "down_gemm_block_n",
    "down_gemm_tiles",
    "expected_m",
    "rendered_send_sms",
    "send_sms",
    "send_sms_problems",
    "send_sms_range",
]

#: sglang's send SMs on Blackwell without the variable (single_batch_overlap.py:99).
BLACKWELL_DEFAULT_SEND_SMS = 32

#: Combine-send SMs where `decode.sbo_send_sms` is unset, by GPU type: the one table of defaults. Each value must
#: lie in the range `SendSMRange` derives for the shipped preset of that GPU (tests/deploy/estimate holds it).
DEFAULT_SEND_SMS: dict[str, int] = {
    # Measured on one H100 (benchmarks/bench_moe_layer.py --gpus 1 --mode decode --num-experts 16 --tokens
    # 8,64,128,256 --combine-sms 3,8,16,24 --max-block-n 256, CUDA graphs, DeepEP antgroup-opt; outputs bit-equal
    # in every cell): time full SBO saved over no overlap at 8/64/128/256 tokens per rank was -4.5/-14.9/-24.7/
    # -43.1 % with 3 send SMs, -0.8/-1.6/-5.7/-9.8 % with 8, -0.6/+0.5/-0.1/+1.0 % with 16 and -1.2/-0.7/+0.8/
    # +1.3 % with 24. 16 is the fewest that never lost more than 1 %.
    "H100": 16,
    # The H100's 132 SMs and the same kernels, so the H100's figure until an H200 sweep of the same command
    # measures it (that sweep may move this value). The rule allows 5-20 for the H200 preset (EP16 over two
    # nodes, 128 requests per rank).
    "H200": 16,
    # Not measured on an H20: argued from the rule for the H20 preset (EP16 over two nodes, 32 requests per rank).
    # The combine leaves a GPU at 84 GB/s, which needs 5 send SMs at 20 GB/s each; the down GEMM has 720 tiles
    # (16 experts x 1 row-block x 45 column blocks of 160), 10 waves on all 78 SMs and still 10 on the 72 that 6
    # send SMs leave. The rule tolerates one wave more (up to 12 send SMs), but the H20's GEMM is bound by its
    # tensor cores, not HBM, so a wave there is a wave of time: 6 is the most that costs it none.
    "H20": 6,
}

#: Rows of one signalled row-block: sglang sizes the sm_90 signal by 64-row blocks (`MIN_BLOCK_M`,
#: single_batch_overlap.py:123) and DeepGEMM's masked GEMM computes at least 64 rows (wgmma).
ROW_BLOCK = 64
#: The widest column block sglang lets DeepGEMM take for the signalled down GEMM (`max_block_n`,
#: srt/layers/moe/moe_runner/deep_gemm.py:884-886): 256, or 160 on an H20 (SGLANG_DEEPGEMM_ON_H20, which the
#: renderer sets there) while `expected_m` <= 64. The kernel may pick a narrower block, which only adds tiles.
WIDE_BLOCK_N, H20_BLOCK_N, H20_NARROW_UP_TO_M = 256, 160, 64


def send_sms(t: Topology) -> tuple[int | None, str]:
    """The combine-send SMs the topology asks for, and where the figure comes from; None where sglang-pd has no
    default for the GPU type (sglang then uses its own)."""
    d = t.decode
    if d.sbo_send_sms is not None:
        return d.sbo_send_sms, "decode.sbo_send_sms"
    gpu = t.hardware.gpu.upper()
    if gpu in DEFAULT_SEND_SMS:
        return DEFAULT_SEND_SMS[gpu], f"the default for {gpu}"
    return None, f"no sglang-pd default for {t.hardware.gpu}"


def sglang_send_sms(t: Topology) -> tuple[int, str]:
    """The send SMs sglang will run: the topology's, else sglang's own default for the GPU's architecture."""
    sms, source = send_sms(t)
    if sms is not None:
        return sms, source
    cap = t.hardware.capability()
    if cap is not None and cap[0] >= 10:
        return BLACKWELL_DEFAULT_SEND_SMS, "sglang's default on Blackwell"
    return SM90_DEFAULT_SEND_SMS, "sglang's default on Hopper"


def rendered_send_sms(t: Topology) -> int | None:
    """What the renderer exports as COMBINE_SEND_SMS_ENV: the topology's send SMs, with full SBO only (sglang reads
    the variable only for the down-GEMM overlap)."""
    return send_sms(t)[0] if t.decode.sbo is SBOMode.FULL else None


def expected_m(tokens_per_rank: int, ranks: int, topk: int, experts: int) -> int:
    """The rows per expert sglang plans the masked GEMM for: `(tokens x ranks x topk + experts) // experts`
    (srt/layers/moe/token_dispatcher/deepep.py:768-771)."""
    return (tokens_per_rank * ranks * topk + experts) // experts


def down_gemm_block_n(gpu: str, m: int) -> int:
    """The down GEMM's column block for a GPU type at `expected_m` = m (see WIDE_BLOCK_N)."""
    return H20_BLOCK_N if gpu.upper() == "H20" and m <= H20_NARROW_UP_TO_M else WIDE_BLOCK_N


@dataclass(frozen=True)
class DownGemmTiles:
    """The down GEMM's output tiles on one rank: experts x row-blocks x column blocks."""

    experts: int
    rows: int  # per expert
    hidden: int  # the GEMM's N
    block_n: int

    @property
    def row_blocks(self) -> int:
        """Row-blocks per expert (at least one: sglang signals every expert's first block)."""
        return max(1, math.ceil(self.rows / ROW_BLOCK))

    @property
    def col_blocks(self) -> int:
        return math.ceil(self.hidden / self.block_n)

    @property
    def tiles(self) -> int:
        return self.experts * self.row_blocks * self.col_blocks

    def waves(self, programs: int) -> int:
        """Rounds of tiles a persistent GEMM on `programs` SMs runs."""
        return math.ceil(self.tiles / programs)

    def describe(self) -> str:
        return (
            f"{self.experts} experts x {self.row_blocks} row-block{'s' if self.row_blocks > 1 else ''} of "
            f"{ROW_BLOCK} x {self.col_blocks} column blocks of {self.block_n} = {self.tiles} tiles"
        )


def down_gemm_tiles(gpu: str, tokens_per_rank: int, ranks: int, topk: int, experts: int, hidden: int) -> DownGemmTiles:
    """The down GEMM's tiles at sglang's `expected_m` for this batch (every expert at the mean)."""
    m = expected_m(tokens_per_rank, ranks, topk, experts)
    return DownGemmTiles(experts=experts // ranks, rows=m, hidden=hidden, block_n=down_gemm_block_n(gpu, m))


#: Waves the down GEMM may run beyond its count on the whole GPU before the rule calls it starved. On one H100
#: (the sweep behind DEFAULT_SEND_SMS) 24 send SMs cost the kernel's tiles one wave at 128 and at 256 tokens per
#: rank (448 tiles in 5 waves on 108 SMs against 4 on 132; 608 in 6 against 5; the tiles as the H200 run in
#: benchmarks/results/sbo_one_rank_h200_2026-12-03_5fb0e4d.json reports them, block_m 64 then 128, 28 then 38
#: column blocks) and full SBO still gained 0.8 and 1.3 %: that GEMM streams weights, and a round more of tiles is
#: not a round more of HBM time. Two rounds more were not measured.
EXTRA_WAVES = 1


@dataclass(frozen=True)
class SendSMRange:
    """Which send-SM counts keep both sides fed, written with its numbers.

    The send keeps pace with the link: send SMs x `per_sm_gbps` >= `link_gbps`, the rate at which DeepEP's combine
    leaves a GPU over the NIC or NVLink (no floor on one rank, whose combine is a copy inside the GPU). The GEMM keeps
    its workers: it runs `whole_waves` rounds of tiles on the whole GPU and may run `EXTRA_WAVES` more; a count that
    leaves it fewer SMs than `tiles_per_wave`, the tiles a round then holds, makes it run more than that.
    """

    gpu: str
    sms: int
    per_sm_gbps: float
    link_gbps: float | None
    link: str  # how the combine leaves the GPU, e.g. "the NIC (EP16 over 2 nodes)"
    batch: int  # requests per rank the tiles are counted at
    tiles: DownGemmTiles

    @property
    def fewest(self) -> int:
        """The fewest send SMs that keep pace with the link."""
        if self.link_gbps is None:
            return 1
        return max(1, math.ceil(self.link_gbps / self.per_sm_gbps - 1e-9))

    @property
    def whole_waves(self) -> int:
        return self.tiles.waves(self.sms)

    @property
    def tiles_per_wave(self) -> int:
        """The fewest SMs that run the tiles in `whole_waves + EXTRA_WAVES` rounds."""
        return math.ceil(self.tiles.tiles / (self.whole_waves + EXTRA_WAVES))

    @property
    def most(self) -> int:
        """The most send SMs that leave the GEMM a round's tiles."""
        return self.sms - self.tiles_per_wave

    def problems(self, send: int, source: str) -> list[str]:
        """Errors for `send` send SMs, each naming both sides' numbers and the fix."""
        key = f"decode.sbo_send_sms: {send} combine-send SMs ({source})"
        if self.fewest > self.most:
            return [
                f"{key}: no count serves this decode on {self.gpu}: keeping pace with the {self.link_gbps:.0f} GB/s "
                f"the combine leaves it at over {self.link} takes {self.fewest} send SMs at {self.per_sm_gbps:g} "
                f"GB/s each, and the down GEMM's {self.tiles_per_wave} tiles per wave (at {self.batch} requests per "
                f"rank: {self.tiles.describe()}) leave at most {self.most}. Set decode.sbo: shared-only, or lower the "
                "per-rank decode batch."
            ]
        fix = (
            f"Set decode.sbo_send_sms: {self.fewest}."
            if self.fewest == self.most
            else f"Set decode.sbo_send_sms between {self.fewest} and {self.most}."
        )
        if send >= self.sms:
            return [f"{key} would leave the down GEMM none of the {self.gpu}'s {self.sms} SMs. {fix}"]
        if send < self.fewest:
            assert self.link_gbps is not None  # fewest is 1 without a link
            return [
                f"{key} send {send * self.per_sm_gbps:g} GB/s ({send} x {self.per_sm_gbps:g} GB/s a SM), below the "
                f"{self.link_gbps:.0f} GB/s at which DeepEP's low-latency combine leaves {self.gpu} over {self.link}: "
                f"the send trails the link, and the last row-blocks leave long after the down GEMM ends. {fix}"
            ]
        if self.sms - send < self.tiles_per_wave:
            allowed = self.whole_waves + EXTRA_WAVES
            return [
                f"{key} leave the down GEMM {self.sms - send} of the {self.gpu}'s {self.sms} SMs, fewer than the "
                f"{self.tiles_per_wave} tiles per wave that keep it to {allowed} waves, one more than on the whole GPU "
                f"(at {self.batch} requests per rank: {self.tiles.describe()}, {self.whole_waves} waves on "
                f"{self.sms} SMs, {self.tiles.waves(self.sms - send)} on {self.sms - send}). {fix}"
            ]
        return []


def _rule_batch(t: Topology) -> int:
    """Requests per decode rank the GEMM is judged at: the full batch, else the largest a CUDA graph or DeepEP's
    dispatch buffer holds."""
    d = t.decode
    if d.max_running_requests:
        return math.ceil(d.max_running_requests / d.attn_dp_size)
    return d.cuda_graph_max_bs or d.dispatch_token_budget


def send_sms_range(t: Topology, cfg: dict[str, Any]) -> SendSMRange | None:
    """The range for a full-SBO sm_90 decode on DeepEP low-latency, or None where no GPU profile gives its figures
    (deploy/estimate/hardware.yaml) or the model's config.json lacks a field."""
    # The estimate's modules import the topology module, so they are imported here, when a rule runs.
    from sglang_pd.deploy.estimate.hardware import load_hardware
    from sglang_pd.deploy.estimate.roofline import combine_link_gbps

    hw = load_hardware()
    gpu = hw.gpus.get(t.hardware.gpu.upper())
    d = t.decode
    try:
        hidden, topk = int(cfg["hidden_size"]), int(cfg["num_experts_per_tok"])
        experts = int(cfg.get("n_routed_experts") or cfg["num_experts"]) + _redundant_experts(d.extra_args)
    except (KeyError, TypeError, ValueError):
        return None
    if gpu is None or d.ep < 1 or experts % d.ep:
        return None
    batch = _rule_batch(t)
    gpn = t.hardware.gpus_per_node
    if d.ep == 1:
        link_gbps, link = None, "no link (one rank: the combine copies inside the GPU)"
    else:
        link_gbps = combine_link_gbps(hw, gpu, d.ep, gpn)
        nodes = math.ceil(d.ep / gpn)
        link = f"the NIC (EP{d.ep} over {nodes} nodes)" if d.ep > gpn else f"NVLink (EP{d.ep} in one node)"
    return SendSMRange(
        gpu=gpu.key,
        sms=gpu.sms,
        per_sm_gbps=hw.sbo_send_gbps_per_sm,
        link_gbps=link_gbps,
        link=link,
        batch=batch,
        tiles=down_gemm_tiles(gpu.key, batch, d.ep, topk, experts, hidden),
    )


def _redundant_experts(extra_args: list[str]) -> int:
    """sglang's `--ep-num-redundant-experts` from extra_args: extra physical experts on the EP ranks."""
    flag = "--ep-num-redundant-experts"
    for i, arg in enumerate(extra_args):
        if arg == flag and i + 1 < len(extra_args) and extra_args[i + 1].isdigit():
            return int(extra_args[i + 1])
        if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
            return int(arg.split("=", 1)[1])
    return 0


def send_sms_problems(t: Topology, cfg: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of `decode.sbo_send_sms` for a topology the other cross-role rules accept."""
    d = t.decode
    if d.sbo is not SBOMode.FULL:
        if d.sbo_send_sms is not None:
            return [], [
                f"decode.sbo_send_sms: {d.sbo_send_sms} is read only with decode.sbo: full (sglang sends on its own "
                f"SMs only while the down GEMM overlaps the combine), and decode.sbo is {d.sbo.value}; remove it."
            ]
        return [], []
    if t.hardware.capability() != (9, 0) or d.moe_a2a_backend != "deepep" or d.deepep_mode != "low_latency":
        return [], []  # Blackwell's send and its default are sglang's own; other all-to-alls have no send SMs
    sms, source = send_sms(t)
    if sms is None:
        return [], [
            f"decode.sbo_send_sms: unset, and sglang-pd has no default for {t.hardware.gpu} (no profile in "
            f"deploy/estimate/hardware.yaml), so sglang sends the combine on its own {SM90_DEFAULT_SEND_SMS} SMs, "
            "which on an H100 cost full SBO 4.5-43 % of the MoE layer (docs/topology.md); set decode.sbo_send_sms."
        ]
    if cfg is None:
        return [], [
            f"decode.sbo_send_sms: {sms} ({source}) is checked against the down GEMM's tiles only with the model's "
            "shape; set model.config_json."
        ]
    judged = send_sms_range(t, cfg)
    if judged is None:
        return [], []
    return judged.problems(sms, source), []
