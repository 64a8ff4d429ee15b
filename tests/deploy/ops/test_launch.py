"""`sglang-pd launch`: node rank and leader from LeaderWorkerSet's env, pod checks, dry run."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

import pytest
import yaml

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.common import node
from sglang_pd.deploy.common.contract import ENV_ROUTER_WORKER_API_KEY, ENV_WORKER_API_KEY
from sglang_pd.deploy.common.node import CAP_IPC_LOCK, has_capability
from sglang_pd.deploy.ops import launch
from sglang_pd.deploy.ops.group import LeaderPort
from sglang_pd.deploy.ops.keyfile import CONFIG_FLAG, KEY_FILE_SHOWN
from sglang_pd.deploy.ops.launch import (
    API_KEY_FLAG,
    BOOTSTRAP_IFNAME_ENVS,
    LaunchError,
    bootstrap_interface,
    pod_checks,
    pod_settings_from_env,
    resolve_command,
)
from sglang_pd.deploy.ops.netif import interface_addresses, interface_of
from sglang_pd.deploy.sglang.render import render_node
from sglang_pd.deploy.spec.topology import PRESETS_DIR, PodSettings, load_topology

PRESET_DIR = PRESETS_DIR
R1 = PRESET_DIR / "deepseek-r1-h200-1p1d.yaml"
LWS = {"LWS_LEADER_ADDRESS": "decode-0.decode.llm", "LWS_GROUP_SIZE": "2"}


@pytest.fixture(scope="module")
def r1():
    return load_topology(R1)


@pytest.mark.parametrize("rank", [0, 1])
def test_multi_node_rank_and_leader_from_lws(r1, rank) -> None:
    cmd = resolve_command(r1, "decode", {**LWS, "LWS_WORKER_INDEX": str(rank)})
    assert cmd.argv == render_node(r1, "decode", node_rank=rank, leader_host="decode-0.decode.llm").argv
    assert cmd.argv[cmd.argv.index("--dist-init-addr") + 1] == "decode-0.decode.llm:5000"


def test_single_node_role_needs_no_lws(r1) -> None:
    assert resolve_command(r1, "prefill", {}).argv == render_node(r1, "prefill").argv


def test_missing_lws_env_is_explained(r1) -> None:
    with pytest.raises(LaunchError, match=r"decode spans 2 nodes but LWS_LEADER_ADDRESS, LWS_WORKER_INDEX"):
        resolve_command(r1, "decode", {})


def test_group_size_must_match_topology(r1) -> None:
    with pytest.raises(LaunchError, match=r"LWS_GROUP_SIZE=4 but the topology's decode.nodes=2"):
        resolve_command(r1, "decode", {**LWS, "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "0"})


def test_worker_index_out_of_range(r1) -> None:
    with pytest.raises(LaunchError, match=r"LWS_WORKER_INDEX=2 is outside 0..1"):
        resolve_command(r1, "decode", {**LWS, "LWS_WORKER_INDEX": "2"})


def test_pod_checks_name_the_fix(r1, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    checks = {c.name: c for c in pod_checks(r1, "decode")}
    assert {"gpus", "shm", "memlock", "rdma"} <= set(checks)
    assert not checks["gpus"].ok
    assert checks["gpus"].detail == (
        "2 GPU(s) visible (CUDA_VISIBLE_DEVICES), topology needs 8 per node; the pod must request 8 GPUs "
        "(hardware.gpus_per_node)"
    )
    # This machine has no InfiniBand: the RDMA check fails and says how to expose it.
    if not Path("/sys/class/infiniband").is_dir():
        assert not checks["rdma"].ok and "rdma.mode" in checks["rdma"].detail
    assert pod_checks(r1, "router") == []


def _this_machines_address() -> tuple[str, str]:
    """(interface, address): a non-loopback IPv4 address one of this machine's interfaces holds."""
    found = [(n, a) for n, addrs in interface_addresses().items() for a in addrs if "." in a and a != "127.0.0.1"]
    if not found:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return found[0]


def test_dry_run_prints_argv_env_and_checks(capsys, monkeypatch) -> None:
    name, address = _this_machines_address()
    for k, v in {**LWS, "LWS_WORKER_INDEX": "1", "SGLANG_HOST_IP": address}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    # No GPUs or IB devices here: the dry run prints what it would run, and fails as the start would.
    assert main(["launch", "--role", "decode", "--topology", str(R1), "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert "error: 2 pod check(s) failed; fix them or pass --skip-checks." in err
    doc = json.loads(out)
    # The role's env is the renderer's; what launch adds at start is shown apart (interface, group).
    rendered = render_node(load_topology(R1), "decode", node_rank=1, leader_host="decode-0.decode.llm")
    assert doc["node_rank"] == 1 and doc["env"] == rendered.env
    assert doc["env"]["SGLANG_PD_SBO_MODE"] == "full"
    assert doc["argv"][doc["argv"].index("--node-rank") + 1] == "1"
    assert {"gpus", "shm", "memlock", "rdma", "bootstrap-interface"} <= {c["name"] for c in doc["checks"]}
    # The interface that holds the pod's address, added at start apart from the role's env.
    assert doc["interface"] == {
        "name": name,
        "address": address,
        "source": "SGLANG_HOST_IP",
        "env": {**dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, name), "SGLANG_ZMQ_SOURCE_IP": address},
    }


def test_failed_checks_stop_the_launch(capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert main(["launch", "--role", "prefill", "--topology", str(R1)]) == 1
    err = capsys.readouterr().err
    assert "pod check gpus: FAILED: 1 GPU(s) visible (CUDA_VISIBLE_DEVICES), topology needs 8 per node" in err
    assert "pod check(s) failed; fix them or pass --skip-checks" in err


def test_router_role_passes_its_flags(capsys) -> None:
    assert main(["launch", "--role", "router", "--topology", str(R1), "--dry-run", "--", "--kubernetes"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["argv"] == ["-m", "sglang_pd.deploy.cli", "router", "--topology", str(R1), "--kubernetes"]
    assert doc["python"] == sys.executable
    assert doc["checks"] == []


def test_invalid_topology_is_refused(tmp_path, capsys) -> None:
    text = R1.read_text().replace("ep: 16", "ep: 8")
    (tmp_path / "t.yaml").write_text(text)
    assert main(["launch", "--role", "decode", "--topology", str(tmp_path / "t.yaml"), "--dry-run"]) == 1
    assert "decode.ep: DeepEP is the all-to-all" in capsys.readouterr().err


# Tests that start the launch leave this machine's netfilter rules alone; the rules themselves are
# tested in a network namespace of their own (tests/deploy/kv/test_firewall.py).
NO_FIREWALL = "--no-kv-firewall"


# --- the Mooncake ports' rules: named peers, shown by --dry-run, required at start ----------------


def test_dry_run_shows_the_kv_rules_it_would_install(capsys, monkeypatch) -> None:
    from sglang_pd.deploy.kv.firewall import ENV_POD_NAME, ENV_RELEASE, pod_chain

    monkeypatch.setenv(ENV_POD_NAME, "llm-prefill-0")  # as the chart's downward API sets them
    monkeypatch.setenv(ENV_RELEASE, "ns/llm")
    argv = ["launch", "--role", "prefill", "--topology", str(R1), "--dry-run", "--skip-checks"]  # no GPUs here
    assert main([*argv, "--kv-peers", "p.llm, d.llm", "--kv-allow-from", "10.20.0.0/16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_firewall"]["chain"] != pod_chain("prefill", "llm-prefill-1", "ns/llm")  # each pod its own
    assert doc["kv_firewall"] == {
        "chain": pod_chain("prefill", "llm-prefill-0", "ns/llm"),
        "ports": "15000-17000",
        "peers": ["p.llm", "d.llm"],
        "allow_from": ["10.20.0.0/16"],
    }
    assert main([*argv, NO_FIREWALL]) == 0
    assert json.loads(capsys.readouterr().out)["kv_firewall"] == {"off": True}
    assert main([*argv]) == 1  # a dry run reports the problem, and fails as the start would
    out, err = capsys.readouterr()
    assert "would accept no peer" in json.loads(out)["kv_firewall"]["problem"]
    assert "error: the Mooncake ports of this engine would accept no peer" in err
    assert main(["launch", "--role", "router", "--topology", str(R1), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_firewall"] is None  # the router opens no KV port


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "error: the Mooncake ports of this engine would accept no peer: name the PD engines"),
        (["--kv-allow-from", "10.0.0.0/33"], "error: --kv-allow-from: '10.0.0.0/33' is not an address or CIDR"),
    ],
    ids=["no-peer", "bad-range"],
)
def test_an_engine_without_valid_peers_does_not_start(monkeypatch, capsys, flags, message) -> None:
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    started: list[tuple] = []
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: started.append(a))
    monkeypatch.setattr(launch, "supervise", lambda *a, **k: started.append(a) or 0)
    assert main(["launch", "--role", "prefill", "--topology", str(R1), *flags]) == 1
    assert started == [] and message in capsys.readouterr().err


def test_an_http_port_inside_the_kv_range_is_refused(monkeypatch, capsys, tmp_path) -> None:
    t = yaml.safe_load(R1.read_text())
    t["prefill"]["port"] = 15500
    path = tmp_path / "r1.yaml"
    path.write_text(yaml.safe_dump(t))
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: pytest.fail("sglang started"))
    argv = ["launch", "--role", "prefill", "--topology", str(path), "--kv-allow-from", "10.0.0.0/8"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: the prefill engine's HTTP port 15500 lies in Mooncake's port range 15000-17000" in err


def test_without_the_rules_the_launch_says_the_ports_are_open(monkeypatch, capsys) -> None:
    rc, _, how = _start_prefill(monkeypatch)
    assert rc == 0 and how == [("exec",)]
    assert "warning: --no-kv-firewall: the Mooncake ports (TCP 15000-17000) accept every source" in (
        capsys.readouterr().err
    )


# --- locked memory: CAP_IPC_LOCK lets RDMA pin past RLIMIT_MEMLOCK ---------------------------------

STATUS = "Name:\tpython3\nCapInh:\t0000000000000000\nCapPrm:\t{cap}\nCapEff:\t{cap}\nCapBnd:\t000001ffffffffff\n"


def _status(tmp_path: Path, cap: str) -> Path:
    path = tmp_path / "status"
    path.write_text(STATUS.format(cap=cap))
    return path


def test_capability_is_read_from_capeff(tmp_path) -> None:
    assert has_capability(CAP_IPC_LOCK, _status(tmp_path, "00000000a80465fb"))  # docker's default set + IPC_LOCK
    assert not has_capability(CAP_IPC_LOCK, _status(tmp_path, "00000000a80425fb"))  # docker's default set
    assert not has_capability(CAP_IPC_LOCK, tmp_path / "absent")


def _memlock_check(monkeypatch, tmp_path, limit: int, cap: str):
    monkeypatch.setattr(node.resource, "getrlimit", lambda _: (limit, limit))
    monkeypatch.setattr(launch, "PROC_STATUS", _status(tmp_path, cap))
    return {c.name: c for c in pod_checks(load_topology(R1), "decode")}["memlock"]


def test_memlock_passes_with_cap_ipc_lock(monkeypatch, tmp_path) -> None:
    check = _memlock_check(monkeypatch, tmp_path, 8 << 20, "00000000a80465fb")  # 8 MiB, a runtime default
    assert check.ok and check.required
    assert check.detail == "locked-memory limit 8388608 bytes, but CAP_IPC_LOCK lets Mooncake pin KV memory past it"


def test_memlock_without_the_capability_warns_but_does_not_stop_the_pod(monkeypatch, tmp_path, capsys) -> None:
    check = _memlock_check(monkeypatch, tmp_path, 64 << 10, "00000000a80425fb")
    assert not check.ok and not check.required
    assert "no CAP_IPC_LOCK" in check.detail and "add the IPC_LOCK capability" in check.detail
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [check])
    started: list[tuple] = []
    for name in ("execve", "execvpe"):  # the launcher replaces itself with sglang: record it instead
        monkeypatch.setattr(launch.os, name, lambda *a: started.append(a))
    assert main(["launch", "--role", "prefill", "--topology", str(R1), NO_FIREWALL]) == 0
    assert len(started) == 1  # the warning did not stop the start
    assert "pod check memlock: WARNING: locked-memory limit 65536 bytes and no CAP_IPC_LOCK" in capsys.readouterr().err


def test_memlock_large_enough_needs_no_capability(monkeypatch, tmp_path) -> None:
    assert _memlock_check(monkeypatch, tmp_path, node.resource.RLIM_INFINITY, "0000000000000000").ok


# --- RDMA device access and the chart's pod settings --------------------------------------------


def test_rdma_devices_that_cannot_be_opened_fail(monkeypatch, tmp_path) -> None:
    sysfs, dev = tmp_path / "sys", tmp_path / "dev"
    (sysfs / "mlx5_0").mkdir(parents=True)
    dev.mkdir()
    (dev / "uverbs0").write_text("")
    (dev / "uverbs0").chmod(0)
    monkeypatch.setattr(launch, "INFINIBAND_SYSFS", sysfs)
    monkeypatch.setattr(launch, "INFINIBAND_DEV", dev)
    real_open = launch.os.open

    def refuse(path, flags, *a):  # root may open a mode-0 file: refuse as the device cgroup would
        if str(path).endswith("uverbs0"):
            raise PermissionError(1, "Operation not permitted")
        return real_open(path, flags, *a)

    monkeypatch.setattr(launch.os, "open", refuse)
    checks = {c.name: c for c in pod_checks(load_topology(R1), "decode")}
    access = checks["rdma-access"]
    assert not access.ok and access.required
    assert access.detail.startswith("cannot open uverbs0 (Operation not permitted): the pod lacks device access")
    monkeypatch.setattr(launch.os, "open", real_open)
    (dev / "uverbs0").chmod(0o600)
    assert {c.name: c for c in pod_checks(load_topology(R1), "decode")}["rdma-access"].ok


def test_pod_settings_come_from_the_charts_env() -> None:
    env = {
        "SGLANG_PD_POD_RDMA_MODE": "hostNetwork",
        "SGLANG_PD_POD_PRIVILEGED": "false",
        "SGLANG_PD_POD_MODEL_SOURCE": "hub",
        "SGLANG_PD_POD_STARTUP_BUDGET_S": "1800",
        "SGLANG_PD_POD_DOWNLOAD_BYTES_PER_S": "500000000",
    }
    assert pod_settings_from_env(env) == PodSettings("hostNetwork", False, "hub", 1800, 5e8)
    assert pod_settings_from_env({}) is None  # not a chart pod: no pod rules
    with pytest.raises(LaunchError, match=r"SGLANG_PD_POD_RDMA_MODE='hostnet'"):
        pod_settings_from_env({**env, "SGLANG_PD_POD_RDMA_MODE": "hostnet"})


def test_pod_settings_that_break_a_rule_stop_the_launch(monkeypatch, capsys) -> None:
    for k, v in {
        "SGLANG_PD_POD_RDMA_MODE": "hostNetwork",
        "SGLANG_PD_POD_PRIVILEGED": "false",
        "SGLANG_PD_POD_MODEL_SOURCE": "hub",
        "SGLANG_PD_POD_STARTUP_BUDGET_S": "1800",
    }.items():
        monkeypatch.setenv(k, v)
    assert main(["launch", "--role", "prefill", "--topology", str(R1), "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "the pod's settings do not fit the topology" in err
    assert "securityContext.privileged: rdma.mode hostNetwork mounts the host's /dev/infiniband" in err
    assert (
        "prefill.startupProbe: a startup budget of 1800s (failureThreshold x periodSeconds) cannot cover a cold " in err
    )
    assert "(~3254s: download and load the weights, warm-up of 1200s)" in err


# --- the worker key: sglang gets `--api-key=KEY` from the environment at start ---------------------

WORKER_KEY = "wk-5f0c1e9a7d3b"


def _exec_prefill(monkeypatch, topology: Path = R1) -> tuple[int, list[list[str]]]:
    """Run `launch --role prefill` up to the start, recording the argv it would exec or supervise."""
    return _start_prefill(monkeypatch, topology)[:2]


def _start_prefill(monkeypatch, topology: Path = R1) -> tuple[int, list[list[str]], list[tuple[str, ...]]]:
    """As `_exec_prefill`, also recording how it started: ("exec",) or ("supervise", *secrets)."""
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    started: list[list[str]] = []
    how: list[tuple[str, ...]] = []

    def supervise(argv, env, secrets) -> int:
        started.append(list(argv))
        how.append(("supervise", *secrets))
        return 0

    def execvpe(file, argv, env) -> None:
        started.append(argv)
        how.append(("exec",))

    monkeypatch.setattr(launch.os, "execvpe", execvpe)
    monkeypatch.setattr(launch, "supervise", supervise)
    return main(["launch", "--role", "prefill", "--topology", str(topology), NO_FIREWALL]), started, how


def test_the_worker_key_is_added_from_the_env_and_sglang_then_runs_supervised(monkeypatch) -> None:
    monkeypatch.delenv(ENV_WORKER_API_KEY, raising=False)
    rc, started, how = _start_prefill(monkeypatch)
    assert rc == 0 and how == [("exec",)]  # no key, nothing to mask: sglang replaces the launcher
    assert not any(a.startswith(API_KEY_FLAG) for a in started[0])
    monkeypatch.setenv(ENV_WORKER_API_KEY, WORKER_KEY)
    rc, started, how, files = _start_prefill_reading_the_key_file(monkeypatch)
    assert rc == 0 and how == [("supervise", WORKER_KEY)]  # its output masked, the key as the secret
    argv = render_node(load_topology(R1), "prefill").argv
    # Not on the command line, which every local user reads: in a config file sglang reads.
    assert started[0][:-2] == [sys.executable, *argv] and started[0][-2] == CONFIG_FLAG
    assert not any(WORKER_KEY in a for a in started[0])
    path, mode, dir_mode, text = files[0]
    assert mode == 0o600 and dir_mode == 0o700 and yaml.safe_load(text) == {"api-key": WORKER_KEY}
    assert not path.exists() and not path.parent.exists()  # removed once sglang has exited


def _start_prefill_reading_the_key_file(monkeypatch):
    """As `_start_prefill`, also reading the key file while the stand-in for sglang runs."""
    files: list[tuple[Path, int, int, str]] = []

    def supervise(argv, env, secrets) -> int:
        path = Path(argv[argv.index(CONFIG_FLAG) + 1])
        files.append((path, path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777, path.read_text()))
        started.append(list(argv))
        how.append(("supervise", *secrets))
        return 0

    started: list[list[str]] = []
    how: list[tuple[str, ...]] = []
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    monkeypatch.setattr(launch, "supervise", supervise)
    rc = main(["launch", "--role", "prefill", "--topology", str(R1), NO_FIREWALL])
    return rc, started, how, files


def test_dry_run_masks_the_worker_key(monkeypatch, capsys) -> None:
    monkeypatch.setenv(ENV_WORKER_API_KEY, WORKER_KEY)
    argv = ["launch", "--role", "prefill", "--topology", str(R1), "--dry-run", "--skip-checks", NO_FIREWALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["argv"][-2:] == [CONFIG_FLAG, KEY_FILE_SHOWN]
    assert WORKER_KEY not in out


@pytest.mark.sglang
@pytest.mark.parametrize("key", [WORKER_KEY, 'wk-"quoted":#x\\'], ids=["key", "key-with-yaml-characters"])
def test_sglangs_own_config_reader_takes_the_key_from_the_file(monkeypatch, key) -> None:
    """sglang's own `prepare_server_args` (its --config merge, then its parser) reads the key."""
    server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed (the `validate` extra)")
    monkeypatch.setenv(ENV_WORKER_API_KEY, key)
    parsed: list[str | None] = []

    def supervise(argv, env, secrets) -> int:
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        # Parsed with sglang's argument code only (no start-up checks of the model, GPUs or ports).
        merger = _config_merger()(_sglang_parser(server_args))
        merged = merger.merge_config_with_args(argv[3:])
        parsed.append(_sglang_parser(server_args).parse_args(merged).api_key)
        return 0

    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    monkeypatch.setattr(launch, "supervise", supervise)
    assert main(["launch", "--role", "prefill", "--topology", str(R1), NO_FIREWALL]) == 0
    assert parsed == [key]


def _config_merger():
    """sglang's --config reader: srt/utils/ since 0.5.23, srt/ before."""
    try:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
    except ImportError:
        from sglang.srt.server_args_config_parser import ConfigArgumentMerger
    return ConfigArgumentMerger


def _sglang_parser(server_args) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    return parser


def test_a_key_starting_with_a_dash_is_refused_before_sglang_starts(monkeypatch, capsys) -> None:
    monkeypatch.setenv(ENV_WORKER_API_KEY, "-" + WORKER_KEY)
    rc, started = _exec_prefill(monkeypatch)
    assert rc == 1 and started == []
    assert "SGLANG_PD_WORKER_API_KEY starts with '-'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "SGLANG_PD_WORKER_API_KEY is set but empty"),
        (WORKER_KEY + "\n", "SGLANG_PD_WORKER_API_KEY contains whitespace or control characters (a trailing newline"),
    ],
    ids=["empty", "trailing-newline"],
)
def test_a_key_no_header_can_carry_refuses_the_launch(monkeypatch, capsys, key, message) -> None:
    monkeypatch.setenv(ENV_WORKER_API_KEY, key)
    rc, started = _exec_prefill(monkeypatch)
    assert rc == 1 and started == []
    assert message in capsys.readouterr().err
    monkeypatch.delenv(ENV_WORKER_API_KEY)
    monkeypatch.setenv(ENV_ROUTER_WORKER_API_KEY, key)  # the router pod's name, checked alike
    assert main(["launch", "--role", "router", "--topology", str(R1), "--dry-run"]) == 1
    assert message.replace(ENV_WORKER_API_KEY, ENV_ROUTER_WORKER_API_KEY) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--api-key", "other"], "prefill.extra_args sets --api-key and SGLANG_PD_WORKER_API_KEY is set too"),
        (["--tokenizer-worker-num=4"], "prefill.extra_args sets --tokenizer-worker-num 4, and sglang refuses an API"),
    ],
    ids=["second-key", "multi-tokenizer"],
)
def test_extra_args_that_clash_with_the_key_stop_the_launch(
    monkeypatch, capsys, preset_dict, write_topology, extra, message
) -> None:
    t = preset_dict()
    t["prefill"]["extra_args"] = extra
    path = write_topology(t)
    monkeypatch.setenv(ENV_WORKER_API_KEY, WORKER_KEY)
    rc, started = _exec_prefill(monkeypatch, path)
    assert rc == 1 and started == [] and message in capsys.readouterr().err
    monkeypatch.delenv(ENV_WORKER_API_KEY)  # without a key both are the topology's own business
    assert _exec_prefill(monkeypatch, path)[0] == 0


def test_kv_probe_and_launch_give_one_memlock_advice(monkeypatch, tmp_path) -> None:
    from sglang_pd.deploy.kv.cli import diagnose
    from sglang_pd.deploy.kv.exceptions import RegistrationRefused

    check = _memlock_check(monkeypatch, tmp_path, 64 << 10, "00000000a80425fb")
    advice = diagnose(RegistrationRefused("ibv_reg_mr failed"))
    assert advice == f"the locked-memory limit is 65536 bytes: {node.MEMLOCK_FIX}."
    assert check.detail.endswith(node.MEMLOCK_FIX)


# --- GPUs as NVIDIA's device plugin exposes them; NICs as the topology names them -----------------


def test_gpus_are_counted_from_the_devices_under_each_device_plugin_strategy(tmp_path) -> None:
    listing = tmp_path / "var/run/nvidia-container-devices"
    listing.mkdir(parents=True)
    for i in range(8):
        (listing / f"GPU-{i:08x}").write_text("")
    # volume-mounts (Bottlerocket's and EKS's default): the variable names a directory, one file per GPU.
    mounted = {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert launch.visible_gpus(mounted, tmp_path) == (
        8,
        "the device plugin's list in /var/run/nvidia-container-devices",
    )
    # envvar: the GPUs' UUIDs.
    assert launch.visible_gpus({"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, tmp_path) == (2, "NVIDIA_VISIBLE_DEVICES")
    # The toolkit's device nodes count, whatever the variable says (CUDA images set it to `all`).
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        (dev / name).write_text("")
    assert launch.visible_gpus({"NVIDIA_VISIBLE_DEVICES": "all"}, tmp_path) == (4, "/dev/nvidia<N>")
    assert launch.visible_gpus({**mounted, "CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path) == (2, "CUDA_VISIBLE_DEVICES")


def test_the_rdma_devices_nccl_gets_must_exist_on_the_node(r1, tmp_path) -> None:
    for name in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"):
        (tmp_path / "sys/class/infiniband" / name).mkdir(parents=True)
    assert {c.name: c for c in pod_checks(r1, "decode", {}, tmp_path)}["rdma"].ok
    # Mooncake's devices are right, but NCCL_IB_HCA (hardware.rdma_devices) names one the node lacks.
    t = r1.model_copy(update={"hardware": r1.hardware.model_copy(update={"rdma_devices": ["mlx5_0", "mlx5_bond_0"]})})
    rdma = {c.name: c for c in pod_checks(t, "decode", {}, tmp_path)}["rdma"]
    assert not rdma.ok and rdma.required
    assert rdma.detail.endswith(
        "; missing mlx5_bond_0 named in hardware.rdma_devices: name this node's devices "
        "(ls /sys/class/infiniband) there"
    )


def test_weights_on_a_volume_need_their_config_json_and_no_hub(r1, tmp_path) -> None:
    checks = {c.name: c for c in pod_checks(r1, "prefill", {}, tmp_path, model_source="pvc")}
    assert not checks["model"].ok
    assert checks["model"].detail.startswith(
        "model.source is pvc, but --model-path is 'deepseek-ai/DeepSeek-R1', a hub"
    )
    assert "model" not in {c.name for c in pod_checks(r1, "prefill", {}, tmp_path, model_source="hub")}


# --- the group: ranks wait for their leader; sglang's ZMQ sockets admit only the group's pods ---------


def test_a_decode_rank_waits_for_its_leader_and_admits_only_its_group(monkeypatch, capsys) -> None:
    for k, v in {**LWS, "LWS_WORKER_INDEX": "1", "SGLANG_HOST_IP": "10.0.0.12"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    # The pod's own network namespace, which this machine does not have.
    monkeypatch.setattr(launch, "interface_addresses", lambda: {"lo": ["127.0.0.1"], "eth0": ["10.0.0.12"]})
    waited: list[tuple] = []
    monkeypatch.setattr(launch, "wait_for_leader", lambda leader, timeout: waited.append((leader, timeout)))
    addresses = {"decode-0.decode.llm": "10.0.0.11", "decode-0-1.decode.llm": "10.0.0.12"}
    monkeypatch.setattr(launch, "resolve_all", lambda hosts, timeout: [addresses[h] for h in hosts])
    started: list[dict] = []
    monkeypatch.setattr(launch.os, "execvpe", lambda file, argv, env: started.append(env))
    argv = ["launch", "--role", "decode", "--topology", str(R1), NO_FIREWALL]
    assert main(argv) == 0
    # The attention-DP handshake sglang's leader opens first, never the dist-init port it opens after rank 1 joined.
    handshake = "the attention-DP handshake (dist-init port + 13)"
    assert waited == [(LeaderPort("decode-0.decode.llm", 5013, handshake), 1800.0)]
    env = started[0]
    assert env["SGLANG_ZMQ_ALLOWED_PEERS"] == "10.0.0.11,10.0.0.12,127.0.0.1"
    assert {k: env[k] for k in (*BOOTSTRAP_IFNAME_ENVS, "SGLANG_ZMQ_SOURCE_IP")} == {
        **dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, "eth0"),
        "SGLANG_ZMQ_SOURCE_IP": "10.0.0.12",
    }
    # The dry run shows the plan, names not addresses: nothing is waited for or resolved.
    assert main([*argv, "--dry-run", "--skip-checks"]) == 0
    group = json.loads(capsys.readouterr().out)["group"]
    assert group == {
        "peer_hosts": ["decode-0.decode.llm", "decode-0-1.decode.llm"],
        "also_allowed": ["127.0.0.1", "10.0.0.12"],
        "wait_for": "decode-0.decode.llm:5013",
        "wait_for_port": handshake,
    }


def test_a_leader_that_never_comes_fails_the_rank(monkeypatch, capsys) -> None:
    _, address = _this_machines_address()
    for k, v in {**LWS, "LWS_WORKER_INDEX": "1", "SGLANG_PD_GROUP_WAIT_S": "0", "SGLANG_HOST_IP": address}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch, "pod_checks", lambda *a, **k: [])
    monkeypatch.setattr(launch.os, "execvpe", lambda *a: pytest.fail("sglang started"))
    assert main(["launch", "--role", "decode", "--topology", str(R1), NO_FIREWALL]) == 1
    err = capsys.readouterr().err
    assert "error: the group's leader decode-0.decode.llm does not resolve" in err


# --- the bootstrap interface: the one named, else the one that holds the pod's address ---------------------


@pytest.fixture
def unnamed(monkeypatch):
    """This process's environment without a chart-set interface."""
    for k in (*BOOTSTRAP_IFNAME_ENVS, "SGLANG_HOST_IP"):
        monkeypatch.delenv(k, raising=False)


def test_the_interface_holding_the_pods_address_is_chosen_on_this_machine(r1, unnamed) -> None:
    # Loopback serves a single-node role; its address is no ZMQ source for connects to other pods.
    lo = bootstrap_interface(r1, {"SGLANG_HOST_IP": "127.0.0.1"}, nodes=1)
    assert (lo.name, lo.address, lo.source) == ("lo", "127.0.0.1", "SGLANG_HOST_IP")
    assert lo.env == dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, "lo")
    name, address = _this_machines_address()
    chosen = bootstrap_interface(r1, {"SGLANG_HOST_IP": address}, nodes=2)
    assert chosen.name == name and chosen.env == {
        **dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, name),
        "SGLANG_ZMQ_SOURCE_IP": address,
    }


def test_without_sglang_host_ip_the_hostnames_address_is_the_pods(r1, unnamed) -> None:
    hostname = socket.gethostname()
    try:
        address = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except OSError:
        pytest.skip(f"this machine's hostname {hostname} does not resolve")
    holder = interface_of(str(address), interface_addresses())
    if holder is None:
        pytest.skip(f"{hostname}'s address {address} is on none of this machine's interfaces")
    chosen = bootstrap_interface(r1, {}, nodes=1)
    assert (chosen.name, chosen.address, chosen.source) == (holder, address, f"hostname {hostname}")


def test_a_named_interface_is_kept(r1, unnamed) -> None:
    # The chart's (fabric.socketInterface or the topology's): nothing looked up, nothing added.
    named = bootstrap_interface(r1, {"NCCL_SOCKET_IFNAME": "bond0", "SGLANG_HOST_IP": "203.0.113.7"}, nodes=2)
    assert (named.name, named.address, named.source, named.env) == ("bond0", None, "NCCL_SOCKET_IFNAME", {})
    # The topology's, outside the chart: given to all three.
    t = r1.model_copy(update={"hardware": r1.hardware.model_copy(update={"socket_interface": "ens1f0"})})
    named = bootstrap_interface(t, {"SGLANG_HOST_IP": "203.0.113.7"}, nodes=2)
    assert named.source == "topology.hardware.socket_interface"
    assert named.env == dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, "ens1f0")


@pytest.mark.parametrize(
    ("env", "nodes", "message"),
    [
        # 203.0.113.0/24 is documentation space (RFC 5737): on no interface of this machine.
        (
            {"SGLANG_HOST_IP": "203.0.113.7"},
            1,
            "this pod's address 203.0.113.7 (SGLANG_HOST_IP) is on none of its interfaces (lo 127.0.0.1",
        ),
        (
            {"SGLANG_HOST_IP": "127.0.0.1"},
            2,
            "this pod's address 127.0.0.1 (SGLANG_HOST_IP) is a loopback address, which the group's other nodes",
        ),
        ({"SGLANG_HOST_IP": "decode-0"}, 1, "SGLANG_HOST_IP gives 'decode-0', which is not an IP address"),
    ],
    ids=["on-no-interface", "loopback-in-a-group", "not-an-address"],
)
def test_a_pod_address_no_interface_can_carry_is_refused(r1, unnamed, env, nodes, message) -> None:
    with pytest.raises(LaunchError) as info:
        bootstrap_interface(r1, env, nodes=nodes)
    assert str(info.value).startswith(message), str(info.value)
    assert "topology.hardware.socket_interface" in str(info.value) or "not an IP address" in str(info.value)


def test_the_interface_is_a_pod_check_shown_by_the_dry_run_and_required_at_start(monkeypatch, capsys, unnamed) -> None:
    argv = ["launch", "--role", "prefill", "--topology", str(R1), "--dry-run", "--skip-checks", NO_FIREWALL]
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["interface"]["name"] == "lo" and "NCCL_SOCKET_IFNAME" not in doc["env"]
    assert "pod check bootstrap-interface: ok: lo holds this pod's address 127.0.0.1 (SGLANG_HOST_IP)" in err
    monkeypatch.setenv("SGLANG_HOST_IP", "203.0.113.7")
    assert main(argv) == 0  # --skip-checks: shown, not required
    doc = json.loads(capsys.readouterr().out)
    assert doc["interface"]["problem"].startswith("this pod's address 203.0.113.7 (SGLANG_HOST_IP) is on none")
    rc, started, _ = _start_prefill(monkeypatch)
    assert rc == 1 and started == []
    err = capsys.readouterr().err
    assert "pod check bootstrap-interface: FAILED: this pod's address 203.0.113.7" in err
    assert "error: 1 pod check(s) failed; fix them or pass --skip-checks." in err
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    seen: list[dict] = []
    monkeypatch.setattr(launch.os, "execvpe", lambda file, argv, env: seen.append(env))
    assert main(["launch", "--role", "prefill", "--topology", str(R1), NO_FIREWALL]) == 0
    assert {k: seen[0][k] for k in BOOTSTRAP_IFNAME_ENVS} == dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, "lo")
