"""The renderer: each node's sglang 0.5.23 argv and env, derived from the topology alone."""

from __future__ import annotations

import json

import pytest

from sglang_pd.deploy.sglang import render
from sglang_pd.deploy.sglang.render import DIST_INIT_PORT, LEADER_HOST_FROM_ENV, render_node, render_plan
from sglang_pd.deploy.spec.rendered import RENDERED_ENV, RENDERED_FLAGS
from sglang_pd.deploy.spec.sbo_sms import rendered_send_sms
from sglang_pd.deploy.spec.topology import PRESETS_DIR, Topology, check_rules, load_topology, parse_topology

PRESET_DIR = PRESETS_DIR


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture
def r1():
    return load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml")


def test_prefill_command(r1) -> None:
    c = render_node(r1, "prefill")
    assert c.argv[:2] == ["-m", "sglang.launch_server"]  # the interpreter is the launcher's
    assert flag(c.argv, "--disaggregation-mode") == "prefill"
    assert flag(c.argv, "--disaggregation-bootstrap-port") == "8998"
    assert (flag(c.argv, "--tp-size"), flag(c.argv, "--ep-size"), flag(c.argv, "--page-size")) == ("8", "8", "64")
    assert "--enable-two-batch-overlap" in c.argv and flag(c.argv, "--tbo-token-distribution-threshold") == "0.48"
    assert flag(c.argv, "--deepep-mode") == "normal"
    # DP attention on prefill, as sglang's large-EP recipe; its LM head stays sglang's choice.
    assert flag(c.argv, "--attn-dp-size") == "8" and flag(c.argv, "--moe-dense-tp-size") == "1"
    assert "--enable-dp-lm-head" not in c.argv
    assert "--nnodes" not in c.argv
    assert "--enable-single-batch-overlap" not in c.argv
    assert "--enable-metrics" in c.argv  # the chart's PodMonitor and dashboard read sglang's metrics
    assert c.env == {}


def test_decode_commands_per_node(r1) -> None:
    nodes = render_plan(r1)["decode"]
    assert [c.node_rank for c in nodes] == [0, 1]
    for c in nodes:
        assert flag(c.argv, "--disaggregation-mode") == "decode"
        assert (flag(c.argv, "--tp-size"), flag(c.argv, "--attn-dp-size"), flag(c.argv, "--ep-size")) == (
            "16",
            "16",
            "16",
        )
        # SBO's down-GEMM/combine overlap runs only on the DeepGEMM runner (sglang's SboFlags).
        assert flag(c.argv, "--moe-runner-backend") == "deep_gemm"
        assert flag(c.argv, "--nnodes") == "2" and flag(c.argv, "--node-rank") == str(c.node_rank)
        assert flag(c.argv, "--dist-init-addr") == f"{LEADER_HOST_FROM_ENV}:{DIST_INIT_PORT}"
        assert "--enable-single-batch-overlap" in c.argv
        assert flag(c.argv, "--cuda-graph-max-bs-decode") == "128"  # 2048 requests / 16 ranks
        # Deprecated, ambiguous or abbreviated spellings are never rendered.
        assert not {"--enable-dp-attention", "--cuda-graph-max-bs", "--tp", "--ep", "--dp"} & set(c.argv)
        assert "--enable-dp-lm-head" not in c.argv  # sglang's default LM head (PR #32313)
        assert c.env == {
            "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "128",
            "SGLANG_PD_SBO_MODE": "full",
            # decode.sbo_send_sms, or its default for the GPU (deploy/spec/sbo_sms.py)
            "SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS": str(rendered_send_sms(r1)),
            # the shared expert on the alternate stream (sglang_patches/shared_stream.py)
            "SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO": "1",
        }


@pytest.mark.parametrize(("sbo", "env"), [("full", "full"), ("shared-only", "shared-only"), ("off", None)])
def test_decode_sbo_mode_reaches_the_plugin(preset_dict, sbo: str, env: str | None) -> None:
    data = preset_dict()
    data["decode"]["sbo"] = sbo
    c = render_node(parse_topology(data), "decode")
    assert c.env.get("SGLANG_PD_SBO_MODE") == env
    # only full SBO moves the shared expert to the alternate stream (sglang_patches/shared_stream.py)
    assert c.env.get("SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO") == ("1" if sbo == "full" else None)
    assert ("--enable-single-batch-overlap" in c.argv) == (env is not None)
    assert "SGLANG_PLUGINS" not in c.env  # a whitelist would switch off the image's other sglang plugins


def test_leader_address_from_launcher(r1) -> None:
    c = render_node(r1, "decode", node_rank=1, leader_host="10.1.2.3")
    assert flag(c.argv, "--dist-init-addr") == "10.1.2.3:5000"


def test_node_rank_out_of_range(r1) -> None:
    with pytest.raises(ValueError, match=r"node_rank 2 is outside 0..1 for decode.nodes=2"):
        render_node(r1, "decode", node_rank=2)


def test_h20_env_and_instances() -> None:
    t = load_topology(PRESET_DIR / "deepseek-v3-h20-3p2d.yaml")
    plan = render_plan(t)
    assert [c.instance for c in plan["prefill"]] == [0, 1, 2]
    # Only the SBO down-GEMM overlap reads SGLANG_DEEPGEMM_ON_H20 (sglang's DeepGEMM runner).
    assert all(c.env["SGLANG_DEEPGEMM_ON_H20"] == "1" for c in plan["decode"])
    assert all("SGLANG_DEEPGEMM_ON_H20" not in c.env for c in plan["prefill"])
    # In a cluster every instance is its own pod: same argv.
    assert plan["prefill"][0].argv == plan["prefill"][2].argv


def test_one_rank_all_to_all_skips_the_batch_sync() -> None:
    """sglang 0.5.17's batch sync raises for one rank: a one-GPU DeepEP server is told to skip it."""
    one_gpu = render_plan(load_topology(PRESET_DIR / "single-h200-sbo.yaml"))
    assert one_gpu["decode"][0].env["SGLANG_SCHEDULER_SKIP_ALL_GATHER"] == "1"
    assert one_gpu["prefill"][0].env["SGLANG_SCHEDULER_SKIP_ALL_GATHER"] == "1"  # the same MoE kernels
    plain = render_plan(load_topology(PRESET_DIR / "single-h200.yaml"))
    assert all("SGLANG_SCHEDULER_SKIP_ALL_GATHER" not in c.env for cmds in plain.values() for c in cmds)
    sixteen = render_plan(load_topology(PRESET_DIR / "deepseek-r1-h200-1p1d.yaml"))
    assert all("SGLANG_SCHEDULER_SKIP_ALL_GATHER" not in c.env for cmds in sixteen.values() for c in cmds)


def test_h20_env_only_with_full_sbo(preset_dict) -> None:
    d = preset_dict("deepseek-v3-h20-3p2d")
    d["decode"]["sbo"] = "shared-only"
    c = render_node(parse_topology(d, source_dir=PRESET_DIR), "decode")
    assert "SGLANG_DEEPGEMM_ON_H20" not in c.env


@pytest.mark.parametrize(
    ("field", "value", "rendered"),
    [
        ("dp_lm_head", True, ["--enable-dp-lm-head"]),
        ("attention_backend", "flashmla", ["--attention-backend", "flashmla"]),
        ("moe_runner_backend", "triton", ["--moe-runner-backend", "triton"]),
    ],
)
def test_trade_off_fields_render_their_flags(preset_dict, field, value, rendered) -> None:
    d = preset_dict()
    d["prefill"][field] = value
    argv = render_node(parse_topology(d, source_dir=PRESET_DIR), "prefill").argv
    i = argv.index(rendered[0])
    assert argv[i : i + len(rendered)] == rendered


def test_local_instances_take_consecutive_ports(preset_dict) -> None:
    d = preset_dict("local-cpu")
    d["prefill"]["instances"] = 2
    t = parse_topology(d, source_dir=PRESET_DIR)
    assert check_rules(t).errors == [
        "decode.port: port 30001 is also used by prefill.port on this host; choose another port."
    ]
    d["decode"]["port"] = 30010
    t = parse_topology(d, source_dir=PRESET_DIR)
    assert check_rules(t).ok
    prefill = render_plan(t)["prefill"]
    assert [c.port for c in prefill] == [30000, 30001]
    assert [flag(c.argv, "--disaggregation-bootstrap-port") for c in prefill] == ["8998", "8999"]
    assert all(c.env == {"MC_FORCE_TCP": "1"} for c in prefill)  # sglang and Mooncake test for "1"
    assert t.static_workers() == (
        [("http://127.0.0.1:30000", 8998), ("http://127.0.0.1:30001", 8999)],
        ["http://127.0.0.1:30010"],
    )


def test_role_env_and_extra_args_come_last(preset_dict) -> None:
    d = preset_dict()
    d["decode"]["env"] = {"EP_MIN_TOKENS_PER_PART": 1, "NCCL_IB_GID_INDEX": 3}
    d["decode"]["extra_args"] = ["--enable-eplb", "--ep-num-redundant-experts", "32"]
    c = render_node(parse_topology(d, source_dir=PRESET_DIR), "decode")
    assert c.argv[-3:] == ["--enable-eplb", "--ep-num-redundant-experts", "32"]
    assert c.env["EP_MIN_TOKENS_PER_PART"] == "1" and c.env["NCCL_IB_GID_INDEX"] == "3"


def test_ib_devices_per_gpu_as_sglang_json_map(preset_dict) -> None:
    d = preset_dict()
    d["transfer"]["ib_devices"] = {1: "mlx5_b", 0: "mlx5_a"}
    c = render_node(parse_topology(d, source_dir=PRESET_DIR), "prefill")
    # sglang 0.5.23 takes a per-GPU JSON map (validate_ib_devices / parse_ib_device_config).
    assert json.loads(flag(c.argv, "--disaggregation-ib-device")) == {"0": "mlx5_a", "1": "mlx5_b"}
    assert "'{" in c.shell()  # quoted for a shell
    d["transfer"]["ib_devices"] = {0: "bond_0", 1: "bond_0"}
    c = render_node(parse_topology(d, source_dir=PRESET_DIR), "prefill")
    assert flag(c.argv, "--disaggregation-ib-device") == "bond_0"
    d["transfer"]["protocol"] = "tcp"
    c = render_node(parse_topology(d, source_dir=PRESET_DIR), "prefill")
    assert "--disaggregation-ib-device" not in c.argv and c.env["MC_FORCE_TCP"] == "1"


def test_shell_line_quotes_values_and_expands_leader(r1) -> None:
    c = render_node(r1, "decode")
    line = c.shell()
    assert line.startswith(
        "SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO=1 "
        f"SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS={rendered_send_sms(r1)} "
        "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK=128 SGLANG_PD_SBO_MODE=full python3 -m sglang.launch_server"
    )
    assert f'--dist-init-addr "{LEADER_HOST_FROM_ENV}:5000"' in line


# --- what the renderer writes is what deploy/spec/rendered.py declares ----------------------------------


def _written(t: Topology) -> tuple[set[str], set[str]]:
    """The option names and env keys the renderer writes for `t` on its own (its roles' extra_args and env aside)."""
    options: set[str] = set()
    env: set[str] = set()
    for commands in render_plan(t).values():
        for c in commands:
            spec = t.prefill if c.role == "prefill" else t.decode
            own = c.argv[2 : len(c.argv) - len(spec.extra_args)]
            options |= {a for a in own if a.startswith("--")}
            env |= set(c.env) - set(spec.env)
    return options, env


def _every_field_set(preset_dict) -> list[Topology]:
    """Topologies that between them set every field the renderer reads, each way it renders."""
    r1 = preset_dict()
    r1["model"].update(quantization="fp8", kv_cache_dtype="fp8_e4m3")
    for role in ("prefill", "decode"):
        r1[role].update(attention_backend="fa3", dp_lm_head=True, chunked_prefill_size=4096, max_prefill_tokens=4096)
    h20 = preset_dict("deepseek-v3-h20-3p2d")
    h20["decode"]["sbo"] = "full"  # SGLANG_DEEPGEMM_ON_H20
    local = preset_dict("local-cpu")  # --host 127.0.0.1, MC_FORCE_TCP
    one_gpu = preset_dict("single-h200-sbo")  # an MoE all-to-all on one GPU
    return [parse_topology(d, source_dir=PRESET_DIR) for d in (r1, h20, local, one_gpu)]


def test_the_declared_options_and_env_are_exactly_what_the_renderer_writes(preset_dict) -> None:
    options: set[str] = set()
    env: set[str] = set()
    for t in _every_field_set(preset_dict):
        o, e = _written(t)
        options |= o
        env |= e
    assert options == set(RENDERED_FLAGS)
    assert env == set(RENDERED_ENV)


def test_the_renderer_cannot_write_an_undeclared_option_or_env_key() -> None:
    with pytest.raises(KeyError, match=r"--not-declared is not in RENDERED_FLAGS \(deploy/spec/rendered.py\)"):
        render._opt("--not-declared", "1")
    with pytest.raises(KeyError, match=r"NOT_DECLARED is not in RENDERED_ENV"):
        render._export({}, "NOT_DECLARED", "1")
    assert render._opt("--page-size", "64") == ["--page-size", "64"]
