"""The chart and `sglang-pd launch` together: each documented value set rendered, every GPU pod's filesystem and
environment laid out as Kubernetes, LWS and NVIDIA's device plugin would (pod_fs.py), and the container's own
command run in it with --dry-run. What the chart accepts must start; what launch refuses, the chart refuses first,
in the same words."""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from sglang_pd.deploy.cli import build_parser
from sglang_pd.deploy.cli import main as cli_main
from sglang_pd.deploy.ops import launch
from sglang_pd.deploy.ops.group import GroupWaitError, LeaderPort, wait_for_leader
from sglang_pd.deploy.spec.topology import TopologyError
from tests.support.polling import free_port, wait_until

from .conftest import PRESETS, helm_python, one, preset_topology
from .pod_fs import GpuPod, Node, gpu_pods, lay_out, mount_config_maps
from .test_chart import CUSTOM_KINDS, K8S_VERSIONS, LWS_SCHEMA, as_pod, lws_pod_templates

pytestmark = pytest.mark.slow

CONFIG = (PRESETS / "deepseek-v3-config.json").read_text()
WEIGHTS = {"config.json": CONFIG}
SECRETS = {"wk": {"worker-key": "wk-5f0c1e9a7d3b"}}


def _custom_topology() -> dict[str, Any]:
    """A user's own topology, naming its own model config (not one the chart ships)."""
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["name"] = "my-r1"
    t["model"]["config_json"] = "my-config.json"
    return t


# Every value set the README and docs/kubernetes.md document, on a node prepared as
# docs/cluster-prerequisites.md asks (GPUs, RDMA NICs named as the topology names them, weights on the volume).
SCENARIOS: dict[str, tuple[dict[str, Any], Node]] = {
    "defaults": ({}, Node()),
    "rdma-device-plugin": ({"rdma": {"mode": "devicePlugin"}}, Node()),
    "pvc": ({"model": {"source": "pvc", "pvc": {"claimName": "weights"}}}, Node(volume_files=WEIGHTS)),
    "pvc-subdirectory": (
        {"model": {"source": "pvc", "pvc": {"claimName": "weights"}, "path": "/models/DeepSeek-R1"}},
        Node(volume_files={"DeepSeek-R1/config.json": CONFIG}),
    ),
    "hostPath": ({"model": {"source": "hostPath", "hostPath": {"path": "/data/r1"}}}, Node(volume_files=WEIGHTS)),
    "roce": ({"fabric": {"preset": "roce", "socketInterface": "bond0", "trafficClass": 106}}, Node()),
    "h20-preset": ({"preset": "deepseek-v3-h20-3p2d", "fabric": {"preset": "roce"}}, Node()),
    "cache-emptyDir": ({"cache": {"type": "emptyDir"}}, Node()),
    "custom-topology-and-model-config": (
        {"topology": _custom_topology(), "model": {"configFile": CONFIG, "sizeBytes": 684_386_025_472}},
        Node(),
    ),
    "custom-topology-set-file": (
        {"topology": yaml.safe_dump(_custom_topology()), "model": {"configFile": CONFIG, "sizeBytes": 700_000_000_000}},
        Node(),
    ),
    # docs/kubernetes.md's install command: the user's topology file and weights on a PVC.
    "docs-install": (
        {
            "topology": yaml.safe_dump(_custom_topology()),
            "model": {
                "source": "pvc",
                "pvc": {"claimName": "weights"},
                "configFile": CONFIG,
                "sizeBytes": 684_386_025_472,
            },
        },
        Node(volume_files=WEIGHTS),
    ),
    "lowered-warmup": ({"startupBudget": {"warmupSeconds": 300}}, Node()),
    "lowered-startup-values": (
        {
            "startupBudget": {"warmupSeconds": 300, "loadBytesPerSecond": 4_000_000_000},
            "model": {"sizeBytes": 400_000_000_000, "hub": {"downloadBytesPerSecond": 2_000_000_000}},
        },
        Node(),
    ),
    "worker-key": ({"workerKeySecret": {"name": "wk"}}, Node()),
}


# The pod's own network namespace, which this machine's kernel does not hold: pod_fs.py lays out its
# interfaces' names in /sys/class/net, this is their addresses, for launch's choice of bootstrap interface.
POD_NETWORK = {"lo": ["127.0.0.1", "::1"], "eth0": [Node().ip]}


@pytest.fixture(autouse=True)
def _pod_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "interface_addresses", lambda: POD_NETWORK)


def run_launch(
    command: list[str], root: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """The container's command with --dry-run, its files under `root`: (exit status, stdout, stderr)."""
    assert command[:2] == ["sglang-pd", "launch"], command
    args: argparse.Namespace = build_parser("launch").parse_args([*command[1:], "--dry-run", "--root", str(root)])
    try:
        rc = launch.run(args, env)
    except TopologyError as exc:  # what the CLI prints for it, with its exit status
        print(f"error: {exc}", file=sys.stderr)
        rc = 1
    out, err = capsys.readouterr()
    return rc, out, err.replace(str(root.resolve()), "").replace(str(root), "")


def _launch_pod(
    render, tmp_path: Path, capsys, values: dict[str, Any], node: Node
) -> list[tuple[GpuPod, int, str, str]]:
    docs = render(values)
    results = []
    for pod in gpu_pods(docs):
        root = tmp_path / pod.name.replace("/", "-")
        env = lay_out(root, docs, pod, node, SECRETS)
        results.append((pod, *run_launch(pod.container["command"], root, env, capsys)))
    return results


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("strategy", ["envvar", "volume-mounts"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_gpu_pod_the_chart_renders_passes_launch(render, tmp_path, capsys, scenario, strategy) -> None:
    values, node = SCENARIOS[scenario]
    node = Node(strategy=strategy, rdma_devices=node.rdma_devices, volume_files=node.volume_files)
    results = _launch_pod(render, tmp_path, capsys, copy.deepcopy(values), node)
    assert {pod.role for pod, *_ in results} == {"prefill", "decode"}
    for pod, rc, out, err in results:
        assert rc == 0, f"{pod.name}: {err}"
        doc = json.loads(out)
        assert [c for c in doc["checks"] if c["required"] and not c["ok"]] == [], pod.name
        gpus = next(c for c in doc["checks"] if c["name"] == "gpus")
        assert gpus["detail"].startswith("8 GPU(s) visible"), gpus
        argv = doc["argv"]
        source = values.get("model", {}).get("source", "hub")
        if source == "hub":
            assert not _flag(argv, "--model-path").startswith("/") and "HF_HUB_OFFLINE" not in doc["env"]
        else:
            # The weights on the volume, never a hub download; the served name stays the topology's.
            want = values["model"].get("path", "/models")
            assert _flag(argv, "--model-path") == want and doc["env"]["HF_HUB_OFFLINE"] == "1"
            assert _flag(argv, "--served-model-name") == "deepseek-r1"
            assert {c["name"]: c["ok"] for c in doc["checks"]}["model"] is True
        group = doc["group"]
        if pod.size > 1:
            # Its ZMQ sockets admit the group's pods, by LWS's names; ranks > 0 wait for the leader first (which
            # port: test_every_multi_node_group_forms_in_sglangs_start_order).
            assert group["peer_hosts"][0] == pod.leader_address and len(group["peer_hosts"]) == pod.size
            assert ("wait_for" in group) == (pod.index > 0)
        assert group["also_allowed"] == ["127.0.0.1", node.ip]
        # The bootstrap interface: the one the values name, else the one holding the pod's IP.
        named = values.get("fabric", {}).get("socketInterface")
        want = {"name": named, "address": None} if named else {"name": "eth0", "address": node.ip}
        assert {k: doc["interface"][k] for k in want} == want, doc["interface"]
        if scenario == "worker-key":
            # The key itself reaches sglang in a file written at start, never on its command line.
            assert argv[-2:] == ["--config", "<a 0600 file holding api-key, written at start>"]
            assert not any(a.startswith("--api-key") for a in argv)


def test_a_volume_without_the_weights_fails_in_the_pod(render, tmp_path, capsys) -> None:
    values = {"model": {"source": "pvc", "pvc": {"claimName": "weights"}, "path": "/models/DeepSeek-R1"}}
    for pod, rc, out, _ in _launch_pod(render, tmp_path, capsys, values, Node(volume_files=WEIGHTS)):
        assert rc == 1, pod.name
        model = {c["name"]: c for c in json.loads(out)["checks"]}["model"]
        assert model["detail"].startswith("no /models/DeepSeek-R1/config.json on the pvc volume: copy the checkpoint")


def test_placeholder_nic_names_stop_the_pod_on_a_node_that_lacks_them(render, tmp_path, capsys) -> None:
    # The H20 preset's NIC names are placeholders; on bonded RoCE NICs they are wrong, and NCCL would
    # silently fall back to sockets.
    bonded = Node(rdma_devices=("mlx5_bond_0", "mlx5_bond_1"))
    values = {"preset": "deepseek-v3-h20-3p2d", "fabric": {"preset": "roce", "socketInterface": "bond0"}}
    for pod, rc, out, _ in _launch_pod(render, tmp_path, capsys, values, bonded):
        assert rc == 1, pod.name
        rdma = {c["name"]: c for c in json.loads(out)["checks"]}["rdma"]
        assert "missing mlx5_0, mlx5_1, mlx5_2" in rdma["detail"] and "hardware.rdma_devices" in rdma["detail"]


def test_a_socket_interface_the_node_lacks_fails_the_pod(render, tmp_path, capsys) -> None:
    topology = preset_topology("deepseek-r1-h200-1p1d")
    topology["hardware"]["socket_interface"] = "ens1f0"
    for pod, rc, out, _ in _launch_pod(render, tmp_path, capsys, {"topology": topology}, Node()):
        assert rc == 1, pod.name
        check = {c["name"]: c for c in json.loads(out)["checks"]}["socket-interface"]
        assert check["detail"].startswith("NCCL_SOCKET_IFNAME=ens1f0 matches none of this pod's interfaces (bond0,")


def test_a_driver_older_than_cuda_13_needs_fails_the_pod(render, tmp_path, capsys) -> None:
    old = Node(driver="NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct  8 03:22:07 UTC 2024")
    for pod, rc, out, _ in _launch_pod(render, tmp_path, capsys, {}, old):
        assert rc == 1, pod.name
        driver = {c["name"]: c for c in json.loads(out)["checks"]}["driver"]
        assert driver["detail"].startswith("NVIDIA driver 550.127.05 is older than R580, which the image's CUDA 13")


# The CPU presets: the reference engine in place of sglang, so that the chart runs on kind or minikube. The
# GPU-only defaults (rdma.mode hostNetwork, a hostPath cache) stay as they are: they must not reach these pods.
REFERENCE_SCENARIOS: dict[str, dict[str, Any]] = {
    "local-cpu": {"preset": "local-cpu"},
    "local-cpu-mla-worker-key": {"preset": "local-cpu-mla", "workerKeySecret": {"name": "wk"}},
}


def _serve_on_free_ports(command: list[str]) -> tuple[list[str], int]:
    """The pod's command on free loopback ports (a pod has its own network namespace; tests share one)."""
    argv = list(command)
    for flag in ("--port", "--bootstrap-port"):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(free_port())
    return argv, int(_flag(argv, "--port"))


@pytest.mark.parametrize("scenario", list(REFERENCE_SCENARIOS))
def test_every_reference_pod_the_chart_renders_starts_and_answers_health(render, tmp_path, scenario) -> None:
    values = REFERENCE_SCENARIOS[scenario]
    docs = render(copy.deepcopy(values))
    pods = gpu_pods(docs)
    assert {pod.role for pod in pods} == {"prefill", "decode"}
    procs: list[tuple[GpuPod, subprocess.Popen[bytes], int, Path, dict[str, str]]] = []
    try:
        for pod in pods:
            root = tmp_path / pod.name.replace("/", "-")
            env = lay_out(root, docs, pod, Node(ip="127.0.0.1"), SECRETS)
            command, port = _serve_on_free_ports(pod.container["command"])
            assert command[:2] == ["sglang-pd", "engine"], command
            log = root / "engine.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sglang_pd.deploy.cli", *command[1:]],
                    env={**os.environ, **env},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            procs.append((pod, proc, port, log, env))
        for pod, proc, port, log, env in procs:
            key = env.get("SGLANG_PD_WORKER_API_KEY")
            headers = {"Authorization": f"Bearer {key}"} if key else {}

            def healthy(
                pod: GpuPod = pod,
                proc: subprocess.Popen[bytes] = proc,
                url: str = f"http://127.0.0.1:{port}/health",
                log: Path = log,
                headers: dict[str, str] = headers,
            ) -> bool:
                assert proc.poll() is None, f"{pod.name} exited: {log.read_text()[-3000:]}"
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(url, headers=headers, timeout=30).status_code == 200
                return False

            wait_until(healthy, timeout=240)
            if key:  # the worker key reached the engine: without it, /health is refused
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 401
            # kubelet's probes, as the pod runs them (with the worker key, an exec that sends it).
            for name in ("startupProbe", "readinessProbe"):
                probe = pod.container[name]
                if "exec" in probe:
                    python, *rest = probe["exec"]["command"]
                    assert python == "python"
                    rest[-1] = rest[-1].replace(
                        f"127.0.0.1:{_flag(pod.container['command'], '--port')}/", f"127.0.0.1:{port}/"
                    )
                    r = subprocess.run([sys.executable, *rest], env={**os.environ, **env}, timeout=60)
                    assert r.returncode == 0, f"{pod.name}: the {name} fails"
                    wrong = {**os.environ, **env, "SGLANG_PD_WORKER_API_KEY": "not-the-key"}
                    assert subprocess.run([sys.executable, *rest], env=wrong, timeout=60).returncode == 1
                else:
                    assert probe["httpGet"] == {"path": "/health", "port": "http"} and not key
    finally:
        for _, proc, *_ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, *_ in procs:
            proc.wait(timeout=30)


@pytest.mark.parametrize("scenario", list(REFERENCE_SCENARIOS))
def test_the_cpu_presets_kv_probe_pod_runs_its_command_and_passes(render, scenario) -> None:
    probe = one(render(copy.deepcopy(REFERENCE_SCENARIOS[scenario])), "Pod", "-test-kv-probe")["spec"]
    command = probe["containers"][0]["command"]
    assert command[:2] == ["sglang-pd", "kv-probe"] and "env" not in probe["containers"][0]
    r = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", *command[1:], "--format", "json", "--repeat", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"] and report["memory"] == "host"


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_cuda_visible(), reason="checks the refusal where no CUDA GPU is visible")
@pytest.mark.parametrize("scenario", ["defaults", "rdma-device-plugin", "roce", "h20-preset"])
def test_the_gpu_kv_probe_pods_command_parses_and_asks_for_gpu_memory(render, scenario) -> None:
    # Here (no GPU) its real command gets as far as the GPU buffer, and says what the pod needs.
    container = one(render(copy.deepcopy(SCENARIOS[scenario][0])), "Pod", "-test-kv-probe")["spec"]["containers"][0]
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]}}
    command = [sys.executable, "-m", "sglang_pd.deploy.cli", *container["command"][1:], "--format", "json"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["error"].startswith("GpuMemoryUnavailable: --memory gpu needs"), report


@pytest.mark.parametrize("scenario", list(REFERENCE_SCENARIOS))
def test_reference_pods_ask_for_no_gpu_rdma_host_access_or_privilege(render, scenario) -> None:
    docs = render(copy.deepcopy(REFERENCE_SCENARIOS[scenario]))
    probe = one(docs, "Pod", "-test-kv-probe")["spec"]
    specs = [pod.spec for pod in gpu_pods(docs)] + [probe]
    for spec in specs:
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], spec.get("volumes")
        for c in spec["containers"]:
            resources = json.dumps(c["resources"])
            assert "nvidia.com/gpu" not in resources and "rdma/" not in resources, c["resources"]
            assert c["securityContext"]["privileged"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # The engines and the probe run the CPU images, the probe on host memory.
    assert all(pod.container["image"].startswith("ghcr.io/sglang-pd/sglang-pd-cpu:") for pod in gpu_pods(docs))
    assert _flag(probe["containers"][0]["command"], "--memory") == "host"


@pytest.mark.parametrize("k8s", K8S_VERSIONS)
@pytest.mark.parametrize("scenario", [*SCENARIOS, *REFERENCE_SCENARIOS])
def test_every_scenario_renders_objects_kubernetes_accepts(render, scenario, k8s) -> None:
    values = SCENARIOS[scenario][0] if scenario in SCENARIOS else REFERENCE_SCENARIOS[scenario]
    for doc in render(copy.deepcopy(values)):
        if doc["kind"] == "LeaderWorkerSet":
            jsonschema.validate(doc, LWS_SCHEMA)
            for tpl in lws_pod_templates(doc).values():
                kubernetes_validate.validate(as_pod(tpl), k8s, strict=True)
        elif doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, k8s, strict=True)


def _break_budget(root: Path, env: dict[str, str]) -> None:
    env["SGLANG_PD_POD_STARTUP_BUDGET_S"] = "1800"


def _unprivileged(root: Path, env: dict[str, str]) -> None:
    env["SGLANG_PD_POD_PRIVILEGED"] = "false"


def _drop_model_config(root: Path, env: dict[str, str]) -> None:
    (root / "etc" / "sglang-pd" / "my-config.json").unlink()


def _decode_on_one_node(root: Path, env: dict[str, str]) -> None:
    path = root / "etc" / "sglang-pd" / "topology.yaml"
    t = yaml.safe_load(path.read_text())
    t["decode"]["nodes"] = 1
    path.write_text(yaml.safe_dump(t))
    env["LWS_GROUP_SIZE"], env["LWS_WORKER_INDEX"] = "1", "0"


def _typo(root: Path, env: dict[str, str]) -> None:
    path = root / "etc" / "sglang-pd" / "topology.yaml"
    t = yaml.safe_load(path.read_text())
    t["decode"]["sbo_mode"] = "full"
    path.write_text(yaml.safe_dump(t))


TYPO = preset_topology("deepseek-r1-h200-1p1d")
TYPO["decode"]["sbo_mode"] = "full"


# What launch refuses in a pod, and the values that would have given the pod that state: the chart must refuse
# those values at render time with launch's own message. Each: (refused values, accepted values, how the
# refused values would have changed the accepted pod).
CUSTOM = {"topology": _custom_topology(), "model": {"configFile": CONFIG, "sizeBytes": 684_386_025_472}}
ONE_NODE_DECODE = preset_topology("deepseek-r1-h200-1p1d")
ONE_NODE_DECODE["decode"]["nodes"] = 1
REFUSALS = {
    "startup-probe-too-short": ({"decode": {"startupProbe": {"failureThreshold": 180}}}, {}, _break_budget),
    "host-rdma-unprivileged": ({"securityContext": {"privileged": False}}, {}, _unprivileged),
    "model-config-not-shipped": (
        {"topology": _custom_topology(), "model": {"sizeBytes": 684_386_025_472}},
        CUSTOM,
        _drop_model_config,
    ),
    "decode-ep16-on-one-8-gpu-node": ({"topology": ONE_NODE_DECODE}, {}, _decode_on_one_node),
    # Helm's schema cannot look inside a string: the chart checks its keys itself.
    "typo-in-a-set-file-topology": ({"topology": yaml.safe_dump(TYPO)}, {}, _typo),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_launch_refuses_the_chart_refuses_first_in_the_same_words(chart, render, tmp_path, capsys, case) -> None:
    refused, accepted, change = REFUSALS[case]
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render(copy.deepcopy(refused), name="demo", namespace="llm")
    chart_says = str(info.value)
    docs = render(copy.deepcopy(accepted))
    pod = next(p for p in gpu_pods(docs) if p.role == "decode" and p.index == 0)
    root = tmp_path / "pod"
    env = lay_out(root, docs, pod, Node(), SECRETS)
    change(root, env)
    rc, _, err = run_launch(pod.container["command"], root, env, capsys)
    assert rc == 1
    said = [line.strip().removeprefix("- ").removeprefix("error: ") for line in err.splitlines()]
    headers = ("pod's settings do not fit", "the topology breaks", "invalid topology")
    reasons = [s for s in said if s and not any(h in s for h in headers)]
    assert reasons, err
    for reason in reasons:
        # Launch may add a "did you mean" hint that Helm's template functions cannot compute.
        words = re.sub(r" \(did you mean [^)]*\?\)", "", reason)
        assert words in chart_says, f"launch says {reason!r}; the chart says {chart_says!r}"


def test_the_plan_hook_fails_the_release_with_plans_message(render, tmp_path, capsys) -> None:
    # A rule only plan knows (sglang's SboFlags): the chart renders it, the pre-install hook refuses it.
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["decode"]["moe_runner_backend"] = "auto"
    for topology, status in ((preset_topology("deepseek-r1-h200-1p1d"), 0), (t, 1)):
        docs = render({"topology": topology})
        job = one(docs, "Job", "-plan")
        config = one(docs, "ConfigMap", "-plan")
        assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert config["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
        # The ConfigMap is created first: a pre-install hook runs before the release's own objects exist.
        weights = [int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) for d in (config, job)]
        assert weights[0] < weights[1]
        spec = job["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert "nvidia.com/gpu" not in str(container["resources"])
        root = tmp_path / str(status)
        mount_config_maps(root, docs, spec, container)
        command = container["command"]
        assert command[:2] == ["sglang-pd", "plan"]
        assert cli_main([*command[1:-1], str(root / command[-1].lstrip("/"))]) == status
        err = capsys.readouterr().err
        if status:
            assert "decode.moe_runner_backend: sbo: full overlaps the down GEMM with combine only when sglang" in err


# --- the start order of a multi-node group: launch's wait against sglang's own order ----------------------------


def _plain_tp_topology() -> dict[str, Any]:
    """The R1 preset with a decode group of plain tensor parallelism over its two nodes: no attention DP."""
    t = preset_topology("deepseek-r1-h200-1p1d")
    t["decode"].update(
        attn_dp_size=1,
        ep=1,
        moe_a2a_backend="none",
        deepep_mode="auto",
        moe_runner_backend="auto",
        sbo="off",
        max_running_requests=256,
        cuda_graph_max_bs=256,
    )
    return t


START_SCENARIOS: dict[str, tuple[dict[str, Any], Node]] = {
    **SCENARIOS,
    "plain-tp": ({"topology": _plain_tp_topology()}, Node()),
}
# A rank > 0's wait (launch's, here under its real timeout logic) gives up after this; a group that forms does
# so in about one back-off step (1 s) after its leader's sglang starts.
WAIT_S = 4.0
# LWS starts the workers once the leader pod exists; the leader's sglang may come later (its image, its checks).
LEADER_LATE_S = 0.5
_loopback = itertools.count(100)


def _launchs_wait(group: dict[str, Any], argv: list[str], translate: Translate) -> None:
    """What `launch` waits for on this pod, from its dry-run plan, through its real wait (group.py)."""
    if "wait_for" in group:
        host, port = translate(group["wait_for"])
        wait_for_leader(LeaderPort(host, port, group["wait_for_port"]), timeout_s=WAIT_S)


def _no_wait(group: dict[str, Any], argv: list[str], translate: Translate) -> None:
    """sglang's LWS example: every pod runs `python -m sglang.launch_server` at once
    (sgl-project/sglang docs/references/multi_node_deployment/lws_pd/lws-examples/d.yaml)."""


def _wait_for_dist_init(group: dict[str, Any], argv: list[str], translate: Translate) -> None:
    """The control: launch's earlier wait, for the leader's --dist-init-addr (TCP, with back-off), which sglang
    opens only once every node has joined its attention-DP handshake."""
    if "wait_for" not in group:
        return
    host, port = translate(_flag(argv, "--dist-init-addr"))
    end, delay = time.monotonic() + WAIT_S, 1.0
    while True:
        try:
            with socket.create_connection((host, port), timeout=5.0):
                return
        except OSError as exc:
            if time.monotonic() + delay > end:
                raise GroupWaitError(f"the group's leader {host}:{port} does not accept connections ({exc})") from exc
        time.sleep(delay)
        delay = min(delay * 2, 15.0)


Translate = Callable[[str], tuple[str, int]]
WAITS: dict[str, Callable[[dict[str, Any], list[str], Translate], None]] = {
    "launch": _launchs_wait,
    "none": _no_wait,
    "dist-init": _wait_for_dist_init,
}
START_CASES = [
    *((scenario, "launch") for scenario in START_SCENARIOS),
    ("defaults", "none"),
    ("plain-tp", "none"),
    ("defaults", "dist-init"),
    ("h20-preset", "dist-init"),
    ("plain-tp", "dist-init"),
]


def _loopback_endpoint() -> tuple[str, int]:
    """A loopback address of its own for one group, and a dist-init port free there with the port 13 above it."""
    ip = f"127.0.0.{next(_loopback) % 150 + 100}"
    for _ in range(20):
        port = free_port()
        with contextlib.ExitStack() as held:
            try:
                for p in (port, port + 13):
                    held.enter_context(socket.socket()).bind((ip, p))
            except OSError:
                continue
        return ip, port
    raise AssertionError(f"no free port pair on {ip}")


def _start_group(role: str, members: list[tuple[GpuPod, dict[str, Any]]], wait: str) -> None:
    """Start one group's pods as LWS does, each waiting as `wait` says before its sglang (the stand-in) starts,
    on a loopback address and dist-init port of the group's own; assert it forms, or, for the control under
    attention DP, that it cannot."""
    from tests.support.sglang_multinode import SglangNode, node_args

    ip, dist_port = _loopback_endpoint()
    leader_host, _, base = _flag(members[0][1]["argv"], "--dist-init-addr").rpartition(":")

    def translate(address: str) -> tuple[str, int]:
        host, _, port = address.rpartition(":")
        assert host == leader_host, f"{address} is not the leader {leader_host}"
        return ip, int(port) - int(base) + dist_port

    moved = f"{ip}:{dist_port}"
    nodes = [
        SglangNode(node_args([a.replace(f"{leader_host}:{base}", moved) for a in doc["argv"]]), timeout_s=3 * WAIT_S)
        for _, doc in members
    ]
    attention_dp = nodes[0].args.attn_dp_size > 1
    waited: dict[str, BaseException] = {}

    def start(index: int, group: dict[str, Any], argv: list[str]) -> None:
        if index == 0:
            time.sleep(LEADER_LATE_S)
        try:
            WAITS[wait](group, argv, translate)
        except GroupWaitError as exc:
            waited[f"rank {index}"] = exc
            return
        nodes[index].start()

    threads = [threading.Thread(target=start, args=(pod.index, doc["group"], doc["argv"])) for pod, doc in members]
    started = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        if wait == "dist-init" and attention_dp:
            # Deadlock: rank 1 waits for a port its leader opens only after rank 1's sglang has joined.
            for thread in threads:
                thread.join()
            assert not any(n.joined.is_set() for n in nodes)
            assert list(waited) == ["rank 1"] and "does not accept connections" in str(waited["rank 1"])
            assert nodes[0].state == "handshake: answered 0 of 1 nodes", nodes[0].state
            return
        formed = all(n.joined.wait(max(0.0, started + 2 * WAIT_S - time.monotonic())) for n in nodes)
        states = {f"rank {i}": n.error or n.state for i, n in enumerate(nodes)}
        assert formed and not waited, f"{role} did not form: {states}, waits: {waited}"
        assert time.monotonic() - started < WAIT_S, "formed, but slower than one back-off step after its leader"
    finally:
        for n in nodes:
            n.stop()
        for thread in threads:
            thread.join(timeout=2 * WAIT_S)


@pytest.mark.sglang
@pytest.mark.parametrize(("scenario", "wait"), START_CASES, ids=[f"{s}-{w}" for s, w in START_CASES])
def test_every_multi_node_group_forms_in_sglangs_start_order(render, tmp_path, capsys, scenario, wait) -> None:
    # Each pod of every multi-node group as LWS starts it: the container's command (`launch --dry-run` says
    # what it waits for), the wait, then sglang, here the stand-in that binds in sglang 0.5.23's order
    # (tests/support/sglang_multinode.py). The "dist-init" wait is the control: under attention DP it must
    # deadlock, so that this test is seen to fail with it.
    pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed (the `validate` extra)")
    values, node = START_SCENARIOS[scenario]
    docs = render(copy.deepcopy(values))
    groups: dict[str, list[tuple[GpuPod, dict[str, Any]]]] = {}
    for pod in (p for p in gpu_pods(docs) if p.size > 1):
        root = tmp_path / pod.name.replace("/", "-")
        rc, out, err = run_launch(pod.container["command"], root, lay_out(root, docs, pod, node, SECRETS), capsys)
        assert rc == 0, f"{pod.name}: {err}"
        groups.setdefault(pod.role, []).append((pod, json.loads(out)))
    assert groups, f"{scenario} renders no multi-node group"
    for role, members in groups.items():
        _start_group(role, sorted(members, key=lambda m: m[0].index), wait)
