"""The chart and `sglang-pd launch` together: each documented value set rendered, every GPU pod's filesystem and
environment laid out as Kubernetes, LWS and NVIDIA's device plugin would (pod_fs.py), and the container's own
command run in it with --dry-run. What the chart accepts must start; what launch refuses, the chart refuses first,
in the same words."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
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
            # Its ZMQ sockets admit the group's pods, by LWS's names; ranks > 0 wait for the leader first.
            assert group["peer_hosts"][0] == pod.leader_address and len(group["peer_hosts"]) == pod.size
            assert group.get("wait_for") == (f"{pod.leader_address}:5000" if pod.index else None)
        assert group["also_allowed"] == ["127.0.0.1", node.ip]
        if scenario == "worker-key":
            assert argv[-1] == "--api-key=${SGLANG_PD_WORKER_API_KEY}"


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


def test_a_socket_interface_the_node_lacks_stops_the_pod(render, tmp_path, capsys) -> None:
    topology = preset_topology("deepseek-r1-h200-1p1d")
    topology["hardware"]["socket_interface"] = "ens1f0"
    for pod, rc, out, _ in _launch_pod(render, tmp_path, capsys, {"topology": topology}, Node()):
        assert rc == 1, pod.name
        check = {c["name"]: c for c in json.loads(out)["checks"]}["socket-interface"]
        assert check["detail"].startswith("NCCL_SOCKET_IFNAME=ens1f0 matches none of this pod's interfaces (bond0,")


def test_a_driver_older_than_cuda_13_needs_stops_the_pod(render, tmp_path, capsys) -> None:
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
        assert reason in chart_says, f"launch says {reason!r}; the chart says {chart_says!r}"


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
