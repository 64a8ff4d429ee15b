"""`plan --estimate`: the roofline against published figures, the KV-capacity check, the CLI.

One set of constants (deploy/estimate/hardware.yaml) has to meet every published figure below
within ±20 %; the published SBO saving bounds the model's from above. Each figure names its source.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.estimate import Estimate, EstimateError, estimate_topology
from sglang_pd.deploy.estimate.hardware import load_hardware
from sglang_pd.deploy.estimate.roofline import Cost, overlap
from sglang_pd.deploy.spec.topology import Topology, load_topology, parse_topology

PRESETS = ("deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d")


def within(value: float, published: float, tolerance: float = 0.20) -> bool:
    return abs(value / published - 1) <= tolerance


def topology(
    gpu: str, memory_gib: float, prefill: dict[str, Any], decode: dict[str, Any], name: str = "figure"
) -> Topology:
    """A DeepSeek-V3 topology for a published setup, validated per field only.

    (The cross-role rules would refuse EP72 over 256 experts: sglang's redundant experts, which
    the blog's layout uses, are not a topology field; they reach sglang through extra_args.)
    """
    data = {
        "name": name,
        "model": {"path": "deepseek-ai/DeepSeek-V3", "page_size": 64, "config_json": "deepseek-v3-config.json"},
        "hardware": {"gpu": gpu, "gpu_memory_gib": memory_gib, "gpus_per_node": 8},
        "prefill": {"moe_a2a_backend": "deepep", "deepep_mode": "normal", **prefill},
        "decode": {"moe_a2a_backend": "deepep", "deepep_mode": "low_latency", **decode},
    }
    return parse_topology(data, name)


# --- DeepGEMM PR #183 / sglang PR #9660 (single-batch overlap), DeepSeek-V3 on 5 nodes of 8x H20:
# prefill TP8 per node, decode DP-attention 16 + EP16 on 2 nodes, batch 32 per rank, input 4096,
# output 1536. Output throughput of the decode group 6667.06 -> 7111.38 tok/s, mean ITL 73.11 ->
# 67.35 ms with SBO (the PR's serving benchmark, request rate 4.8).
H20_ITL_MS = {"off": 73.11, "full": 67.35}
H20_GROUP_TOK_S = {"off": 6667.06, "full": 7111.38}


def h20_sbo_pr(sbo: str) -> Topology:
    return topology(
        "H20",
        96,
        prefill={"nodes": 1, "tp": 8, "ep": 8, "tbo": {"enabled": True}, "instances": 3},
        decode={
            "nodes": 2,
            "tp": 16,
            "attn_dp_size": 16,
            "ep": 16,
            "sbo": sbo,
            "moe_runner_backend": "deep_gemm",
            "max_running_requests": 512,
            "mem_fraction_static": 0.8,
        },
    )


@pytest.mark.parametrize("sbo", ["off", "full"])
def test_h20_sbo_pr_itl_and_group_throughput(sbo: str) -> None:
    e = estimate_topology(h20_sbo_pr(sbo), input_len=4096, output_len=1536)
    assert e.decode_batch == 32
    assert within(e.decode.latency_ms, H20_ITL_MS[sbo]), e.decode.latency_ms
    group = e.decode.tokens_per_s_per_gpu * 16
    assert within(group, H20_GROUP_TOK_S[sbo]), group


def test_h20_sbo_pr_saving_is_positive_and_below_the_published() -> None:
    # The PR measured 7.9 % of the ITL. The model explains less than half of it: SBO pays the fixed cost measured
    # on one H200 (17.6 us a layer), DeepEP's fixed combine latency (20 us, assumed) stays serial, and the send hides
    # only the combine's transfer, which on H20 is short beside the 203 us down GEMM. The PR does not state its
    # send-SM count. A model above the measurement would have found gains the PR did not see; one at or below zero
    # would call its +6.7 % throughput a loss.
    e = estimate_topology(h20_sbo_pr("full"), input_len=4096, output_len=1536)
    published = 1 - H20_ITL_MS["full"] / H20_ITL_MS["off"]  # 7.9 % of the ITL
    assert 0.02 <= e.sbo_saving < published, (e.sbo_saving, published)
    off = estimate_topology(h20_sbo_pr("off"), input_len=4096, output_len=1536)
    # The saving reported is the one the ITLs show.
    assert e.sbo_saving == pytest.approx(1 - e.decode.latency_ms / off.decode.latency_ms, rel=1e-6)


def test_h20_sbo_pr_ttft_and_prefill_load_are_consistent() -> None:
    # The PR's median TTFT, 508.61 ms with SBO, includes queueing at 4.8 requests/s; its 3 prefill
    # nodes took 18,963.67 input tok/s. A request prefilled alone must be faster than that median,
    # and the prefill nodes must have had capacity to spare.
    e = estimate_topology(h20_sbo_pr("full"), input_len=4096, output_len=1536)
    assert 0.5 * 508.61 < e.prefill.latency_ms < 508.61
    assert e.prefill.tokens_per_s_per_gpu * 24 > 18_963.67
    assert e.pd_ratio < 3  # fewer prefill nodes than the PR ran would have kept up


def test_sbo_without_the_deepgemm_runner_is_only_the_shared_half_which_gains_nothing() -> None:
    full = estimate_topology(h20_sbo_pr("full"))
    t = h20_sbo_pr("full")
    auto = estimate_topology(
        t.model_copy(update={"decode": t.decode.model_copy(update={"moe_runner_backend": "auto"})})
    )
    # Without SBO the shared expert already runs on the alternate stream while the dispatch is in flight
    # (sglang's forward_deepep), so moving it into the dispatch window hides nothing more.
    assert auto.sbo is not None and auto.sbo.runs == "shared-only"
    assert auto.sbo_saving == pytest.approx(0.0, abs=1e-9) and full.sbo_saving > 0
    assert auto.decode.latency_ms > full.decode.latency_ms


# --- sglang's large-scale EP blog (lmsys.org, 2025-05-05, "Deploying DeepSeek with PD Disaggregation
# and Large-scale Expert Parallelism on 96 H100 GPUs"): prefill EP32 on 4 nodes, DP attention, TBO,
# 16,384 tokens per device, 32 redundant experts: 57,674 / 54,543 / 50,302 tok/s per node at 1k / 2k
# / 4k input. Decode EP72 on 9 nodes, DP attention, TBO, batch 256 per device, 2,000-token KV:
# 22,282 tok/s per node. TBO ablation: decode +25.5 % at 256 tokens per device, -27 % at 32.
def blog_h100(decode_batch: int = 256) -> Topology:
    def wide_ep(nodes: int, **role: Any) -> dict[str, Any]:
        """DP attention and EP over every GPU of `nodes` nodes, TBO, 32 redundant experts."""
        width = 8 * nodes
        extra = ["--ep-num-redundant-experts", "32"]
        return {"nodes": nodes, "tp": width, "attn_dp_size": width, "ep": width, "tbo": {"enabled": True},
                "extra_args": extra, **role}  # fmt: skip

    return topology(
        "H100",
        80,
        prefill=wide_ep(4, max_prefill_tokens=16384),
        decode=wide_ep(9, max_running_requests=decode_batch * 72),
    )


@pytest.mark.parametrize(("input_len", "per_node"), [(1024, 57_674), (2048, 54_543), (4096, 50_302)])
def test_blog_h100_prefill_per_node(input_len: int, per_node: float) -> None:
    e = estimate_topology(blog_h100(), input_len=input_len, output_len=100)
    assert within(e.prefill.tokens_per_s_per_gpu * 8, per_node), e.prefill.tokens_per_s_per_gpu * 8


def test_blog_h100_decode_per_node() -> None:
    e = estimate_topology(blog_h100(), input_len=2000, output_len=100)
    assert e.decode_batch == 256
    assert within(e.decode.tokens_per_s_per_gpu * 8, 22_282), e.decode.tokens_per_s_per_gpu * 8
    # EP72 decode at 256 tokens per device moves 44 MB per layer per GPU through a 400 Gb/s NIC.
    assert e.decode.bound == "all-to-all"


@pytest.mark.parametrize(("batch", "published_gain"), [(256, 0.255), (32, -0.27)])
def test_blog_h100_decode_tbo_gain_has_the_published_sign_and_size(batch: int, published_gain: float) -> None:
    e = estimate_topology(blog_h100(), input_len=2000, output_len=100, decode_batch=batch)
    gain = 1 / (1 - e.tbo_saving) - 1  # throughput gain from the ITL saving
    assert abs(gain - published_gain) <= 0.10, gain


# --- the model's structure ---------------------------------------------------------------------


def test_overlap_is_the_max_of_its_parts_when_fully_hidden() -> None:
    a, b = Cost.of("tensor FLOPs", 30.0), Cost.of("all-to-all", 50.0)
    assert overlap(a, b).total == 50.0 and overlap(a, b).bound == "all-to-all"
    assert overlap(a, b, hidden=0.0).total == 80.0
    assert overlap(a, b, hidden=0.7).total == pytest.approx(59.0)


def test_h20_decode_is_bound_by_tensor_flops() -> None:
    # 128 absorbed MLA heads on a 148 TFLOP/s GPU, and experts at 16 rows padded to wgmma's 64.
    e = estimate_topology(h20_sbo_pr("full"), input_len=4096, output_len=1536)
    assert e.decode.bound == "tensor FLOPs"


def test_prefill_attention_grows_with_input_length() -> None:
    short, long = (estimate_topology(blog_h100(), input_len=n, output_len=100) for n in (1024, 8192))
    assert long.prefill.tokens_per_s_per_gpu < short.prefill.tokens_per_s_per_gpu
    assert long.prefill.latency_ms > 4 * short.prefill.latency_ms  # TTFT: more tokens and longer rows


def test_pd_ratio_balances_request_rates() -> None:
    t = load_topology("deepseek-v3-h20-3p2d")
    e = estimate_topology(t, input_len=4096, output_len=1536)
    prefill_req_s = e.prefill.tokens_per_s_per_gpu * t.prefill.tp / 4096
    decode_req_s = e.decode.tokens_per_s_per_gpu * t.decode.tp / 1536
    assert e.pd_ratio * prefill_req_s == pytest.approx(decode_req_s)
    # Shorter outputs need more prefill per decode group.
    assert estimate_topology(t, input_len=4096, output_len=256).pd_ratio > e.pd_ratio


def test_every_profile_and_efficiency_has_a_source() -> None:
    hw = load_hardware()
    assert {"H20", "H100", "H200"} <= set(hw.gpus)
    assert all(g.source for g in hw.gpus.values())
    assert set(hw.efficiency) == set(hw.efficiency_sources) and all(hw.efficiency_sources.values())
    assert all(0 < v <= 1 for v in hw.efficiency.values())


def test_unknown_constants_are_listed_as_assumptions() -> None:
    e = estimate_topology(h20_sbo_pr("full"))
    text = " ".join(e.assumptions)
    for needle in ("1.18x the mean load", "20 us per call", "400 KiB per token", "H20 nic_gbit"):
        assert needle in text


# --- the KV-capacity check ---------------------------------------------------------------------


def expected_tokens_per_gpu(e: Estimate, memory_gib: float, fraction: float, kv_bytes: int, page: int) -> int:
    per_token = 61 * (512 + 64) * kv_bytes  # DeepSeek-V3: 61 layers, MLA latent 512 + RoPE key 64
    return int((memory_gib * 2**30 * fraction - e.kv.weights_gib * 2**30) // (per_token * page)) * page


def test_kv_capacity_from_config_dtype_page_and_fraction() -> None:
    e = estimate_topology(h20_sbo_pr("full"), input_len=4096, output_len=1536)
    assert e.kv.kv_bytes_per_token == 61 * 576 * 2  # kv_cache_dtype auto: bf16
    assert e.kv.tokens_per_gpu == expected_tokens_per_gpu(e, 96, 0.8, 2, 64)
    assert e.kv.tokens_per_gpu % 64 == 0
    # A request holds whole 64-token pages of its 5632 tokens.
    assert e.kv.tokens_needed_per_gpu == 32 * math.ceil(5632 / 64) * 64
    # EP16 puts 16 of 256 experts a layer on each GPU (38 GiB in FP8), beside 11 GiB of attention,
    # the shared experts, the dense layers and the embeddings.
    assert 50 < e.kv.weights_gib < 60
    assert e.kv.fits and not e.warnings


def test_fp8_kv_cache_doubles_the_tokens_that_fit() -> None:
    bf16 = estimate_topology(h20_sbo_pr("full"))
    t = h20_sbo_pr("full")
    fp8 = estimate_topology(t.model_copy(update={"model": t.model.model_copy(update={"kv_cache_dtype": "fp8_e4m3"})}))
    assert fp8.kv.tokens_per_gpu == pytest.approx(2 * bf16.kv.tokens_per_gpu, abs=128)


def test_a_decode_batch_beyond_kv_memory_is_flagged() -> None:
    e = estimate_topology(h20_sbo_pr("full"), input_len=4096, output_len=1536, decode_batch=128)
    assert not e.kv.fits
    assert e.kv.max_batch_per_rank < 128
    (warning,) = e.warnings
    assert "needs 720,896 tokens of KV per GPU" in warning and "at most" in warning
    assert e.as_dict()["kv_capacity"]["fits"] is False


# --- the command line --------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_estimate_json_has_the_documented_shape(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    code, out, _ = run(capsys, "plan", preset, "--estimate", "--format", "json")
    doc = json.loads(out)
    assert code == 0
    assert {"prefill", "decode", "pd_ratio", "assumptions"} <= set(doc)
    assert {"tokens_per_s_per_gpu", "ttft_ms", "bound"} <= set(doc["prefill"])
    assert {"itl_ms", "tokens_per_s_per_gpu", "bound", "sbo_saving", "tbo_saving"} <= set(doc["decode"])
    assert doc["prefill"]["tokens_per_s_per_gpu"] > 0 and doc["decode"]["itl_ms"] > 0 and doc["pd_ratio"] > 0
    assert doc["assumptions"] and all(isinstance(a, str) for a in doc["assumptions"])


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_estimate_table(capsys: pytest.CaptureFixture[str], preset: str) -> None:
    code, out, _ = run(capsys, "plan", preset, "--estimate", "--input-len", "2048", "--output-len", "512")
    assert code == 0
    assert out.startswith(f"estimate for {preset} on ")
    assert "input 2048, output 512 tokens" in out
    for needle in ("prefill ", "decode ", "TTFT", "ITL", "P:D ratio", "KV capacity", "assumptions:"):
        assert needle in out


def test_plan_estimate_flags_kv_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "plan", "deepseek-v3-h20-3p2d", "--estimate", "--decode-batch", "128")
    assert code == 0
    assert "DOES NOT FIT" in out and "warnings:" in out


def test_plan_estimate_without_a_gpu_profile_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "local-cpu", "--estimate")
    assert code == 1
    assert "no performance profile for 'cpu'" in err and "H100, H20, H200" in err


def test_plan_estimate_refuses_other_formats_and_bad_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", "deepseek-v3-h20-3p2d", "--estimate", "--format", "yaml")
    assert code == 2 and "table or JSON" in err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "deepseek-v3-h20-3p2d", "--estimate", "--decode-batch", "0"])
    assert exc.value.code == 2
    assert "expected a whole number >= 1" in capsys.readouterr().err


def test_estimate_error_is_a_topology_error() -> None:
    t = load_topology("deepseek-v3-h20-3p2d")
    no_config = t.model_copy(update={"model": t.model.model_copy(update={"config_json": None})})
    with pytest.raises(EstimateError, match=r"needs the model's config\.json"):
        estimate_topology(no_config)
