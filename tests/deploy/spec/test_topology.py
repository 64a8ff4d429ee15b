"""Topology models and cross-role rules: presets are valid; each broken rule names its field and fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sglang_pd.deploy.spec.topology import (
    PRESETS_DIR,
    PodSettings,
    SBOMode,
    TopologyError,
    check_rules,
    estimate_weight_bytes,
    load_topology,
    parse_topology,
    required_startup_s,
)

PRESET_DIR = PRESETS_DIR
PRESETS = sorted(PRESET_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_presets_are_valid(path: Path) -> None:
    report = check_rules(load_topology(path))
    assert report.errors == []
    assert report.warnings == []


def test_preset_fields(preset_dict) -> None:
    t = load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")
    assert (t.prefill.tp, t.prefill.tbo.enabled, t.decode.attn_dp_size, t.decode.ep) == (8, True, 16, 16)
    assert t.decode.sbo is SBOMode.FULL
    assert t.load_model_config()["num_attention_heads"] == 128


def test_sbo_accepts_booleans(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["sbo"] = False
    assert parse_topology(d).decode.sbo is SBOMode.OFF


def test_env_values_become_strings(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["env"] = {"EP_MIN_TOKENS_PER_PART": 1, "NCCL_DEBUG": "INFO", "X": True}
    assert parse_topology(d).decode.env == {"EP_MIN_TOKENS_PER_PART": "1", "NCCL_DEBUG": "INFO", "X": "true"}


# --- load-time errors: malformed YAML, unknown keys, wrong types -------------------------------


def test_malformed_yaml(write_topology) -> None:
    path = write_topology("name: x\nmodel: {path: [unclosed\n")
    with pytest.raises(TopologyError, match=r"malformed YAML at line \d+, column \d+"):
        load_topology(path)


def test_top_level_must_be_mapping(write_topology) -> None:
    with pytest.raises(TopologyError, match="must be a YAML mapping at the top level, got list"):
        load_topology(write_topology("- a\n- b\n"))


def test_unknown_key_names_its_path(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["sbo_mode"] = "full"
    with pytest.raises(
        TopologyError,
        match=r"decode\.sbo_mode: unknown key; decode takes attention_backend, attn_dp_size, .*fields\.md",
    ):
        parse_topology(d)


def test_wrong_type_names_its_path(preset_dict) -> None:
    d = preset_dict()
    d["prefill"]["tp"] = "eight"
    with pytest.raises(TopologyError, match=r"prefill\.tp: Input should be a valid integer.*'eight'"):
        parse_topology(d)


def test_missing_key_names_its_path(preset_dict) -> None:
    d = preset_dict()
    del d["model"]["path"]
    with pytest.raises(TopologyError, match=r"model\.path: required key is missing"):
        parse_topology(d)


def test_every_bad_key_is_reported_at_once(preset_dict) -> None:
    d = preset_dict()
    d["prefill"]["tp"] = -1
    d["router"]["decode_policy"] = "cache_aware"
    with pytest.raises(TopologyError) as info:
        parse_topology(d)
    assert "prefill.tp" in str(info.value)
    assert "router.decode_policy" in str(info.value) and "prefill only" in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(TopologyError, match="no such topology file"):
        load_topology("/nonexistent/topology.yaml")


# --- cross-role rules: one broken rule each ----------------------------------------------------


def errors_of(d: dict) -> list[str]:
    return check_rules(parse_topology(d, source_dir=PRESET_DIR)).errors


def only_error(d: dict) -> str:
    errs = errors_of(d)
    assert len(errs) == 1, errs
    return errs[0]


# (role, the fields set, how its one error starts, advice the error gives)
ONE_BROKEN_RULE = {
    "page size set twice": (
        "decode", {"extra_args": ["--page-size", "32"]},
        "decode.extra_args[0]: --page-size must be equal on prefill and decode", "set it once in model.page_size",
    ),
    "KV dtype on one role": (
        "prefill", {"extra_args": ["--kv-cache-dtype=fp8_e4m3"]},
        "prefill.extra_args[0]: --kv-cache-dtype must be equal on prefill and decode", "model.kv_cache_dtype",
    ),
    "prefill GPUs over its nodes": (
        "prefill", {"tp": 16, "ep": 16},
        "prefill.tp: 16 GPUs per instance do not fill prefill.nodes=1 x hardware.gpus_per_node=8",
        "Set prefill.tp to 8 or prefill.nodes to match",
    ),
    "attention DP not dividing TP": (
        "decode", {"attn_dp_size": 3, "max_running_requests": 300},
        "decode.attn_dp_size: 3 does not divide decode.tp=16", "",
    ),
    "DeepEP with EP below TP": (
        "decode", {"ep": 8}, "decode.ep: DeepEP is the all-to-all", "Set decode.ep to 16",
    ),
    "SBO with DeepEP normal": (
        "decode", {"deepep_mode": "normal"},
        "decode.sbo: single-batch overlap (full) overlaps DeepEP low-latency", "decode.deepep_mode: low_latency",
    ),
    "SBO without DP attention": (
        "decode", {"attn_dp_size": 1, "max_running_requests": 128},
        "decode.sbo: single-batch overlap needs DP attention on a multi-GPU decode", "",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("role", "fields", "starts", "advice"), ONE_BROKEN_RULE.values(), ids=ONE_BROKEN_RULE)
def test_one_broken_rule_is_one_error(
    preset_dict, role: str, fields: dict[str, object], starts: str, advice: str
) -> None:
    d = preset_dict()
    d[role].update(fields)
    msg = only_error(d)
    assert msg.startswith(starts)
    assert advice in msg


def test_tbo_on_decode_is_a_warning(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["tbo"] = {"enabled": True}
    report = check_rules(parse_topology(d, source_dir=PRESET_DIR))
    assert report.errors == []
    assert report.warnings[0].startswith("decode.tbo.enabled: two-batch overlap on decode cost 8-22%")


def test_dispatch_budget_covers_per_rank_batch(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["max_running_requests"] = 4096  # 256 per rank > 128
    d["decode"]["cuda_graph_max_bs"] = 128
    errs = errors_of(d)
    assert [e.split(":")[0] for e in errs] == ["decode.dispatch_token_budget", "decode.cuda_graph_max_bs"]
    msg = errs[0]
    assert msg.startswith("decode.dispatch_token_budget: 128 tokens per rank cannot hold the per-rank decode batch")
    assert "4096/16 = 256" in msg and "Raise decode.dispatch_token_budget to >= 256" in msg


def test_dispatch_budget_covers_cuda_graph_batch(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["cuda_graph_max_bs"] = 256
    d["decode"]["max_running_requests"] = 4096
    d["decode"]["dispatch_token_budget"] = 200
    errs = errors_of(d)
    assert any(e.startswith("decode.cuda_graph_max_bs: 256 exceeds decode.dispatch_token_budget=200") for e in errs)


@pytest.mark.parametrize("chunk", [None, 256, -1])
def test_a_low_latency_prefill_chunk_fits_one_dispatch(preset_dict, chunk: int | None) -> None:
    d = preset_dict("single-h200-sbo")
    d["prefill"]["chunked_prefill_size"] = chunk
    msg = only_error(d)
    assert msg.startswith("prefill.chunked_prefill_size: ")
    assert "one DeepEP low-latency dispatch of at most 128 tokens a rank" in msg
    assert "Set prefill.chunked_prefill_size to at most 128, or prefill.deepep_mode: normal." in msg


def test_a_normal_mode_prefill_takes_any_chunk(preset_dict) -> None:
    d = preset_dict("single-h200-sbo")
    d["prefill"].update(deepep_mode="normal", chunked_prefill_size=4096)
    assert errors_of(d) == []


def test_dispatch_budget_is_not_set_through_env(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["env"] = {"SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "64"}
    assert only_error(d).startswith(
        "decode.env.SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK: set decode.dispatch_token_budget instead"
    )


def test_bootstrap_port_is_set_once(preset_dict) -> None:
    d = preset_dict()
    d["prefill"]["extra_args"] = ["--disaggregation-bootstrap-port", "9000"]
    msg = only_error(d)
    assert msg.startswith(
        "prefill.extra_args[0]: --disaggregation-bootstrap-port is rendered from prefill.bootstrap_port"
    )


def test_bootstrap_port_differs_from_http_port(preset_dict) -> None:
    d = preset_dict()
    d["prefill"]["bootstrap_port"] = port = d["prefill"]["port"]
    assert only_error(d).startswith(f"prefill.bootstrap_port: {port} equals prefill.port")


def test_local_ports_must_not_collide(preset_dict) -> None:
    d = preset_dict("local-cpu")
    d["decode"]["port"] = d["prefill"]["bootstrap_port"]
    assert (
        only_error(d)
        == "decode.port: port 8998 is also used by prefill.bootstrap_port on this host; choose another port."
    )


def test_colocated_roles_share_one_node_and_its_ports(preset_dict) -> None:
    d = preset_dict("single-h200")
    d["decode"].update(nodes=2, tp=2)
    assert only_error(d) == (
        "decode.nodes: 2, but hardware.colocated puts all on one node; "
        "set decode.nodes: 1 or hardware.colocated: false."
    )
    d = preset_dict("single-h200")
    d["decode"]["port"] = d["prefill"]["port"]
    assert only_error(d).startswith("decode.port: port 30000 is also used by prefill.port on this host")


def test_heads_divisible_by_attention_tp(preset_dict, write_topology, tmp_path) -> None:
    d = preset_dict()
    d["prefill"]["attn_dp_size"] = 1  # attention TP 8
    config = {"num_attention_heads": 20, "n_routed_experts": 256}
    (tmp_path / "odd.json").write_text(json.dumps(config))
    d["model"]["config_json"] = "odd.json"
    t = load_topology(write_topology(d))
    errs = check_rules(t).errors
    assert len(errs) == 1
    assert errs[0].startswith("prefill.attn_dp_size: attention TP = tp / attn_dp_size = 8 does not divide")
    assert "num_attention_heads=20" in errs[0]


def test_experts_divisible_by_ep(preset_dict, write_topology, tmp_path) -> None:
    d = preset_dict()
    (tmp_path / "odd.json").write_text(json.dumps({"num_attention_heads": 128, "n_routed_experts": 24}))
    d["model"]["config_json"] = "odd.json"
    errs = check_rules(load_topology(write_topology(d))).errors
    assert errs == ["decode.ep: 16 does not divide the model's 24 routed experts; choose ep among the divisors of 24."]


def test_missing_config_json(preset_dict, write_topology) -> None:
    d = preset_dict()
    d["model"]["config_json"] = "absent.json"
    t = load_topology(write_topology(d))
    # An error among the others (all reported in one pass), no longer raised alone.
    [error] = check_rules(t).errors
    assert re.match(r"model\.config_json: file .*absent\.json does not exist", error), error


def test_ib_device_gpu_index_in_range(preset_dict) -> None:
    d = preset_dict()
    d["transfer"]["ib_devices"][9] = "mlx5_0"
    assert only_error(d) == "transfer.ib_devices.9: GPU index out of range 0..7."


# --- rules that keep a deployment doing what the topology asks --------------------------------


def test_cuda_graphs_must_cover_the_per_rank_decode_batch(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["cuda_graph_max_bs"] = 64  # 2048 requests over 16 ranks = 128 per rank
    msg = only_error(d)
    assert msg.startswith("decode.cuda_graph_max_bs: 64 is below the per-rank decode batch")
    assert "2048/16 = 128" in msg and "Set decode.cuda_graph_max_bs: 128" in msg


def test_unset_cuda_graph_size_is_a_warning_with_the_value(preset_dict) -> None:
    d = preset_dict()
    del d["decode"]["cuda_graph_max_bs"]
    report = check_rules(parse_topology(d, source_dir=PRESET_DIR))
    assert report.ok
    assert report.warnings == [
        "decode.cuda_graph_max_bs: unset, so sglang sizes graphs from GPU memory; the per-rank decode batch is 128 "
        "(max_running_requests / attn_dp_size). Set decode.cuda_graph_max_bs: 128."
    ]


@pytest.mark.parametrize(
    ("gpu", "runner", "wanted"), [("H200", "auto", "deep_gemm"), ("B200", "deep_gemm", "flashinfer_cutedsl")]
)
def test_full_sbo_needs_the_runner_sglang_overlaps(preset_dict, gpu, runner, wanted) -> None:
    d = preset_dict()
    d["hardware"]["gpu"] = gpu
    d["decode"]["moe_runner_backend"] = runner
    msg = only_error(d)
    assert msg.startswith("decode.moe_runner_backend: sbo: full overlaps the down GEMM with combine only when")
    assert f"--moe-runner-backend {wanted} on {gpu}, but it is {runner}" in msg
    assert f"Set decode.moe_runner_backend: {wanted}, or decode.sbo: shared-only." in msg
    d["decode"]["sbo"] = "shared-only"
    assert errors_of(d) == []


def test_page_forcing_attention_backend_would_split_page_sizes(preset_dict) -> None:
    d = preset_dict()
    d["model"]["page_size"] = 32
    d["decode"]["attention_backend"] = "flashmla"
    msg = only_error(d)
    assert msg.startswith("decode.attention_backend: flashmla takes 64-token pages and sglang would change")
    assert "Set model.page_size: 64" in msg


def test_host_network_rdma_needs_device_access(preset_dict) -> None:
    t = parse_topology(preset_dict(), source_dir=PRESET_DIR)
    errs = check_rules(t, PodSettings(rdma_mode="hostNetwork", privileged=False)).errors
    assert len(errs) == 1
    assert errs[0].startswith("securityContext.privileged: rdma.mode hostNetwork mounts the host's /dev/infiniband")
    assert "Leave securityContext.privileged unset (automatic) or true, or set rdma.mode=devicePlugin" in errs[0]
    assert check_rules(t, PodSettings(rdma_mode="hostNetwork", privileged=True)).ok
    assert check_rules(t, PodSettings(rdma_mode="devicePlugin", privileged=False)).ok


def test_hub_download_needs_a_startup_budget_that_covers_the_model(preset_dict) -> None:
    t = parse_topology(preset_dict(), source_dir=PRESET_DIR)
    need = required_startup_s(estimate_weight_bytes(t.load_model_config() or {}), "hub")
    errs = check_rules(t, PodSettings(model_source="hub", startup_budget_s=1800)).errors
    assert len(errs) == 1
    assert errs[0].startswith(
        f"startupProbe: a startup budget of 1800s (failureThreshold x periodSeconds) cannot cover a cold start of "
        f"this model (~{need}s: download and load the weights, warm-up of 1200s)"
    )
    assert f"so that the budget is >= {need}s" in errs[0] and "model.source=pvc or hostPath" in errs[0]
    assert check_rules(t, PodSettings(model_source="hub", startup_budget_s=need)).ok
    # From a volume there is nothing to download: 35 minutes cover a 1 GB/s read and the warm-up.
    assert check_rules(t, PodSettings(model_source="pvc", startup_budget_s=2100)).ok
    # The chart's own figures, when it passes them, are the ones checked: a 300 s warm-up fits 1800 s.
    lowered = PodSettings(model_source="hub", startup_budget_s=1800, warmup_s=300, weight_bytes=400_000_000_000)
    assert required_startup_s(400_000_000_000, "hub", warmup_s=300) == 1500
    assert check_rules(t, lowered).ok


def test_weight_estimate_matches_the_published_checkpoint(preset_dict) -> None:
    t = parse_topology(preset_dict(), source_dir=PRESET_DIR)
    # DeepSeek-V3's FP8 checkpoint (163 safetensors shards) is about 689 GB on the hub.
    assert estimate_weight_bytes(t.load_model_config() or {}) == pytest.approx(689e9, rel=0.03)
    with pytest.raises(TopologyError, match="needs hidden_size and vocab_size"):
        estimate_weight_bytes({"num_hidden_layers": 2})


# --- a role's own NVSHMEM NIC-to-PE mapping (NVSHMEM's env docs: docs/cluster-prerequisites.md) -------------

PER_GPU_MAPPING = ",".join(f"mlx5_{i}:1:1" for i in range(8))


def _with_mapping(preset_dict, role: str = "decode", **env: str) -> dict:
    d = preset_dict()
    d[role]["env"] = {**d[role].get("env", {}), **env}
    return d


def test_a_complete_nic_mapping_is_accepted(preset_dict) -> None:
    d = _with_mapping(preset_dict, NVSHMEM_HCA_PE_MAPPING=PER_GPU_MAPPING, NVSHMEM_ENABLE_NIC_PE_MAPPING="1")
    assert errors_of(d) == []
    # Two GPUs per NIC, as NVSHMEM's own example writes it.
    two = "mlx5_0:1:2,mlx5_1:1:2,mlx5_2:1:2,mlx5_3:1:2"
    assert errors_of(_with_mapping(preset_dict, NVSHMEM_HCA_PE_MAPPING=two, NVSHMEM_ENABLE_NIC_PE_MAPPING="1")) == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"NVSHMEM_HCA_PE_MAPPING": "mlx5_0,mlx5_1", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"},
            "decode.env.NVSHMEM_HCA_PE_MAPPING: 'mlx5_0,mlx5_1' is not NVSHMEM's format, comma-separated "
            "hca_name:port:count entries",
        ),
        (
            {"NVSHMEM_HCA_PE_MAPPING": "mlx5_0:1:4,mlx5_1:1:2", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"},
            "decode.env.NVSHMEM_HCA_PE_MAPPING: its counts add up to 6 PEs, but a node runs "
            "hardware.gpus_per_node=8 (one PE per GPU); make the counts add up to 8.",
        ),
        (
            {"NVSHMEM_HCA_PE_MAPPING": "mlx5_0:1:4,mlx5_bond_0:1:4", "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1"},
            "decode.env.NVSHMEM_HCA_PE_MAPPING: mlx5_bond_0 not among hardware.rdma_devices (mlx5_0, mlx5_1,",
        ),
        (
            {"NVSHMEM_HCA_PE_MAPPING": PER_GPU_MAPPING},
            "decode.env.NVSHMEM_HCA_PE_MAPPING: NVSHMEM ignores the mapping unless NVSHMEM_ENABLE_NIC_PE_MAPPING=1; "
            'add NVSHMEM_ENABLE_NIC_PE_MAPPING: "1" to decode.env.',
        ),
        (
            {
                "NVSHMEM_HCA_PE_MAPPING": PER_GPU_MAPPING,
                "NVSHMEM_ENABLE_NIC_PE_MAPPING": "1",
                "NVSHMEM_HCA_LIST": "mlx5_0,mlx5_1",
            },
            "decode.env.NVSHMEM_HCA_PE_MAPPING: NVSHMEM ignores the mapping when NVSHMEM_HCA_LIST is set too; "
            "remove decode.env.NVSHMEM_HCA_LIST.",
        ),
    ],
    ids=["format", "counts", "unknown-nic", "not-enabled", "with-a-list"],
)
def test_a_nic_mapping_nvshmem_would_ignore_or_misread_is_refused(preset_dict, env: dict, message: str) -> None:
    assert only_error(_with_mapping(preset_dict, **env)).startswith(message)


def test_a_nic_mapping_under_deepep_normal_mode_across_nodes_is_refused(preset_dict) -> None:
    d = _with_mapping(preset_dict, "prefill", NVSHMEM_HCA_PE_MAPPING=PER_GPU_MAPPING, NVSHMEM_ENABLE_NIC_PE_MAPPING="1")
    assert errors_of(d) == []  # one prefill node: DeepEP's normal mode stays on NVLink, NVSHMEM picks no NIC
    d["prefill"].update(nodes=2, tp=16, ep=16, attn_dp_size=16)
    assert only_error(d).startswith(
        "prefill.env.NVSHMEM_HCA_PE_MAPPING: prefill.deepep_mode is normal, in which every GPU is the only NVSHMEM "
        "PE of its node, so the mapping would put every GPU on its first NIC; remove"
    )
