"""One DeepSeek-V3 MoE layer across GPUs with DeepEP: what SBO (decode) and TBO (prefill) save.

What is measured
----------------
``--mode decode`` (default): one decode MoE layer per rank, DeepEP low-latency dispatch/combine,
at 8, 16, 32, 64 and 128 tokens per rank. The layer: router (bf16 GEMM, DeepSeek-V3's grouped
top-8 of 256 with sigmoid scores and correction bias), DeepEP low-latency dispatch (FP8, 1x128
scales), the up/gate grouped GEMM (FP8, 128x128 weight scales), SiLU-and-mul with FP8
re-quantization (a small Triton kernel here; sglang fuses the same step), the down grouped GEMM
(our `sglang_pd.kernels.signal_gemm.fp8_m_grouped_gemm_nt_masked`), DeepEP low-latency combine,
and one shared expert (moe_intermediate 2048). The activation scales of the down GEMM are
MN-major, as sglang's fused SiLU-and-mul hands them to DeepGEMM. Variants:

- ``none``: sglang's DeepEP path without SBO (`DeepseekV2MoE.forward_deepep` in sglang 0.5.17,
  `srt/models/deepseek_v2.py` lines 1263-1280 and 1457-1465): after the router GEMM the shared
  expert runs on the alternate stream while dispatch, the routed experts and combine run on the
  compute stream, which waits for it before the sum. Down GEMM: ours on all SMs, no signals.
- ``deepgemm``: the same with DeepGEMM's masked grouped GEMM as the down GEMM
  (`deep_gemm.fp8_m_grouped_gemm_nt_masked` of sgl-deep-gemm 0.1.5.post1, sglang 0.5.17's pin),
  called as sglang's `deep_gemm_wrapper.grouped_gemm_nt_f8f8bf16_masked` calls it without overlap
  (no ``max_block_n``, scales through `get_mn_major_tma_aligned_tensor`): sglang's real baseline
  for the down GEMM. Skipped, with the reason in the report, when `deep_gemm` does not import.
- ``shared``: SBO's first half as sglang runs it on Hopper (`SboFlags.enable_dispatch_shared_one_
  stream_overlap`): dispatch-send, the shared expert on the same stream while the tokens travel,
  then dispatch-receive (DeepEP's receive hook);
- ``full@S``: the shared half plus the down GEMM signalling DeepEP's combine-send per finished row
  block (sglang's sm_90 contract, `low_latency_combine(..., overlap=True, packed_recv_count,
  comp_signal, block_m, threshold, num_sms)`, DeepEP PR #483): the GEMM on the compute stream
  with all SMs but ``S`` (``--combine-sms``, a list: sglang's `SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS`,
  default 3 on Hopper), the combine on a second stream that waits for the GEMM's start, as
  sglang's `compute_overlap_args` and `_combine_core` arrange it. ``--max-block-n 160`` applies
  sglang's H20 rule (`SGLANG_DEEPGEMM_ON_H20`, `srt/layers/moe/moe_runner/deep_gemm.py` lines
  652-654 in 0.5.17): 160 at ``expected_m <= 64``, else 256; only overlapped calls pass it.
- ``full_alt@S`` (``--full-alt``): the same down GEMM and combine-send, with the shared expert on
  the alternate stream from before the dispatch, as in ``none``. This is sglang's arrangement when
  `SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO` is set (`forward_deepep`'s third SBO branch):
  the shared expert keeps the concurrency it has without SBO, and only the down GEMM changes.

Each variant is captured in a CUDA graph (as sglang's decode runs) and timed over its replays with
CUDA events, the variants interleaved round by round (median over ``--repeats`` rounds of
``--iters`` replays; the slowest rank's median is the layer time). If capture fails, the variant
is timed eagerly and the table says so. Per ``full@S`` the report also holds the GEMM's and the
combine-send's waves, derived from the tile and SM counts (`benchmarks/sbo_waves.py`).

Correctness: every rank checks its layer output after the eager warm-up against a single-GPU
torch reference of the same layer: float32 math on the dequantized FP8 weights, with the
activations quantized the way the layer quantizes them (1x128, amax / 448) and the GEMM outputs
rounded to bf16 like the kernels'. Pass: relative L2 error ``||out - ref|| / ||ref|| <= --tol``
(default 2e-2) and all finite. With ``--replay-check N``, N replays each get a fresh random input
copied into the graphs' static input and NaN in every output buffer (the down GEMM's, the
combine's, the layer's); ``none`` runs on it, then every checked variant, each compared bit for
bit with ``none`` after every replay (`benchmarks/replay_check.py`); the last input is also held
to the torch reference. Two more variants run there only: ``full_split@S`` (the down GEMM in two
launches, the first expert with tokens last, the combine waiting for every signal: must equal
``none``) and the must-fail control ``full_skip_wait@S`` (the same split, but that expert's
signals handed to the combine already at the threshold, so it sends those rows before the GEMM
writes them): the control must differ from ``none`` in at least one replay, or the run fails.

``--mode tbo``: prefill two-batch overlap. Per layer: an attention stand-in (two bf16 GEMMs,
[T, 7168] x [7168, W] x [W, 7168], W = ``--attn-width``; about the FLOPs of DeepSeek-V3's MLA at
W = 24576 — it stands in for attention, it is not attention), the router, DeepEP normal
dispatch (FP8), the experts (the same FP8 grouped GEMMs on a masked layout built with plain torch
gathers; sglang uses fused Triton gathers), the shared expert, DeepEP normal combine. ``none``
runs the whole batch; ``tbo`` splits it in two micro-batches and orders the work so that each
micro-batch's dispatch/combine runs on DeepEP's communication stream while the other computes
(dispatch A || attention B, dispatch B || experts A, combine A || experts B, combine B || the next
layer's attention A). ``--layers`` layers are chained so the steady state is measured; DeepEP's
normal dispatch waits on the CPU for the receive counts, so these are timed with CUDA events,
not graphs. Correctness: TBO against no overlap (``--tol``), and no overlap against the torch
reference on the first tokens of each rank.

What this setup is and is not
-----------------------------
All ranks are GPUs of one host linked by NVLink; DeepEP's low-latency kernels reach peers through
NVSHMEM P2P (the host has no RDMA NICs). In the deployments this models (decode EP16 over two
nodes of 8 GPUs) sglang leaves DeepEP's `allow_nvlink_for_low_latency_mode` at its default (on:
sglang's `DeepEPBuffer` does not pass it), so a rank's combine traffic is 1/16 local copy, 7/16
NVLink to the other GPUs of its node and 8/16 RDMA to the other node; over RDMA the send SMs only
post work requests, while here (and over NVLink there) they copy the data themselves, so few combine
SMs cost more here than they would for the RDMA half there.
With 256 experts on 2 GPUs each GPU holds 128 experts; ``--num-experts 32`` gives each GPU the
16 experts and the tokens per expert of EP16 decode with 256 experts (the same per-GPU GEMM work).

With one GPU (``--gpus 1``) DeepEP copies every token to its own rank (no peer, no NIC): the
``full`` variant then runs the real chain, our down GEMM signalling DeepEP's combine, and its
output and hang-freedom are checked, but there is no traffic to hide, so its time against
``none`` is SBO's overhead, not its gain. The send SMs copy every row themselves there, so
their number sets the combine-send's speed (docs/sbo.md).

Run (one process per GPU is spawned; from the repository root)::

    python3 benchmarks/bench_moe_layer.py --json decode.json
    python3 benchmarks/bench_moe_layer.py --mode tbo --json tbo.json

DeepEP must be importable (scripts/gpu/build_deepep.sh installs it into /tmp/deepep; put that on
PYTHONPATH). The machine rule NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 is enforced here; nothing uses NVLink multicast.
"""

from __future__ import annotations

# %%
# Environment (before torch, NCCL or NVSHMEM read it)
# ---------------------------------------------------
import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
# One host, no RDMA NICs: NVSHMEM reaches every peer through P2P (NVLink). DeepEP itself sets
# NVSHMEM_IB_ENABLE_IBGDA=1 and NVSHMEM_DISABLE_P2P=0 when it creates a low-latency buffer with
# allow_nvlink_for_low_latency_mode=True; IBGDA then finds no device and stays off, and every
# low-latency send takes DeepEP's NVLink path (`nvshmemi_get_p2p_ptr` != 0).
os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
os.environ.setdefault("PYTHONUNBUFFERED", "1")

import argparse
import contextlib
import datetime
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]


def _import_from_tree() -> str:
    """`sglang_pd` from the installed package, else from this tree (`.mypy-root/sglang_pd` links its parts)."""
    try:
        import sglang_pd.kernels.signal_gemm
        import sglang_pd.sglang_patches.status  # noqa: F401

        return "installed package"
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "sglang_pd" or m.startswith("sglang_pd.")]:
        del sys.modules[name]
    sys.path.insert(0, str(REPO / ".mypy-root"))
    return f"source tree {REPO}"


KERNELS_FROM = _import_from_tree()
from sglang_pd.kernels import signal_gemm as sg  # noqa: E402
from sglang_pd.sglang_patches import status  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this script
import replay_check  # noqa: E402
import sbo_waves  # noqa: E402

# %%
# DeepSeek-V3's MoE layer
# -----------------------
HIDDEN = 7168
MOE_INTER = 2048  # per routed expert; the one shared expert has the same width
TOP_K = 8
N_GROUP, TOPK_GROUP = 8, 4
ROUTED_SCALE = 2.5
BLOCK = sg.SCALE_BLOCK  # 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# sglang's dispatch budget per rank, read from sglang's own variable (its default 128); one rank at 256
# tokens puts 128 tokens on each of 16 experts, the taller tile of the down GEMM.
MAX_DISPATCH_TOKENS = int(os.environ.get("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "128"))
DECODE_TOKENS = (8, 16, 32, 64, 128)
TBO_TOKENS = (4096, 16384)


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


# %%
# Quantization and weights
# ------------------------


def quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one float32 scale per 128 channels, as DeepEP's dispatch casts (amax >= 1e-4, scale = amax / 448)."""
    xf = x.float().unflatten(-1, (x.shape[-1] // BLOCK, BLOCK))
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    q = (xf * (FP8_MAX / amax)[..., None]).to(FP8).flatten(-2)
    return q, amax / FP8_MAX


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors are stacked, zeroed and indexed as bytes (not every torch kernel takes FP8)."""
    return t.view(torch.uint8)


def stack_fp8(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([as_bytes(t) for t in ts]).view(FP8)


def dequant_1x128(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (q.shape[-1] // BLOCK, BLOCK)) * s[..., None]).flatten(-2)


def dequant_weight(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[.., N, K] FP8 with [.., N/128, K/128] block scales -> float32."""
    n, k = q.shape[-2:]
    full = s.repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return q.float() * full


def fp8_weight(gen: torch.Generator, n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight with 128x128 block scales; dequantized entries have variance about 1/k."""
    q = torch.randn(n, k, generator=gen, device=device).clamp_(-6, 6).to(FP8)
    s = (torch.rand(triton.cdiv(n, BLOCK), k // BLOCK, generator=gen, device=device) * 0.5 + 0.75) / math.sqrt(k)
    return q, s


class Weights:
    """Router, routed experts (this rank's slice, FP8) and the shared expert; any expert regenerates on demand."""

    def __init__(self, num_experts: int, rank: int, world: int, seed: int, device: torch.device) -> None:
        self.num_experts, self.seed, self.device = num_experts, seed, device
        self.num_local = num_experts // world
        self.first = rank * self.num_local
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.router = (torch.randn(num_experts, HIDDEN, generator=gen, device=device) / math.sqrt(HIDDEN)).to(
            torch.bfloat16
        )
        self.router_bias = torch.randn(num_experts, generator=gen, device=device) * 0.01
        experts = [self.expert(self.first + i) for i in range(self.num_local)]
        self.up_q = stack_fp8([e[0] for e in experts])  # [L, 2I, H]: gate rows then up rows
        self.up_s = torch.stack([e[1] for e in experts])
        self.down_q = stack_fp8([e[2] for e in experts])  # [L, H, I]
        self.down_s = torch.stack([e[3] for e in experts])
        del experts
        shared = self.expert(-1)
        self.shared_up_q, self.shared_up_s = shared[0][None], shared[1][None]
        self.shared_down_q, self.shared_down_s = shared[2][None], shared[3][None]

    def expert(self, e: int) -> tuple[torch.Tensor, ...]:
        """Expert ``e``'s (up_q, up_s, down_q, down_s), the same on every rank (e = -1: the shared expert)."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + 7919 * (e + 2))
        up = fp8_weight(gen, 2 * MOE_INTER, HIDDEN, self.device)
        down = fp8_weight(gen, HIDDEN, MOE_INTER, self.device)
        return (*up, *down)


# %%
# Router: DeepSeek-V3's grouped top-k (sigmoid scores, correction bias, normalised x 2.5)
# ------------------------------------------------------------------------------------------


def route(x: torch.Tensor, w: Weights, idx_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return top_k(router_logits(x, w), w, idx_dtype)


def router_logits(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """The router GEMM (sglang's `self.gate`): the shared expert forks off after it."""
    return x @ w.router.t()


def top_k(logits: torch.Tensor, w: Weights, idx_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape[0], w.num_experts
    scores = logits.float().sigmoid()
    choice = scores + w.router_bias
    groups = choice.view(t, N_GROUP, e // N_GROUP).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(groups).scatter_(1, groups.topk(TOPK_GROUP, dim=-1).indices, 1.0).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(e // N_GROUP, dim=1), float("-inf"))
    idx = choice.topk(TOP_K, dim=-1).indices
    weights = scores.gather(1, idx)
    weights = weights / weights.sum(-1, keepdim=True) * ROUTED_SCALE
    return idx.to(idx_dtype), weights.float()


# %%
# Expert math: grouped FP8 GEMMs and SiLU-and-mul with FP8 re-quantization
# ---------------------------------------------------------------------------


@triton.jit
def _silu_mul_quant_kernel(
    h_ptr, q_ptr, s_ptr, masked_m_ptr,
    INTER,
    stride_he, stride_hm, stride_qe, stride_qm, stride_se, stride_sm, stride_sk,
    BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """act = silu(gate) * up for rows < masked_m[e]; FP8 with one scale per row per GROUP columns."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(2) * GROUP + tl.arange(0, GROUP)
    ok = rows < tl.load(masked_m_ptr + e)
    h = h_ptr + e * stride_he + rows[:, None] * stride_hm + cols[None, :]
    gate = tl.load(h, mask=ok[:, None], other=0.0).to(tl.float32)
    up = tl.load(h + INTER, mask=ok[:, None], other=0.0).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    amax = tl.maximum(tl.max(tl.abs(act), axis=1), 1e-4)
    q = (act * (448.0 / amax)[:, None]).to(tl.float8e4nv)
    tl.store(q_ptr + e * stride_qe + rows[:, None] * stride_qm + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + e * stride_se + rows * stride_sm + tl.program_id(2) * stride_sk, amax / 448.0, mask=ok)


def silu_mul_quant(h: torch.Tensor, masked_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, M, 2I] bf16 -> ([E, M, I] FP8, [E, M, I/128] float32); rows >= masked_m[e] are left unwritten.

    The scales come out MN-major (rows adjacent), the layout sglang's fused SiLU-and-mul hands the
    down GEMM and DeepGEMM's TMA wants, so that no variant pays a transpose."""
    e, m, two_i = h.shape
    inter = two_i // 2
    q = torch.empty(e, m, inter, dtype=FP8, device=h.device)
    s = torch.empty(e, inter // BLOCK, m, dtype=torch.float32, device=h.device).transpose(1, 2)
    grid = (e, triton.cdiv(m, 16), inter // BLOCK)
    _silu_mul_quant_kernel[grid](
        h, q, s, masked_m, inter, h.stride(0), h.stride(1), q.stride(0), q.stride(1),
        s.stride(0), s.stride(1), s.stride(2),
        BLOCK_ROWS=16, GROUP=BLOCK,
    )  # fmt: skip
    return q, s


def silu_mul_quant_torch(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hf = h.float()
    inter = hf.shape[-1] // 2
    return quant_1x128(torch.nn.functional.silu(hf[..., :inter]) * hf[..., inter:])


#: SiLU-and-mul implementation: the Triton kernel, or torch over the whole buffer if the kernel fails its check.
ACT_IMPL = {"name": "triton"}


def act_quant(h: torch.Tensor, masked_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return silu_mul_quant(h, masked_m) if ACT_IMPL["name"] == "triton" else silu_mul_quant_torch(h)


def full_max_block_n(rule: int, expected_m: int) -> int:
    """``max_block_n`` of an overlapped down GEMM under ``--max-block-n`` (sglang's runner, see the
    docstring): 160 is sglang's H20 rule, which applies at ``expected_m <= 64`` only."""
    return 160 if rule == 160 and expected_m <= 64 else 256


def load_deep_gemm() -> tuple[Any, str | None]:
    """DeepGEMM (sgl-deep-gemm) for the ``deepgemm`` variant, or None and why it cannot run."""
    try:
        import deep_gemm  # type: ignore[import-not-found]  # on the GPU machine only
    except Exception as exc:  # the baseline is optional; the report says why it is missing
        return None, f"deep_gemm does not import: {type(exc).__name__}: {exc}"
    if not hasattr(deep_gemm, "fp8_m_grouped_gemm_nt_masked"):
        return None, f"deep_gemm {getattr(deep_gemm, '__version__', '?')} has no fp8_m_grouped_gemm_nt_masked"
    return deep_gemm, None


def mn_major_scales(deep_gemm: Any, sf: torch.Tensor) -> torch.Tensor:
    """sglang's `get_mn_major_tma_aligned_tensor` wrapper (`srt/layers/deep_gemm_wrapper/entrypoint.py`
    in 0.5.17): keep ``sf`` itself when DeepGEMM would only alias it."""
    out = deep_gemm.get_mn_major_tma_aligned_tensor(sf)
    return sf if out.data_ptr() == sf.data_ptr() else out


class Experts:
    """The grouped GEMMs of one rank: ours (default) or torch on dequantized weights (``--up-gemm torch``)
    for the up/gate GEMM; ours, with or without signals, or DeepGEMM's for the down GEMM."""

    def __init__(self, w: Weights, up_impl: str, num_sms: int, deep_gemm: Any = None) -> None:
        self.w, self.up_impl, self.num_sms, self.deep_gemm = w, up_impl, num_sms, deep_gemm
        self._up_bf16: torch.Tensor | None = None

    def up(self, a: torch.Tensor, a_s: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> torch.Tensor:
        e, m, _ = a.shape
        out = torch.empty(e, m, 2 * MOE_INTER, dtype=torch.bfloat16, device=a.device)
        if self.up_impl == "ours":
            sg.fp8_m_grouped_gemm_nt_masked((a, a_s), (self.w.up_q, self.w.up_s), out, masked_m, expected_m)
            return out
        if self._up_bf16 is None:  # dequantized once: [L, 2I, H] bf16
            self._up_bf16 = torch.stack(
                [dequant_weight(q, s).to(torch.bfloat16) for q, s in zip(self.w.up_q, self.w.up_s, strict=True)]
            )
        torch.bmm(dequant_1x128(a, a_s).to(torch.bfloat16), self._up_bf16.transpose(1, 2), out=out)
        return out

    def down(
        self, a: torch.Tensor, a_s: torch.Tensor, masked_m: torch.Tensor, expected_m: int, *,
        out: torch.Tensor | None = None, signal: torch.Tensor | None = None, num_sms: int | None = None,
        max_block_n: int = 256, impl: str = "ours",
    ) -> tuple[torch.Tensor, tuple[int | None, int | None]]:  # fmt: skip
        e, m, _ = a.shape
        if out is None:
            out = torch.empty(e, m, HIDDEN, dtype=torch.bfloat16, device=a.device)
        if impl == "deepgemm":
            if self.deep_gemm is None:
                raise RuntimeError("the deepgemm variant needs deep_gemm (see the report's deepgemm_skipped)")
            self.deep_gemm.fp8_m_grouped_gemm_nt_masked(
                (a, mn_major_scales(self.deep_gemm, a_s)), (self.w.down_q, self.w.down_s), out, masked_m, expected_m
            )
            return out, (None, None)
        ret = sg.fp8_m_grouped_gemm_nt_masked(
            (a, a_s), (self.w.down_q, self.w.down_s), out, masked_m, expected_m,
            max_block_n=max_block_n, enable_overlap=signal is not None, signal=signal,
            signal_layout="sglang", num_sms=num_sms,
        )  # fmt: skip
        return out, ret

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert on [T, H] bf16, through the same FP8 GEMMs (one group, rows padded to 128)."""
        t = x.shape[0]
        rows = max(BLOCK, triton.cdiv(t, BLOCK) * BLOCK)
        xq, xs = quant_1x128(x)
        a = torch.zeros(1, rows, HIDDEN, dtype=torch.uint8, device=x.device)
        a_s = torch.ones(1, rows, HIDDEN // BLOCK, dtype=torch.float32, device=x.device)
        a[0, :t], a_s[0, :t] = as_bytes(xq), xs
        a = a.view(FP8)
        m = torch.full((1,), t, dtype=torch.int32, device=x.device)
        h = torch.empty(1, rows, 2 * MOE_INTER, dtype=torch.bfloat16, device=x.device)
        sg.fp8_m_grouped_gemm_nt_masked((a, a_s), (self.w.shared_up_q, self.w.shared_up_s), h, m, t)
        aq, as_ = act_quant(h, m)
        out = torch.empty(1, rows, HIDDEN, dtype=torch.bfloat16, device=x.device)
        sg.fp8_m_grouped_gemm_nt_masked((aq, as_), (self.w.shared_down_q, self.w.shared_down_s), out, m, t)
        return out[0, :t]


# %%
# The torch reference (one GPU, float32, the same quantization points)
# -----------------------------------------------------------------------


def reference_expert(
    x_deq: torch.Tensor, up_q: torch.Tensor, up_s: torch.Tensor, down_q: torch.Tensor, down_s: torch.Tensor
) -> torch.Tensor:
    """float32 expert on dequantized FP8 activations; bf16 GEMM outputs and FP8 intermediate, like the kernels."""
    h = (x_deq @ dequant_weight(up_q, up_s).t()).to(torch.bfloat16)
    aq, as_ = silu_mul_quant_torch(h)
    return (dequant_1x128(aq, as_) @ dequant_weight(down_q, down_s).t()).to(torch.bfloat16).float()


def reference_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w: Weights) -> torch.Tensor:
    """sum_k w_k * expert_{e_k}(x) + shared(x) for [T, H] bf16 tokens, in float32."""
    xd = dequant_1x128(*quant_1x128(x))
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_idx).tolist():
        rows, ks = (topk_idx == e).nonzero(as_tuple=True)
        local = w.first <= e < w.first + w.num_local
        params = (
            (w.up_q[e - w.first], w.up_s[e - w.first], w.down_q[e - w.first], w.down_s[e - w.first])
            if local
            else w.expert(e)
        )
        out.index_add_(0, rows, reference_expert(xd[rows], *params) * topk_w[rows, ks][:, None])
    shared = reference_expert(xd, w.shared_up_q[0], w.shared_up_s[0], w.shared_down_q[0], w.shared_down_s[0])
    return out + shared


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    o, r = out.float(), ref.float()
    finite = bool(torch.isfinite(o).all())
    rel = float((o - r).norm() / r.norm().clamp(min=1e-30)) if finite else float("inf")
    return {"rel_err": rel, "max_abs_err": float((o - r).abs().max()) if finite else float("inf"), "finite": finite}


# %%
# Timing
# ------


def time_replays(fn: Callable[[], Any], iters: int, repeats: int) -> list[float]:
    """Median-ready list of microseconds per call: ``repeats`` times ``iters`` calls between two events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / iters)
    return times


def time_interleaved(fns: dict[str, Callable[[], Any]], iters: int, repeats: int) -> dict[str, list[float]]:
    """``time_replays`` of several variants, one round of each in turn: drift of the clocks over
    the run spreads over all of them instead of favouring the one timed first."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += time_replays(fn, iters, 1)
    return times


def wait_or_die(rank: int, what: str, timeout_s: float, diagnose: Callable[[], str] | None = None) -> None:
    """Wait for the current stream; if it has not finished in ``timeout_s``, print why and end this process.

    A combine that waits on signals that never come spins forever; a stuck kernel cannot be
    cancelled, so the only way out is to say what was seen and exit (the parent reports it)."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            log(rank, f"HANG: {what} did not finish within {timeout_s:.0f} s")
            if diagnose is not None:
                try:
                    log(rank, diagnose())
                except Exception as exc:  # the diagnosis itself may block on the hung device
                    log(rank, f"(diagnosis failed: {type(exc).__name__}: {exc})")
            sys.stdout.flush()
            os._exit(3)
        time.sleep(0.001)


def read_on_side_stream(t: torch.Tensor, timeout_s: float = 5.0) -> torch.Tensor | None:
    """Copy a device tensor to the host on its own stream (works while another stream is stuck)."""
    side = torch.cuda.Stream()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
    deadline = time.monotonic() + timeout_s
    while not ev.query():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.001)
    return host


# %%
# Decode: DeepEP low-latency
# --------------------------

#: Timed and checked: sglang without SBO (ours, DeepGEMM's down GEMM), SBO's first half; ``full@S``
#: follow, one per ``--combine-sms``.
BASELINES = ("none", "deepgemm", "shared")
#: Full SBO with the shared expert on the alternate stream from before the dispatch, as in sglang's
#: baseline, and the down GEMM signalling the combine-send: the arrangement sglang runs when
#: SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO is set (`forward_deepep`'s third SBO branch).
#: Timed beside ``full@S``, which runs the shared expert inside the dispatch-recv window.
FULL_ALT = "full_alt"
#: Replay check only: the down GEMM in two launches with every wait (must equal ``none``), and the
#: same with one expert's waits skipped (the must-fail control).
SPLIT, SKIP_WAIT = "full_split", "full_skip_wait"
OVERLAPPED = ("full", FULL_ALT, SPLIT, SKIP_WAIT)
#: Variants whose shared expert runs on the alternate stream, beside the dispatch and routed GEMMs.
SHARED_ON_ALT = ("none", "deepgemm", FULL_ALT)


def parse_variant(name: str) -> tuple[str, int | None]:
    """``"full@16"`` -> ``("full", 16)``; ``"none"`` -> ``("none", None)``."""
    base, _, sms = name.partition("@")
    if base not in (*BASELINES, *OVERLAPPED) or bool(sms) != (base in OVERLAPPED):
        raise ValueError(f"unknown decode variant {name!r}: use one of {BASELINES} or full@S, {SPLIT}@S, {SKIP_WAIT}@S")
    return base, int(sms) if sms else None


class DecodeLayer:
    """One decode MoE layer on one rank; ``__call__(x, variant)`` enqueues it (capturable in a CUDA graph).

    The down GEMM's, the combine's and the layer's outputs live in buffers kept across calls, as in
    sglang's captured graphs, so that the replay check can fill them with NaN before each replay."""

    def __init__(
        self, buffer: Any, w: Weights, experts: Experts, world: int, idx_dtype: torch.dtype, max_block_n_rule: int
    ) -> None:
        self.buffer, self.w, self.experts, self.world = buffer, w, experts, world
        self.idx_dtype, self.max_block_n_rule = idx_dtype, max_block_n_rule
        self.num_sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.alt = torch.cuda.Stream()
        self.m_max = world * MAX_DISPATCH_TOKENS
        # sglang's sm_90 allocation: int32[E_local * ceil(M_max / 64)] (DeepEP asserts exactly this size)
        self.signal = torch.zeros(w.num_local * triton.cdiv(self.m_max, 64), dtype=torch.int32, device="cuda")
        self.unread_signal = torch.zeros_like(self.signal)  # the control's late launch signals here
        self.down_out = torch.empty(w.num_local, self.m_max, HIDDEN, dtype=torch.bfloat16, device="cuda")
        self.combined = self.final = torch.empty(0, HIDDEN, dtype=torch.bfloat16, device="cuda")
        self.last: dict[str, Any] = {}

    def set_tokens(self, t: int) -> None:
        self.combined = torch.empty(t, HIDDEN, dtype=torch.bfloat16, device="cuda")
        self.final = torch.empty_like(self.combined)

    def poison(self) -> None:
        """NaN in every output buffer: a row read before it is written shows."""
        for buf in (self.down_out, self.combined, self.final):
            buf.fill_(float("nan"))

    def expected_m(self, t: int) -> int:
        return max(1, min(self.m_max, triton.cdiv(t * self.world * TOP_K, self.w.num_experts)))

    def __call__(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        base, sms = parse_variant(variant)
        w, ex = self.w, self.experts
        cur = torch.cuda.current_stream()
        logits = router_logits(x, w)
        shared: torch.Tensor | None = None
        if base in SHARED_ON_ALT:  # as sglang without SBO: the shared expert on the alternate stream
            self.alt.wait_stream(cur)
            with torch.cuda.stream(self.alt):
                shared = ex.shared(x)
                shared_done = self.alt.record_event()
        topk_idx, topk_w = top_k(logits, w, self.idx_dtype)
        (recv_q, recv_s), recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, topk_idx, MAX_DISPATCH_TOKENS, w.num_experts, use_fp8=True, async_finish=False, return_recv_hook=True
        )
        if shared is None:  # SBO's first half: the shared expert while the dispatched tokens travel
            shared = ex.shared(x)
        hook()
        em = self.expected_m(x.shape[0])
        h = ex.up(recv_q, recv_s, recv_count, em)
        aq, as_ = act_quant(h, recv_count)
        if sms is None:
            ex.down(aq, as_, recv_count, em, out=self.down_out, impl="deepgemm" if base == "deepgemm" else "ours")
            _, _, hook = self.buffer.low_latency_combine(
                self.down_out, topk_idx, topk_w, handle, async_finish=False, return_recv_hook=True, out=self.combined
            )
            hook()
        else:
            self._overlapped(base, sms, aq, as_, recv_count, em, topk_idx, topk_w, handle)
        if base in SHARED_ON_ALT:
            cur.wait_event(shared_done)
            if not torch.cuda.is_current_stream_capturing():
                shared.record_stream(cur)  # allocated on the alternate stream, read on this one
        torch.add(self.combined, shared, out=self.final)
        self.last.update(topk_idx=topk_idx, topk_w=topk_w, recv_count=recv_count)
        return self.final

    def _overlapped(
        self, base: str, sms: int, aq: torch.Tensor, as_: torch.Tensor, recv_count: torch.Tensor, em: int,
        topk_idx: torch.Tensor, topk_w: torch.Tensor, handle: Any,
    ) -> None:  # fmt: skip
        """The down GEMM on ``num_sms - sms`` SMs signalling DeepEP's combine-send on the alternate
        stream, which starts with the GEMM (sglang's `compute_overlap_args` and `_combine_core`). In
        ``full_alt`` the shared expert was enqueued on that stream first, so the send also waits for it.

        ``full_split`` and ``full_skip_wait`` launch the GEMM twice: first for every expert but the
        first one with tokens (``late``), then for ``late`` alone, with the same tile and programs, so
        every row is computed as in ``full``. In ``full_skip_wait`` the late launch signals a buffer
        the combine never reads and ``late``'s counters are handed to the combine already at the
        threshold: it sends those rows before the late launch writes them."""
        gemm = functools.partial(
            self.experts.down, aq, as_, out=self.down_out, num_sms=self.num_sms - sms,
            max_block_n=full_max_block_n(self.max_block_n_rule, em),
        )  # fmt: skip
        late = late_index = early_m = None
        if base not in ("full", FULL_ALT):  # these run no extra kernel: their times are measured
            experts = torch.arange(recv_count.numel(), device=recv_count.device)
            late_index = torch.argmax((recv_count > 0).to(torch.int32)).reshape(1)  # argmax: the first maximum
            late = experts == late_index
            early_m = torch.where(late, 0, recv_count)
        self.signal.zero_()
        start = torch.cuda.Event()
        start.record()
        _, (block_m, threshold) = gemm(recv_count if early_m is None else early_m, em, signal=self.signal)
        assert block_m is not None and threshold is not None
        self.alt.wait_event(start)
        with torch.cuda.stream(self.alt):
            if base == SKIP_WAIT and late_index is not None:
                # index_fill_ writes `late`'s row alone. masked_fill_ would read and write back every
                # counter while the early launch increments the other experts' on the main stream, and
                # an increment lost that way leaves the combine waiting forever (the hangs seen in this
                # control's eager call before this change).
                blocks = triton.cdiv(self.m_max, block_m)
                self.signal[: self.w.num_local * blocks].view(-1, blocks).index_fill_(0, late_index, threshold)
            _, _, hook = self.buffer.low_latency_combine(
                self.down_out, topk_idx, topk_w, handle, overlap=True, packed_recv_count=recv_count,
                comp_signal=self.signal, block_m=block_m, threshold=threshold, num_sms=sms,
                async_finish=False, return_recv_hook=True, out=self.combined,
            )  # fmt: skip
            hook()
        if late is not None:
            gemm(torch.where(late, recv_count, 0), em, signal=self.signal if base == SPLIT else self.unread_signal)
        torch.cuda.current_stream().wait_stream(self.alt)
        self.last.update(block_m=block_m, threshold=threshold)

    def diagnose(self) -> str:
        sig = read_on_side_stream(self.signal)
        cnt = read_on_side_stream(self.last["recv_count"]) if "recv_count" in self.last else None
        if sig is None:
            return "could not read the signal counters (the device does not answer)"
        bm, thr = self.last.get("block_m"), self.last.get("threshold")
        blocks = triton.cdiv(self.m_max, bm or 64)  # the kernel and DeepEP index e * blocks + row_block
        per_expert = sig[: self.w.num_local * blocks].view(self.w.num_local, blocks)
        return (
            f"combine waits for counters == threshold {thr} (block_m {bm}); first experts' counters "
            f"{per_expert[:4].tolist()}, their received tokens {cnt[:4].tolist() if cnt is not None else '?'}"
        )


def run_decode(rank: int, world: int, args: argparse.Namespace, report: dict[str, Any], deep_gemm: Any) -> None:
    import deep_ep  # type: ignore[import-untyped]

    dev = torch.device("cuda", rank)
    w = Weights(args.num_experts, rank, world, args.seed, dev)
    ex = Experts(w, args.up_gemm, torch.cuda.get_device_properties(dev).multi_processor_count, deep_gemm)
    idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    group = dist.new_group(list(range(world)))
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_DISPATCH_TOKENS, HIDDEN, world, args.num_experts)
    log(rank, f"DeepEP low-latency buffer: {num_rdma_bytes / 2**20:.0f} MiB, {w.num_local} local experts")
    buffer = deep_ep.Buffer(
        group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
        num_qps_per_rank=w.num_local, allow_nvlink_for_low_latency_mode=True, explicitly_destroy=True,
    )  # fmt: skip
    log(rank, "DeepEP buffer ready")
    rows: list[dict[str, Any]] = []
    report["decode"] = rows
    with destroyed_at_exit(buffer, rank):
        layer = DecodeLayer(buffer, w, ex, world, idx_dtype, args.max_block_n)
        for t in args.tokens:
            rows.append(decode_one(rank, world, layer, t, args))
            if rank == 0:
                print_decode_row(rows[-1])
                write_report(args.json, report)


@contextlib.contextmanager
def destroyed_at_exit(buffer: Any, rank: int) -> Any:
    """Every rank reaches the barrier, then frees its DeepEP buffer (explicitly_destroy=True), even
    when a step failed; a failed free is logged, not raised over the step's own error."""
    try:
        yield buffer
    finally:
        dist.barrier()
        try:
            buffer.destroy()
        except Exception as exc:
            log(rank, f"buffer.destroy(): {type(exc).__name__}: {exc}")


def peers_ok(ok: bool) -> bool:
    """True when every rank says ok; every rank calls it once per step, failed or not, so that the
    ranks stay in step (a rank that skips a DeepEP call while its peer makes it would hang both)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def decode_variants(args: argparse.Namespace, deepgemm: bool) -> tuple[list[str], list[str]]:
    """(timed variants, replay-check-only variants) in run order."""
    fulls = [f"{base}@{s}" for s in args.combine_sms for base in ("full", *((FULL_ALT,) if args.full_alt else ()))]
    timed = [v for v in BASELINES if v != "deepgemm" or deepgemm] + fulls
    extra = [f"{SPLIT}@{args.combine_sms[0]}", f"{SKIP_WAIT}@{args.combine_sms[0]}"] if args.replay_check else []
    return timed, extra


def decode_one(rank: int, world: int, layer: DecodeLayer, t: int, args: argparse.Namespace) -> dict[str, Any]:
    """One batch size: eager warm-up and check, graph capture, interleaved timing, the replay check."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 17 * t + rank)
    x = torch.randn(t, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)  # the graphs' static input
    layer.set_tokens(t)
    em = layer.expected_m(t)
    row: dict[str, Any] = {
        "tokens_per_rank": t, "expected_m": em, "combine_sms": list(args.combine_sms),
        "max_block_n_full": full_max_block_n(args.max_block_n, em), "variants": {}, "waves": {},
    }  # fmt: skip
    timed, extra = decode_variants(args, layer.experts.deep_gemm is not None)
    runners: dict[str, Callable[[], Any]] = {}
    graphs: list[Any] = []
    none_out: torch.Tensor | None = None
    ref = None
    for variant in timed + extra:
        base, sms = parse_variant(variant)
        res: dict[str, Any] = {}
        row["variants"][variant] = res
        warm = False
        try:
            started = time.perf_counter()
            for i in range(2):  # warm-up: compiles, module loads, DeepEP buffer parity
                out = layer(x, variant)
                wait_or_die(rank, f"decode T={t} {variant} (eager)", args.hang_s, layer.diagnose)
                if i == 0:
                    res["first_call_s"] = round(time.perf_counter() - started, 3)
            if ref is None:
                ref = reference_layer(x, layer.last["topk_idx"], layer.last["topk_w"], layer.w)
                row["recv_tokens"] = int(layer.last["recv_count"].sum())
                row["experts_without_tokens"] = int((layer.last["recv_count"] == 0).sum())
            res["eager_check"] = compare(out, ref)
            if variant == "none":
                none_out = out.clone()
            elif none_out is not None:
                res["max_abs_diff_vs_none"] = float((out.float() - none_out.float()).abs().max())
                res["bit_equal_vs_none"] = bool(torch.equal(replay_check.bits(out), replay_check.bits(none_out)))
            if base in OVERLAPPED and sms is not None:
                res["block_m"], res["threshold"] = layer.last["block_m"], layer.last["threshold"]
                if base == "full":
                    row["waves"][str(sms)] = derived_waves(layer, em, sms)
            warm = True
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            log(rank, f"decode T={t} {variant} FAILED: {res['error']}\n{traceback.format_exc()}")
        if not peers_ok(warm):
            res.setdefault("error", "skipped: a peer rank failed this variant's warm-up")
            continue
        try:
            graph, _, how = capture(rank, lambda v=variant: layer(x, v), args)  # type: ignore[misc]
            res["timing"] = how
            if graph is not None:
                graphs.append(graph)
            runners[variant] = graph.replay if graph is not None else functools.partial(layer, x, variant)
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            log(rank, f"decode T={t} {variant} FAILED: {res['error']}\n{traceback.format_exc()}")
    # Every rank must replay the same graphs in the same order (DeepEP's kernels wait for their peers).
    captured: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(captured, sorted(runners))
    for variant in [v for v in runners if not all(v in names for names in captured)]:
        del runners[variant]
        row["variants"][variant].setdefault("error", "skipped: not captured on every rank")
    timing = {v: runners[v] for v in timed if v in runners}
    if timing:
        dist.barrier()
        samples = time_interleaved(timing, args.iters, args.repeats)
        wait_or_die(rank, f"decode T={t} (timed)", args.hang_s, layer.diagnose)
        for variant, times in samples.items():
            res = row["variants"][variant]
            res["us"], res["us_min"], res["us_rounds"] = statistics.median(times), min(times), times
    if args.replay_check and "none" in runners:
        row["replay_check"] = run_replay_check(rank, layer, runners, x, t, args)
    for variant, res in row["variants"].items():
        c = res.get("eager_check")
        if parse_variant(variant)[0] == SKIP_WAIT:  # a control: judged by whether the replay check caught it
            tally = row.get("replay_check", {}).get("tallies", {}).get(variant)
            res["ok"] = "error" not in res and tally is not None and bool(tally["ok"])
        else:
            res["ok"] = "error" not in res and c is not None and c["finite"] and c["rel_err"] <= args.tol
    del graphs, runners
    torch.cuda.empty_cache()
    return gather_row(rank, world, row)


def derived_waves(layer: DecodeLayer, em: int, sms: int) -> dict[str, Any]:
    """The GEMM's and the combine-send's waves for the last call's token counts (`sbo_waves`)."""
    max_block_n = full_max_block_n(layer.max_block_n_rule, em)
    config = sg.pick_config(
        em, max_block_n, sg.SIGNAL_SGLANG, warp_specialized=sg.ws_usable(torch.cuda.current_device())
    )
    block_m, threshold = layer.last["block_m"], layer.last["threshold"]
    waves = sbo_waves.describe(
        layer.last["recv_count"].tolist(), block_m=block_m, n_blocks=threshold, programs=layer.num_sms - sms,
        expected_m=em, m_max=layer.m_max, warp_specialized=isinstance(config, sg.WsConfig), send_sms=sms,
    )  # fmt: skip
    waves["config"] = repr(config)
    if config.block_m != block_m:
        waves["warning"] = f"pick_config gives block_m {config.block_m}, the GEMM returned {block_m}"
    return waves


def run_replay_check(
    rank: int, layer: DecodeLayer, runners: dict[str, Callable[[], Any]], x: torch.Tensor, t: int,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """``--replay-check`` replays, each on a fresh random input copied into the graphs' static input
    and with NaN in every output buffer: ``none``, then each checked variant, compared bit for bit
    with ``none`` after every replay (counted on the GPU, read back at the end)."""
    checked = [v for v in runners if parse_variant(v)[0] not in ("none", "deepgemm")]  # same kernels as none
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 7919 + 31 * t + rank)

    def output_of(run: Callable[[], Any]) -> Callable[[], torch.Tensor]:
        return lambda: (run(), layer.final)[1]

    started = time.monotonic()
    tallies = replay_check.run_replays(
        args.replay_check,
        load_input=lambda _: x.copy_(torch.randn(x.shape, generator=gen, device="cuda")),
        poison=layer.poison,
        baseline=output_of(runners["none"]),
        variants={v: output_of(runners[v]) for v in checked},
        must_fail=[v for v in checked if parse_variant(v)[0] == SKIP_WAIT],
        every=(100, lambda i: wait_or_die(rank, f"decode T={t} replay check, replay {i}", args.hang_s, layer.diagnose)),
    )
    layer.poison()
    runners["none"]()  # none's output of the last input, held to the torch reference below
    wait_or_die(rank, f"decode T={t} replay check", args.hang_s, layer.diagnose)
    baseline = layer.final.clone()
    topk_idx, topk_w = route(x, layer.w, layer.idx_dtype)  # the last input's routing (deterministic)
    return {
        "replays": args.replay_check,
        "seconds": round(time.monotonic() - started, 2),
        "inputs": "fresh random input per replay, copied into the graphs' static input",
        "poisoned": "NaN in the down GEMM's, the combine's and the layer's output before every replay",
        "tallies": {v: tally.as_dict() for v, tally in tallies.items()},
        "last_input_none_vs_torch": compare(baseline, reference_layer(x, topk_idx, topk_w, layer.w)),
    }


def capture(rank: int, fn: Callable[[], torch.Tensor], args: argparse.Namespace) -> tuple[Any, Any, str]:
    """A CUDA graph of ``fn`` and its output tensor, or (None, None, why) to time it eagerly."""
    if args.no_graph:
        return None, None, "events (--no-graph)"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        wait_or_die(rank, "first graph replay", args.hang_s)
        return graph, out, "cuda-graph"
    except Exception as exc:
        log(rank, f"graph capture failed, timing eagerly: {type(exc).__name__}: {exc}")
        torch.cuda.synchronize()
        return None, None, f"events (capture failed: {type(exc).__name__})"


def gather_row(rank: int, world: int, row: dict[str, Any]) -> dict[str, Any]:
    """Every rank's row on rank 0: times are the slowest rank's, checks must pass on all ranks."""
    rows: list[dict[str, Any]] = [{} for _ in range(world)]
    dist.all_gather_object(rows, row)
    merged: dict[str, Any] = {k: v for k, v in rows[0].items() if k not in ("variants", "replay_check")}
    merged["recv_tokens_per_rank"] = [r.get("recv_tokens") for r in rows]
    merged["variants"] = {}
    for variant in rows[0]["variants"]:
        per_rank = [r["variants"][variant] for r in rows]
        v: dict[str, Any] = {"ok": all(p.get("ok") for p in per_rank), "per_rank": per_rank}
        if all("us" in p for p in per_rank):
            v["us"] = max(p["us"] for p in per_rank)
        v["timing"] = per_rank[0].get("timing", "-")
        errs = [c["rel_err"] for p in per_rank for c in (p.get(k) for k in ("eager_check", "check")) if c]
        v["rel_err"] = max(errs) if errs else None
        diffs = [p["max_abs_diff_vs_none"] for p in per_rank if "max_abs_diff_vs_none" in p]
        v["max_abs_diff_vs_none"] = max(diffs) if diffs else None
        errors = [f"rank {i}: {p['error']}" for i, p in enumerate(per_rank) if "error" in p]
        if errors:
            v["error"] = "; ".join(errors)
        merged["variants"][variant] = v
    for key, base_name in (("saving_pct", "none"), ("saving_pct_vs_deepgemm", "deepgemm")):
        base = merged["variants"].get(base_name, {}).get("us")
        merged[key] = {
            k: round(100.0 * (base - v["us"]) / base, 2)
            for k, v in merged["variants"].items()
            if k != base_name and base and "us" in v
        }
    checks = [r["replay_check"] for r in rows if "replay_check" in r]
    if len(checks) == world:
        tallies = replay_check.merge_tallies([c["tallies"] for c in checks])
        merged["replay_check"] = {
            k: v for k, v in checks[0].items() if k not in ("tallies", "last_input_none_vs_torch")
        }
        merged["replay_check"]["tallies"] = tallies
        merged["replay_check"]["last_input_none_vs_torch"] = [c["last_input_none_vs_torch"] for c in checks]
        merged["replay_check"]["verdict"] = replay_check.summarize(tallies)
    return merged


def print_decode_row(r: dict[str, Any]) -> None:
    """One line per token count: the times, full SBO against none, the checks."""
    v = r["variants"]
    timed = [k for k in v if parse_variant(k)[0] in ("none", "deepgemm", "shared", "full", FULL_ALT)]
    if not getattr(print_decode_row, "header", False):
        cols = " ".join(f"{k:>9}" for k in timed)
        fulls = " ".join(f"{k:>8}" for k in timed if parse_variant(k)[0] in ("full", FULL_ALT))
        print(f"\n{'T/rank':>6} {'em':>4} {'bn':>4} | {cols} (us) | {fulls} (% slower than none) | ok  replays")
        print_decode_row.header = True  # type: ignore[attr-defined]

    def us(k: str) -> str:
        return f"{v[k]['us']:9.1f}" if "us" in v.get(k, {}) else f"{'-':>9}"

    slower = " ".join(
        f"{-r['saving_pct'][k]:8.1f}" if k in r["saving_pct"] else f"{'-':>8}"
        for k in timed
        if parse_variant(k)[0] in ("full", FULL_ALT)
    )
    check = r.get("replay_check", {}).get("verdict")
    replays = "-" if check is None else ("ok" if check["ok"] else "FAILED: " + "; ".join(check["problems"]))
    print(
        f"{r['tokens_per_rank']:>6} {r['expected_m']:>4} {r['max_block_n_full']:>4} | "
        f"{' '.join(us(k) for k in timed)} | {slower} | {'yes' if all(x['ok'] for x in v.values()) else 'NO '} "
        f"{replays}",
        flush=True,
    )
    for k, x in v.items():
        if "error" in x:
            print(f"       {k}: {x['error']}", flush=True)


# %%
# Prefill: DeepEP normal dispatch/combine, two-batch overlap
# -----------------------------------------------------------


class PrefillLayer:
    """Attention stand-in, router, DeepEP normal dispatch, experts, shared expert, DeepEP normal combine."""

    def __init__(
        self, buffer: Any, w: Weights, experts: Experts, attn_width: int, idx_dtype: torch.dtype, seed: int
    ) -> None:
        self.buffer, self.w, self.experts, self.idx_dtype = buffer, w, experts, idx_dtype
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed + 99)
        self.wa = (torch.randn(HIDDEN, attn_width, generator=gen, device="cuda") / math.sqrt(HIDDEN)).to(torch.bfloat16)
        self.wb = (torch.randn(attn_width, HIDDEN, generator=gen, device="cuda") / math.sqrt(attn_width)).to(
            torch.bfloat16
        )
        self.stash: dict[str, Any] = {}

    def attention(self, x: torch.Tensor) -> dict[str, Any]:
        """The stand-in (two bf16 GEMMs), the router and the FP8 cast of the tokens to dispatch.

        ``ready`` is an event right after this micro-batch's work: its dispatch waits for that only,
        not for whatever is enqueued on the compute stream after it (the other micro-batch)."""
        y = (x @ self.wa) @ self.wb
        topk_idx, topk_w = route(y, self.w, self.idx_dtype)
        return {"y": y, "topk_idx": topk_idx, "topk_w": topk_w, "yq": quant_1x128(y), "ready": self.buffer.capture()}

    def dispatch(self, a: dict[str, Any], overlap: bool) -> tuple[Any, ...]:
        """DeepEP normal dispatch (blocks the CPU until the receive counts are known); with
        ``overlap`` on DeepEP's stream after ``a["ready"]``, returning its event (as sglang does)."""
        prev = a["ready"] if overlap else None
        per_rank, per_rdma, per_expert, in_rank, layout_done = self.buffer.get_dispatch_layout(
            a["topk_idx"],
            self.w.num_experts,
            previous_event=prev,
            async_finish=overlap,
            allocate_on_comm_stream=overlap,
        )
        recv_x, recv_idx, recv_w, counts, handle, event = self.buffer.dispatch(
            a["yq"], topk_idx=a["topk_idx"], topk_weights=a["topk_w"], num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=layout_done if overlap else None, async_finish=overlap, allocate_on_comm_stream=overlap,
        )  # fmt: skip
        return recv_x, recv_idx, recv_w, counts, handle, event

    def compute_experts(self, recv: tuple[Any, ...], y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted expert outputs per received token, and the shared expert of this rank's tokens."""
        (rq, rs), recv_idx, recv_w, counts, _, event = recv
        if event is not None and getattr(event, "event", None) is not None:
            event.current_stream_wait()
        return self.routed(rq, rs, recv_idx, recv_w, counts), self.experts.shared(y)

    def routed(
        self, rq: torch.Tensor, rs: torch.Tensor, recv_idx: torch.Tensor, recv_w: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """Pairs (token, local expert) sorted by expert into the masked layout, the grouped GEMMs,
        then a weighted scatter-add back to the received tokens."""
        r, k = recv_idx.shape
        out = torch.zeros(r, HIDDEN, dtype=torch.float32, device=rq.device)
        pairs = sum(counts)
        if pairs == 0:
            return out.to(torch.bfloat16)
        num_local, m_max = self.w.num_local, max(counts)
        key = torch.where(recv_idx < 0, num_local, recv_idx).flatten()
        order = torch.sort(key, stable=True).indices[:pairs]  # the valid pairs, expert by expert
        expert = key[order]
        # pinned and non-blocking: a pageable copy would wait for the whole compute stream (the other micro-batch)
        counts_t = torch.tensor(counts, dtype=torch.int32)
        counts_t = (counts_t.pin_memory() if rq.is_cuda else counts_t).to(rq.device, non_blocking=True)
        starts = torch.cumsum(counts_t, 0) - counts_t
        pos = torch.arange(pairs, device=rq.device) - starts[expert]
        tok = order // k
        a = torch.empty(num_local, m_max, HIDDEN, dtype=torch.uint8, device=rq.device)
        a_s = torch.ones(num_local, m_max, HIDDEN // BLOCK, dtype=torch.float32, device=rq.device)
        a[expert, pos] = as_bytes(rq)[tok]
        a_s[expert, pos] = rs[tok]
        a = a.view(FP8)
        em = max(1, pairs // num_local)
        h = self.experts.up(a, a_s, counts_t, em)
        aq, as_ = act_quant(h, counts_t)
        d, _ = self.experts.down(aq, as_, counts_t, em)
        vals = d[expert, pos].float()
        vals.mul_(recv_w.flatten()[order][:, None])
        out.index_add_(0, tok, vals)
        return out.to(torch.bfloat16)

    def combine(self, routed: torch.Tensor, handle: Any, overlap: bool) -> tuple[torch.Tensor, Any]:
        prev = self.buffer.capture() if overlap else None
        combined, _, event = self.buffer.combine(
            routed, handle, previous_event=prev, async_finish=overlap, allocate_on_comm_stream=overlap
        )
        return combined, event

    def whole(self, x: torch.Tensor, layers: int) -> torch.Tensor:
        """No overlap: the whole batch, each step waiting for the one before."""
        for i in range(layers):
            a = self.attention(x)
            recv = self.dispatch(a, overlap=False)
            routed, shared = self.compute_experts(recv, a["y"])
            combined, _ = self.combine(routed, recv[4], overlap=False)
            x = combined + shared
            if i == 0:
                self.stash.update(y=a["y"], topk_idx=a["topk_idx"], topk_w=a["topk_w"], out=x)
        return x

    def tbo(self, x: torch.Tensor, layers: int) -> torch.Tensor:
        """Two micro-batches; order: attn A, attn B, dispatch A, experts A, dispatch B, combine A,
        experts B, combine B (which overlaps the next layer's attention A)."""
        half = x.shape[0] // 2
        xa, xb = x[:half], x[half:]
        pending: list[Any] = [None, None]

        def finish(i: int, x_in: torch.Tensor) -> torch.Tensor:
            if pending[i] is None:
                return x_in
            combined, event, shared = pending[i]
            event.current_stream_wait()
            return combined + shared

        for _ in range(layers):
            xa = finish(0, xa)
            aa = self.attention(xa)
            xb = finish(1, xb)
            ab = self.attention(xb)
            da = self.dispatch(aa, overlap=True)  # runs beside attention B
            ra, sa = self.compute_experts(da, aa["y"])
            db = self.dispatch(ab, overlap=True)  # runs beside experts A
            ca, ea = self.combine(ra, da[4], overlap=True)  # waits for experts A only, runs beside experts B
            pending[0] = (ca, ea, sa)
            rb, sb = self.compute_experts(db, ab["y"])
            cb, eb = self.combine(rb, db[4], overlap=True)  # runs beside the next layer's attention A
            pending[1] = (cb, eb, sb)
        return torch.cat([finish(0, xa), finish(1, xb)])


def run_tbo(rank: int, world: int, args: argparse.Namespace, report: dict[str, Any]) -> None:
    import deep_ep

    dev = torch.device("cuda", rank)
    w = Weights(args.num_experts, rank, world, args.seed, dev)
    ex = Experts(w, args.up_gemm, torch.cuda.get_device_properties(dev).multi_processor_count)
    idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    group = dist.new_group(list(range(world)))
    hidden_bytes = HIDDEN * 2  # the combine sends bf16, the larger of the two
    num_nvl_bytes = max(
        cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
        for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    )
    log(rank, f"DeepEP normal buffer: {num_nvl_bytes / 2**20:.0f} MiB NVLink, {w.num_local} local experts")
    buffer = deep_ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=0, explicitly_destroy=True)
    layer = PrefillLayer(buffer, w, ex, args.attn_width, idx_dtype, args.seed)
    rows: list[dict[str, Any]] = []
    report["tbo"] = rows
    with destroyed_at_exit(buffer, rank):
        for t in args.tokens:
            rows.append(tbo_one(rank, world, layer, t, args))
            if rank == 0:
                print_tbo_row(rows[-1])
                write_report(args.json, report)


def tbo_one(rank: int, world: int, layer: PrefillLayer, t: int, args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 31 * t + rank)
    x = torch.randn(t, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    row: dict[str, Any] = {"tokens_per_rank": t, "layers": args.layers, "variants": {}}
    outs: dict[str, torch.Tensor] = {}
    runs = {"none": lambda: layer.whole(x, args.layers), "tbo": lambda: layer.tbo(x, args.layers)}
    for name, fn in runs.items():
        res: dict[str, Any] = {"timing": "events"}
        row["variants"][name] = res
        warm = False
        try:
            out = fn()
            wait_or_die(rank, f"prefill T={t} {name} (warm-up)", args.hang_s)
            outs[name] = out
            if name == "none":
                n = min(args.ref_tokens, t)
                s = layer.stash
                ref = reference_layer(s["y"][:n], s["topk_idx"][:n], s["topk_w"][:n], layer.w)
                res["check"] = compare(s["out"][:n], ref)
                res["check"]["tokens"] = n
            else:
                res["check"] = compare(out, outs["none"])
                res["check"]["against"] = "none"
            warm = True
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            log(rank, f"prefill T={t} {name} FAILED: {res['error']}\n{traceback.format_exc()}")
        if not peers_ok(warm):
            res.setdefault("error", "skipped: a peer rank failed this variant's warm-up")
        else:
            try:
                dist.barrier()
                times = time_replays(lambda f=fn: f(), 1, args.tbo_repeats)  # type: ignore[misc]
                wait_or_die(rank, f"prefill T={t} {name} (timed)", args.hang_s)
                res["us"] = statistics.median(times) / args.layers
                res["us_min"] = min(times) / args.layers
            except Exception as exc:
                res["error"] = f"{type(exc).__name__}: {exc}"
                log(rank, f"prefill T={t} {name} FAILED: {res['error']}\n{traceback.format_exc()}")
        c = res.get("check")
        res["ok"] = "error" not in res and c is not None and c["finite"] and c["rel_err"] <= args.tol
    layer.stash.clear()
    torch.cuda.empty_cache()
    return gather_row(rank, world, row)


def print_tbo_row(r: dict[str, Any]) -> None:
    if not getattr(print_tbo_row, "header", False):
        print(f"\n{'T/rank':>6} {'layers':>6} | {'none us/layer':>13} {'tbo us/layer':>12} | {'saving %':>8} | "
              f"{'rel err (max)':>13} | ok")  # fmt: skip
        print_tbo_row.header = True  # type: ignore[attr-defined]
    v = r["variants"]

    def us(k: str) -> str:
        return f"{v[k]['us']:13.1f}" if "us" in v.get(k, {}) else f"{'-':>13}"

    errs = [x["rel_err"] for x in v.values() if x.get("rel_err") is not None]
    print(
        f"{r['tokens_per_rank']:>6} {r['layers']:>6} | {us('none')} {us('tbo')[1:]} | "
        f"{r['saving_pct'].get('tbo', float('nan')):8.1f} | {max(errs) if errs else float('nan'):13.2e} | "
        f"{'yes' if all(x['ok'] for x in v.values()) else 'NO'}",
        flush=True,
    )
    for k, x in v.items():
        if "error" in x:
            print(f"       {k}: {x['error']}", flush=True)


# %%
# Checks before the layer runs
# ----------------------------


def self_check(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Our GEMM at the layer's shapes (the down GEMM with sglang-layout signals, in 64- and 128-row
    tiles) and the SiLU-and-mul kernel, against torch on a small problem. A failing up GEMM makes
    the layer use torch for it."""
    out: dict[str, Any] = {}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed + 5)
    e, m_max = 4, 256
    masked = torch.tensor([64, 17, 0, 200], dtype=torch.int32, device="cuda")
    rows = torch.arange(m_max, device="cuda")[None, :] < masked[:, None]
    shapes = (("up", 2 * MOE_INTER, HIDDEN, 64, False), ("down", HIDDEN, MOE_INTER, 64, True),
              ("down_tall", HIDDEN, MOE_INTER, 200, True))  # fmt: skip
    for name, n, k, expected_m, signals in shapes:
        try:
            a, a_s = quant_1x128(torch.randn(e, m_max, k, generator=gen, device="cuda"))
            wq, ws = zip(*(fp8_weight(gen, n, k, torch.device("cuda")) for _ in range(e)), strict=True)
            b, b_s = stack_fp8(list(wq)), torch.stack(ws)
            d = torch.zeros(e, m_max, n, dtype=torch.bfloat16, device="cuda")
            signal = torch.zeros(e * triton.cdiv(m_max, 64), dtype=torch.int32, device="cuda") if signals else None
            ret = sg.fp8_m_grouped_gemm_nt_masked(
                (a, a_s), (b, b_s), d, masked, expected_m, enable_overlap=signals, signal=signal, signal_layout="sglang"
            )
            ref = sg.reference_masked_grouped_gemm(a, b, masked, a_s, b_s, dtype=torch.float32)
            sel = rows[:, :, None].expand_as(ref)
            err = float((d.float()[sel] - ref[sel]).norm() / ref[sel].norm())
            res: dict[str, Any] = {"rel_err": err, "ok": err < 1e-2}
            if signal is not None:
                block_m, threshold = ret
                assert block_m is not None and threshold is not None, "an overlapped GEMM returns its pair"
                blocks = triton.cdiv(m_max, block_m)  # counter of (expert, row block) at e * blocks + row_block
                got = signal[: e * blocks].view(e, blocks).cpu()
                active = (torch.arange(blocks)[None, :] * block_m < masked.cpu()[:, None]).to(torch.int32)
                res.update(block_m=block_m, threshold=threshold, signals_ok=bool(torch.equal(got, active * threshold)))
                res["ok"] = res["ok"] and res["signals_ok"]
            out[name] = res
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            log(rank, f"self-check {name} GEMM failed:\n{traceback.format_exc()}")
    try:
        h = torch.randn(e, m_max, 2 * MOE_INTER, generator=gen, device="cuda").to(torch.bfloat16)
        q, s = silu_mul_quant(h, masked)
        rq, rs = silu_mul_quant_torch(h)
        got_act, want_act = dequant_1x128(q, s)[rows], dequant_1x128(rq, rs)[rows]
        err = float((got_act - want_act).norm() / want_act.norm())
        out["silu_mul_quant"] = {"rel_err": err, "ok": err < 1e-2}
    except Exception as exc:
        out["silu_mul_quant"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        log(rank, f"self-check silu_mul_quant failed:\n{traceback.format_exc()}")
    return out


# %%
# Report
# ------


def write_report(path: str | None, report: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(path)


def deepep_info() -> dict[str, Any]:
    import deep_ep

    info: dict[str, Any] = {"file": deep_ep.__file__}
    for candidate in (Path(deep_ep.__file__).parents[1] / "REVISION", REPO / ".gpu_bundle" / "deepep-src" / "REVISION"):
        if candidate.is_file():
            info["revision"] = candidate.read_text().strip()
            break
    params, _ = status.deepep_method_params("low_latency_combine")
    info["low_latency_combine_params"] = params
    info["signal_layout"] = status.layout_for_params(params or [])
    return info


def deepgemm_baseline(rank: int, args: argparse.Namespace, report: dict[str, Any]) -> Any:
    """DeepGEMM for the ``deepgemm`` variant on every rank, or on none (the report says why)."""
    deep_gemm, why = (None, "--no-deepgemm") if args.no_deepgemm else load_deep_gemm()
    flag = torch.tensor([int(deep_gemm is not None)], dtype=torch.int32, device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank runs the same variants
    if deep_gemm is not None and not int(flag.item()):
        deep_gemm, why = None, "deep_gemm does not import on another rank"
    info: dict[str, Any] = {"skipped": why} if deep_gemm is None else {
        "version": getattr(deep_gemm, "__version__", "?"), "file": deep_gemm.__file__,
        "num_sms": deep_gemm.get_num_sms(), "jit_cache": os.environ.get("DG_JIT_CACHE_DIR", "~/.deep_gemm"),
    }  # fmt: skip
    report["deepgemm"] = info
    if rank == 0:
        log(rank, f"DeepGEMM baseline: {info}")
    return deep_gemm


# %%
# Processes
# ---------


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(rank),
        "num_gpus": world,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "kernels_from": KERNELS_FROM,
        "mode": args.mode,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "tolerance": f"relative L2 error <= {args.tol} against the torch reference (decode: eager, and none on the "
        f"replay check's last input; prefill no-overlap), against no overlap (tbo); outputs finite; with "
        f"--replay-check, bit-equal to none after every replay and every must-fail control caught",
        "complete": False,
    }
    try:
        report["deep_ep"] = deepep_info()
        if rank == 0:
            log(rank, f"DeepEP: {report['deep_ep']}")
        checks = self_check(rank, args)
        report["self_check"] = checks
        log(rank, f"self-check: {checks}")
        if args.up_gemm == "ours" and not checks.get("up", {}).get("ok"):
            log(rank, "our GEMM failed the up/gate shape check: the up/gate GEMM falls back to torch")
            args.up_gemm = "torch"
        if not checks.get("silu_mul_quant", {}).get("ok"):
            log(rank, "the SiLU-and-mul kernel failed its check: torch computes it (over whole buffers)")
            ACT_IMPL["name"] = "torch"
        flags = torch.tensor([int(args.up_gemm == "torch"), int(ACT_IMPL["name"] == "torch")], device="cuda")
        dist.all_reduce(flags)  # every rank must run the same implementations
        if int(flags[0]):
            args.up_gemm = "torch"
        if int(flags[1]):
            ACT_IMPL["name"] = "torch"
        report["up_gemm"], report["silu_mul_quant"] = args.up_gemm, ACT_IMPL["name"]
        if args.mode == "decode":
            deep_gemm = deepgemm_baseline(rank, args, report)
            run_decode(rank, world, args, report, deep_gemm)
        else:
            run_tbo(rank, world, args, report)
        report["complete"] = True
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        log(rank, f"FAILED: {report['error']}\n{traceback.format_exc()}")
        raise
    finally:
        if rank == 0:
            write_report(args.json, report)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=("decode", "tbo"), default="decode")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=None,
                   help="tokens per rank, comma-separated (decode: 8,16,32,64,128; tbo: 4096,16384)")  # fmt: skip
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--gpus", type=int, default=0, help="processes, one per GPU (default: all visible)")
    p.add_argument("--combine-sms", type=lambda s: [int(v) for v in s.split(",")], default=[3],
                   help="SMs for DeepEP's combine-send in full SBO, comma-separated: one full@S variant each "
                   "(sglang's Hopper default: 3); the first is the one the replay check's controls use")  # fmt: skip
    p.add_argument(
        "--full-alt",
        action="store_true",
        help="also time full_alt@S per --combine-sms: full SBO, the shared expert on the alternate stream",
    )
    p.add_argument(
        "--max-block-n",
        type=int,
        choices=(160, 256),
        default=256,
        help="the overlapped down GEMM's widest N tile rule: 256, or 160 = sglang's H20 rule (160 at "
        "expected_m <= 64, else 256)",
    )
    p.add_argument("--up-gemm", choices=("ours", "torch"), default="ours",
                   help="up/gate GEMM: our masked FP8 kernel, or torch on dequantized bf16 weights")  # fmt: skip
    p.add_argument("--iters", type=int, default=20, help="decode: graph replays per timing")
    p.add_argument("--repeats", type=int, default=15, help="decode: timings (median)")
    p.add_argument("--tbo-repeats", type=int, default=5, help="tbo: timings of --layers layers (median)")
    p.add_argument("--layers", type=int, default=3, help="tbo: chained layers per timing")
    p.add_argument("--attn-width", type=int, default=24576, help="tbo: inner width of the attention stand-in")
    p.add_argument("--ref-tokens", type=int, default=64, help="tbo: tokens per rank checked against the reference")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--no-graph", action="store_true", help="decode: time eagerly")
    p.add_argument("--replay-check", type=int, default=0, metavar="N",
                   help="decode: N replays on fresh inputs with poisoned outputs, every variant compared bit for bit "
                   "with none after each, plus the must-fail control (0: off)")  # fmt: skip
    p.add_argument("--no-deepgemm", action="store_true", help="decode: leave out the deepgemm variant")
    p.add_argument("--hang-s", type=float, default=60.0, help="a step not done after this long is reported as hung")
    p.add_argument("--deadline-s", type=float, default=0, help="stop all ranks after this many seconds (0: none)")
    p.add_argument("--port", type=int, default=27311)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.tokens = args.tokens or list(DECODE_TOKENS if args.mode == "decode" else TBO_TOKENS)
    world = args.gpus or torch.cuda.device_count()
    if world < 1:
        raise SystemExit("this benchmark needs a GPU; none is visible")
    if args.num_experts % world or args.num_experts % N_GROUP or args.num_experts // N_GROUP * TOPK_GROUP < TOP_K:
        raise SystemExit(f"--num-experts {args.num_experts}: must divide by {world} GPUs and {N_GROUP} groups, "
                         f"with at least {TOP_K} experts in the top {TOPK_GROUP} groups")  # fmt: skip
    if len(set(args.combine_sms)) != len(args.combine_sms) or min(args.combine_sms) < 1:
        raise SystemExit(f"--combine-sms {args.combine_sms}: give distinct positive SM counts, e.g. 3,8,16,24,32")
    if args.replay_check < 0:
        raise SystemExit(f"--replay-check {args.replay_check}: give a number of replays, or 0 to leave the check out")
    if args.mode == "decode" and max(args.tokens) > MAX_DISPATCH_TOKENS:
        raise SystemExit(f"decode tokens per rank must be <= {MAX_DISPATCH_TOKENS} (DeepEP's dispatch budget)")
    if world % 8:
        # DeepEP's layered low-latency dispatch (this revision's default) sizes buffers by nodes of 8 GPUs.
        os.environ["DEEPEP_DISABLE_LL_DISPATCH_OPT"] = "1"
    print(
        f"bench_moe_layer: mode {args.mode}, {world} GPUs, tokens/rank {args.tokens}, kernels from {KERNELS_FROM}",
        flush=True,
    )
    ctx = mp.start_processes(worker, args=(world, args, args.port), nprocs=world, join=False, start_method="spawn")
    start = time.monotonic()
    try:
        while not ctx.join(timeout=5):
            if args.deadline_s and time.monotonic() - start > args.deadline_s:
                print(f"bench_moe_layer: deadline of {args.deadline_s:.0f} s reached; stopping the ranks", flush=True)
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.kill()
                mark_incomplete(args.json, f"stopped at the {args.deadline_s:.0f} s deadline")
                raise SystemExit(124)
    except mp.ProcessExitedException as exc:
        mark_incomplete(args.json, f"a rank exited: {exc}")
        raise SystemExit(f"bench_moe_layer: {exc}") from None
    except mp.ProcessRaisedException as exc:
        mark_incomplete(args.json, "a rank raised (see its traceback above)")
        raise SystemExit(f"bench_moe_layer: a rank raised:\n{exc}") from None


def mark_incomplete(path: str | None, why: str) -> None:
    if not path:
        return
    try:
        report = json.loads(Path(path).read_text()) if Path(path).is_file() else {"command": " ".join(sys.argv)}
    except ValueError:
        report = {"command": " ".join(sys.argv)}
    report["complete"] = False
    report["aborted"] = why
    write_report(path, report)


if __name__ == "__main__":
    main()
