"""The Helm chart: lint, render for every preset, schema-valid objects, and what must agree with the topology."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sglang_pd.deploy.cli import main as cli_main
from sglang_pd.deploy.ops.launch import pod_settings_from_env
from sglang_pd.deploy.sglang.check import sglang_available
from sglang_pd.deploy.sglang.render import LEADER_HOST_FROM_ENV
from sglang_pd.deploy.spec import topology
from sglang_pd.deploy.spec.topology import check_rules, estimate_weight_bytes, load_topology, required_startup_s
from tests.support import deepep_revision

from .conftest import CHART, PRESETS, REPO, by_kind, helm_python, one, preset_topology, preset_values

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

PRESETS_DIR = PRESETS

PRESET_NAMES = ["deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d", "local-cpu"]
# The presets that run sglang on GPUs; a CPU topology runs the reference engine (test_reference_chart.py).
GPU_PRESETS = [p for p in PRESET_NAMES if preset_topology(p)["hardware"]["gpu"] != "cpu"]
K8S_VERSIONS = ["1.30.0", "1.33.0"]
# Custom resources Kubernetes' schemas do not know; LWS gets its own schema below.
CUSTOM_KINDS = {"LeaderWorkerSet", "ServiceMonitor", "PodMonitor", "AnalysisTemplate"}
LWS_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())
EVERYTHING_ON = {
    "gate": {"hook": {"enabled": True}, "analysisTemplate": {"enabled": True}},
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    },
    "networkPolicy": {"enabled": True, "clientSelector": {"matchLabels": {"team": "apps"}}},
    "router": {"ingress": {"enabled": True, "host": "llm.example.com", "tlsSecret": "llm-tls"}},
}


def lws_pod_templates(lws: dict) -> dict[str, dict]:
    tpl = lws["spec"]["leaderWorkerTemplate"]
    return {k: tpl[k] for k in ("leaderTemplate", "workerTemplate") if k in tpl}


def as_pod(template: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x", **template["metadata"]},
        "spec": template["spec"],
    }


def test_lint_strict() -> None:
    report = helm_python.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# Least-privilege RDMA with RoCE, downloads on ephemeral storage, a JIT cache claim.
DEVICE_PLUGIN_ROCE = {
    "rdma": {"mode": "devicePlugin"},
    "fabric": {"preset": "roce", "socketInterface": "bond0", "trafficClass": 106},
    "cache": {"type": "emptyDir"},
    "networkPolicy": {"enabled": True},
}
PVC_CACHE = {
    "cache": {"type": "pvc", "pvc": {"claimName": "jit"}},
    "model": {"source": "pvc", "pvc": {"claimName": "w"}},
}


@pytest.mark.parametrize(
    "values",
    [{}, EVERYTHING_ON, DEVICE_PLUGIN_ROCE, PVC_CACHE, *[preset_values(p) for p in PRESET_NAMES]],
    ids=["default", "everything-on", "device-plugin-roce", "pvc-cache", *PRESET_NAMES],
)
@pytest.mark.parametrize("k8s", K8S_VERSIONS)
def test_objects_pass_kubernetes_schemas(render, values, k8s) -> None:
    docs = render(values)
    assert docs
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            jsonschema.validate(doc, LWS_SCHEMA)
            for tpl in lws_pod_templates(doc).values():
                kubernetes_validate.validate(as_pod(tpl), k8s, strict=True)
        elif doc["kind"] == "AnalysisTemplate":
            job = doc["spec"]["metrics"][0]["provider"]["job"]
            kubernetes_validate.validate(
                {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": job["spec"]},
                k8s,
                strict=True,
            )
        elif doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, k8s, strict=True)


def test_optional_objects_render_only_when_asked(render) -> None:
    default = {d["kind"] for d in render()}
    assert default == {
        "ConfigMap",
        "LeaderWorkerSet",
        "PodDisruptionBudget",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Pod",
        "Job",  # the plan check, a pre-install/pre-upgrade hook
        "Secret",  # the generated worker key
    }
    assert {d["metadata"]["name"] for d in render() if d["kind"] == "Job"} == {"demo-sglang-pd-plan"}
    on = {d["kind"] for d in render(EVERYTHING_ON)}
    assert {"Job", "AnalysisTemplate", "ServiceMonitor", "PodMonitor", "NetworkPolicy", "Ingress"} <= on


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_counts_sizes_and_replicas_follow_the_topology(render, preset) -> None:
    t = preset_topology(preset)
    docs = render(preset_values(preset))
    for role, count in (("prefill", "instances"), ("decode", "groups")):
        lws = one(docs, "LeaderWorkerSet", f"-{role}")
        assert lws["spec"]["replicas"] == t[role][count]
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == t[role]["nodes"]
        templates = lws_pod_templates(lws)
        assert ("leaderTemplate" in templates) == (t[role]["nodes"] > 1)
        for tpl in templates.values():
            c = tpl["spec"]["containers"][0]
            gpus = t["hardware"]["gpus_per_node"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
            assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
            assert c["command"][:4] == ["sglang-pd", "launch", "--role", role]


def test_probes_only_on_leaders(render) -> None:
    lws = one(render(), "LeaderWorkerSet", "-decode")
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert leader["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # The default downloads DeepSeek from the hub: the budget covers download, load and warm-up.
    budget = leader["startupProbe"]["periodSeconds"] * leader["startupProbe"]["failureThreshold"]
    weights = estimate_weight_bytes(load_topology(PRESETS_DIR / "deepseek-r1-h200-1p1d.yaml").load_model_config() or {})
    assert budget >= required_startup_s(weights, "hub") > 2400
    assert leader["livenessProbe"]["failureThreshold"] * leader["livenessProbe"]["periodSeconds"] >= 300
    assert "readinessProbe" in leader
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)


def test_ports_agree_between_router_and_workers(render) -> None:
    topology = preset_topology("deepseek-r1-h200-1p1d")
    topology["prefill"]["bootstrap_port"] = 9100
    topology["router"]["port"] = 8080
    docs = render({"topology": topology})
    prefill = one(docs, "LeaderWorkerSet", "-prefill")["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    ann = prefill["metadata"]["annotations"]
    assert (ann["sglang-pd/port"], ann["sglang-pd/bootstrap-port"]) == ("8100", "9100")
    ports = {p["name"]: p["containerPort"] for p in prefill["spec"]["containers"][0]["ports"]}
    assert ports == {"http": 8100, "bootstrap": 9100}
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    args = router["command"]
    assert args[args.index("--port") + 1] == "8080"
    assert router["ports"] == [{"name": "http", "containerPort": 8080}]
    sel = args[args.index("--k8s-prefill-selector") + 1]
    assert sel == (
        "app.kubernetes.io/instance=demo,app.kubernetes.io/component=prefill,leaderworkerset.sigs.k8s.io/worker-index=0"
    )
    assert args[args.index("--k8s-namespace") + 1] == "llm"
    service = one(docs, "Service", "-router")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def _decode_leader(docs: list[dict]) -> dict:
    return one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_gpu_pod_security_env_and_volumes(render) -> None:
    values = {
        "env": {"NCCL_IB_GID_INDEX": 3},
        "decode": {"env": {"EP_MIN_TOKENS_PER_PART": "1"}},
        "model": {"source": "hub", "hub": {"tokenSecret": {"name": "hf", "key": "token"}}},
    }
    spec = _decode_leader(render(values))
    c = spec["containers"][0]
    # hostNetwork RDMA: the host's verbs devices open only in a privileged pod.
    assert c["securityContext"] == {"privileged": True}
    env = _env(c)
    assert env["NCCL_IB_GID_INDEX"] == "3" and env["EP_MIN_TOKENS_PER_PART"] == "1"
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["SGLANG_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The KV chain's name carries both: two releases' pods on one node's network keep their own.
    assert env["SGLANG_PD_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["SGLANG_PD_RELEASE"] == "llm/demo-sglang-pd"
    assert env["HF_HOME"] == "/cache/huggingface" and env["SGLANG_CACHE_DIR"] == "/cache/sglang"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes["infiniband"]["hostPath"]["path"] == "/dev/infiniband" and spec["hostNetwork"] is True
    assert volumes["topology"]["configMap"]["name"] == "demo-sglang-pd-topology"
    # Downloads and JIT caches survive LeaderWorkerSet's group recreation: a node directory.
    assert volumes["cache"]["hostPath"] == {"path": "/var/cache/sglang-pd", "type": "DirectoryOrCreate"}
    assert "model" not in volumes and "ephemeral-storage" not in c["resources"]["requests"]


def test_host_network_rdma_without_privileges_is_refused(chart) -> None:
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"securityContext": {"privileged": False}}, name="demo", namespace="llm")
    assert "securityContext.privileged: rdma.mode hostNetwork mounts the host's /dev/infiniband" in str(info.value)


def test_device_plugin_rdma_and_pvc_weights(render) -> None:
    values = {
        "rdma": {"mode": "devicePlugin", "devicePlugin": {"resourceName": "rdma/hca", "count": 2}},
        "model": {"source": "pvc", "pvc": {"claimName": "weights"}},
    }
    spec = one(render(values), "LeaderWorkerSet", "-prefill")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    c = spec["containers"][0]
    assert c["resources"]["limits"]["rdma/hca"] == 2 and "hostNetwork" not in spec
    # Least privilege with a device plugin, as llm-d's wide-EP pods, plus NET_ADMIN for the KV ports' rules.
    add = ["IPC_LOCK", "SYS_RAWIO", "NET_ADMIN"]
    assert c["securityContext"] == {"privileged": False, "capabilities": {"add": add}}
    assert {v["name"]: v for v in spec["volumes"]}["model"]["persistentVolumeClaim"] == {
        "claimName": "weights",
        "readOnly": True,
    }
    assert "HF_HOME" not in _env(c)


def _gpu_containers(docs: list[dict]) -> dict[str, dict]:
    """Every GPU pod template's container, by "<role>/<template>"."""
    out = {}
    for role in ("prefill", "decode"):
        lws = one(docs, "LeaderWorkerSet", f"-{role}")["spec"]["leaderWorkerTemplate"]
        for kind in ("leaderTemplate", "workerTemplate"):
            if kind in lws:
                out[f"{role}/{kind}"] = lws[kind]["spec"]["containers"][0]
    return out


def test_gpu_pods_fence_their_kv_ports_to_the_releases_pd_pods(render) -> None:
    docs = render({"rdma": {"mode": "devicePlugin"}, "kvFirewall": {"allowFrom": ["10.20.0.0/16", "fd00::/8"]}})
    # The peers are the LeaderWorkerSets' own headless Services: named as the sets, in the release's namespace.
    sets = sorted(d["metadata"]["name"] for d in by_kind(docs, "LeaderWorkerSet"))
    peers = "demo-sglang-pd-prefill.llm,demo-sglang-pd-decode.llm"
    assert sorted(p.removesuffix(".llm") for p in peers.split(",")) == sets
    containers = _gpu_containers(docs)
    assert set(containers) == {"prefill/workerTemplate", "decode/leaderTemplate", "decode/workerTemplate"}
    for where, c in containers.items():
        assert c["command"][6:] == ["--kv-peers", peers, "--kv-allow-from", "10.20.0.0/16,fd00::/8"], where
        assert "NET_ADMIN" in c["securityContext"]["capabilities"]["add"], where
    off = _gpu_containers(render({"rdma": {"mode": "devicePlugin"}, "kvFirewall": {"enabled": False}}))
    for where, c in off.items():
        assert c["command"][6:] == ["--no-kv-firewall"], where
        assert "NET_ADMIN" not in c["securityContext"]["capabilities"]["add"], where
    # Privileged pods (rdma.mode hostNetwork, the default) hold NET_ADMIN already.
    for c in _gpu_containers(render({})).values():
        assert c["securityContext"] == {"privileged": True} and c["command"][6] == "--kv-peers"


def test_emptydir_downloads_request_ephemeral_storage(render) -> None:
    spec = _decode_leader(render({"cache": {"type": "emptyDir", "sizeLimit": "900Gi"}}))
    c = spec["containers"][0]
    assert c["resources"]["requests"]["ephemeral-storage"] == "900Gi"
    assert {v["name"]: v for v in spec["volumes"]}["cache"]["emptyDir"] == {"sizeLimit": "900Gi"}
    pvc = _decode_leader(render({"model": {"source": "pvc", "pvc": {"claimName": "w"}}, "cache": {"type": "emptyDir"}}))
    assert "ephemeral-storage" not in pvc["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize("preset", GPU_PRESETS)
@pytest.mark.parametrize("source", ["hub", "pvc"])
def test_derived_startup_budget_passes_the_launchers_check(render, preset, source) -> None:
    values = {**preset_values(preset), "model": {"source": source, "pvc": {"claimName": "w"}}}
    docs = render(values)
    lws = one(docs, "LeaderWorkerSet", "-decode")["spec"]["leaderWorkerTemplate"]
    spec = lws.get("leaderTemplate", lws["workerTemplate"])["spec"]
    c = spec["containers"][0]
    pod = pod_settings_from_env(_env(c))
    assert pod is not None and pod.model_source == source
    probe = c["startupProbe"]
    assert pod.startup_budget_s == probe["periodSeconds"] * probe["failureThreshold"]
    t = load_topology(PRESETS_DIR / f"{preset}.yaml")
    assert check_rules(t, pod).ok, check_rules(t, pod).errors


def test_chart_budget_defaults_are_the_launchers() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["model"]["hub"]["downloadBytesPerSecond"] == topology.DEFAULT_DOWNLOAD_BYTES_PER_S
    assert values["startupBudget"]["loadBytesPerSecond"] == topology.DEFAULT_LOAD_BYTES_PER_S
    assert values["startupBudget"]["warmupSeconds"] == topology.DEFAULT_WARMUP_S


def test_too_small_startup_budget_is_refused(chart) -> None:
    values = {"decode": {"startupProbe": {"failureThreshold": 180}}}
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render(values, name="demo", namespace="llm")
    message = str(info.value)
    assert "decode.startupProbe: a startup budget of 1800s (failureThreshold x periodSeconds) cannot cover" in message
    # 684 GB: 1368 s download at 500 MB/s + 684 s read at 1 GB/s + 1200 s warm-up = 3252 s.
    assert "At periodSeconds 10 that is failureThreshold >= 326." in message


def test_unknown_model_needs_its_size_for_the_budget(chart, render) -> None:
    topology = preset_topology("deepseek-r1-h200-1p1d")
    del topology["model"]["config_json"]
    with pytest.raises(helm_python.HelmError, match=r"model\.sizeBytes: the startup budget is derived"):
        chart.render({"topology": topology}, name="demo", namespace="llm")
    spec = _decode_leader(render({"topology": topology, "model": {"sizeBytes": 100_000_000_000}}))
    # 100 GB: 200 s download + 100 s read at 1 GB/s + 1200 s warm-up in 10 s periods.
    assert spec["containers"][0]["startupProbe"]["failureThreshold"] == 150


@pytest.mark.parametrize(
    ("fabric", "want", "absent"),
    [
        (
            {},
            {
                "NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
                "NVSHMEM_HCA_LIST": "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
            },
            ["NCCL_IB_GID_INDEX", "NCCL_SOCKET_IFNAME"],
        ),
        (
            {"preset": "roce", "socketInterface": "bond0", "trafficClass": 106},
            {
                "NCCL_IB_GID_INDEX": "3",
                "NVSHMEM_IB_GID_INDEX": "3",
                "MC_GID_INDEX": "3",
                "NCCL_IB_TC": "106",
                "NVSHMEM_IB_TRAFFIC_CLASS": "106",
                "NCCL_SOCKET_IFNAME": "bond0",
                "GLOO_SOCKET_IFNAME": "bond0",
                "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "bond0",
            },
            [],
        ),
        ({"preset": "none"}, {}, ["NCCL_IB_HCA", "NCCL_IB_GID_INDEX"]),
    ],
    ids=["infiniband", "roce", "none"],
)
def test_fabric_presets(render, fabric, want, absent) -> None:
    env = _env(_decode_leader(render({"fabric": fabric}))["containers"][0])
    assert {k: env.get(k) for k in want} == want
    assert not set(absent) & set(env)


def _leader_env(docs: list[dict], role: str) -> dict:
    templates = one(docs, "LeaderWorkerSet", f"-{role}")["spec"]["leaderWorkerTemplate"]
    # A one-node group has no separate leader template: its one pod is the worker template's.
    pod = templates.get("leaderTemplate", templates["workerTemplate"])
    return _env(pod["spec"]["containers"][0])


def test_nvshmem_gets_the_hca_list_and_no_nic_to_pe_mapping(render) -> None:
    # One NIC per GPU (the preset lists eight): NVSHMEM's default gives each GPU its closest NIC, whatever PE
    # numbering DeepEP uses; a mapping would key on the PE's index on its node (docs/cluster-prerequisites.md).
    docs = render({})
    for role in ("prefill", "decode"):
        env = _leader_env(docs, role)
        assert env["NVSHMEM_HCA_LIST"] == ",".join(f"mlx5_{i}" for i in range(8))
        assert "NVSHMEM_HCA_PE_MAPPING" not in env and "NVSHMEM_ENABLE_NIC_PE_MAPPING" not in env


def test_a_roles_own_nic_mapping_drops_the_hca_list_nvshmem_would_prefer(render) -> None:
    t = preset_topology("deepseek-r1-h200-1p1d")
    mapping = ",".join(f"mlx5_{i}:1:1" for i in range(8))
    t["decode"]["env"] = {**t["decode"].get("env", {}), "NVSHMEM_HCA_PE_MAPPING": mapping}
    t["decode"]["env"]["NVSHMEM_ENABLE_NIC_PE_MAPPING"] = "1"
    docs = render({"topology": t})
    # NVSHMEM ignores NVSHMEM_HCA_PE_MAPPING while NVSHMEM_HCA_LIST is set: decode's pods get no list.
    assert "NVSHMEM_HCA_LIST" not in _leader_env(docs, "decode")
    assert "NVSHMEM_HCA_LIST" in _leader_env(docs, "prefill")
    assert _leader_env(docs, "decode")["NCCL_IB_HCA"] == "=" + ",".join(f"mlx5_{i}" for i in range(8))


def test_the_socket_interface_comes_from_the_topology(render) -> None:
    topology = preset_topology("deepseek-r1-h200-1p1d")
    topology["hardware"]["socket_interface"] = "bond0"
    env = _env(_decode_leader(render({"topology": topology}))["containers"][0])
    names = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
    assert {k: env[k] for k in names} == dict.fromkeys(names, "bond0")
    env = _env(_decode_leader(render({"topology": topology, "fabric": {"socketInterface": "eth1"}}))["containers"][0])
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"  # the chart's value wins


def test_own_env_wins_over_the_fabric_preset(render) -> None:
    values = {"fabric": {"preset": "roce"}, "env": {"NCCL_IB_GID_INDEX": "5"}}
    c = _decode_leader(render(values))["containers"][0]
    assert [e["value"] for e in c["env"] if e["name"] == "NCCL_IB_GID_INDEX"] == ["5"]


@pytest.mark.parametrize(
    ("mode", "policies"), [("hostNetwork", ["-router"]), ("devicePlugin", ["-router", "-workers"])]
)
def test_network_policy_skips_host_network_workers(render, mode, policies) -> None:
    docs = render({"networkPolicy": {"enabled": True}, "rdma": {"mode": mode}})
    names = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "NetworkPolicy")
    assert names == [f"demo-sglang-pd{p}" for p in policies]


def test_kv_probe_pod_can_open_host_rdma_devices(render) -> None:
    probe = one(render(), "Pod", "-test-kv-probe")["spec"]["containers"][0]
    assert probe["securityContext"] == {"privileged": True}
    probe = one(render({"rdma": {"mode": "devicePlugin"}}), "Pod", "-test-kv-probe")["spec"]["containers"][0]
    assert probe["securityContext"] == {"capabilities": {"add": ["IPC_LOCK", "SYS_RAWIO"]}}


def test_gate_runs_gsm8k_against_the_router(render) -> None:
    docs = render(
        {
            "gate": {"hook": {"enabled": True}, "gsm8k": {"minAccuracy": 0.93}},
            "router": {"apiKeySecret": {"name": "keys"}},
        }
    )
    job = one(docs, "Job", "-gate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    c = job["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"]
    assert cmd[:3] == ["sglang-pd", "eval", "gsm8k"]
    assert cmd[cmd.index("--base-url") + 1] == "http://demo-sglang-pd-router:8000/v1"
    assert cmd[cmd.index("--min-accuracy") + 1] == "0.93"
    # The gate ends (with a report) before the Job's deadline kills it.
    assert int(cmd[cmd.index("--timeout") + 1]) < job["spec"]["activeDeadlineSeconds"]
    assert c["env"][0]["name"] == "OPENAI_API_KEY"
    test = one(docs, "Pod", "-test-gsm8k")
    assert test["metadata"]["annotations"]["helm.sh/hook"] == "test"
    probe = one(docs, "Pod", "-test-kv-probe")["spec"]["containers"][0]["command"]
    assert probe[:4] == ["sglang-pd", "kv-probe", "--protocol", "rdma"]


def _configmap_topology(render, values, tmp_path: Path) -> Path:
    cm = one(render(values), "ConfigMap", "-topology")
    path = tmp_path / "topology.yaml"
    path.write_text(cm["data"]["topology.yaml"])
    return path


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_configmap_topology_is_the_preset_and_passes_rules(render, preset, tmp_path) -> None:
    path = _configmap_topology(render, preset_values(preset), tmp_path)
    assert _normalized(yaml.safe_load(path.read_text())) == _normalized(preset_topology(preset))
    assert check_rules(load_topology(path)).ok


def test_own_topology_is_used_whole_not_merged(render, tmp_path) -> None:
    topology = preset_topology("deepseek-v3-h20-3p2d")
    del topology["router"]
    path = _configmap_topology(render, {"topology": topology}, tmp_path)
    rendered = yaml.safe_load(path.read_text())
    assert "router" not in rendered and rendered["name"] == "deepseek-v3-h20-3p2d"


def test_topology_file_as_string_from_set_file(render, tmp_path) -> None:
    text = (REPO / "deploy" / "spec" / "presets" / "deepseek-v3-h20-3p2d.yaml").read_text()
    docs = render({"topology": text})
    assert one(docs, "LeaderWorkerSet", "-prefill")["spec"]["replicas"] == 3
    path = _configmap_topology(render, {"topology": text}, tmp_path)
    assert _normalized(yaml.safe_load(path.read_text())) == _normalized(preset_topology("deepseek-v3-h20-3p2d"))


def test_topology_string_that_is_not_yaml_is_explained(chart) -> None:
    with pytest.raises(helm_python.HelmError, match="topology: the string given"):
        chart.render({"topology": "name: [unclosed"}, name="demo", namespace="llm")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("- prefill\n- decode\n", "topology: the string given (--set-file topology=FILE?) is not a YAML mapping"),
        ("deepseek-r1-h200-1p1d\n", "topology: the string given (--set-file topology=FILE?) is not a YAML mapping"),
        ("  \n", "topology: the string given (--set-file topology=FILE?) is empty. Pass the topology file itself"),
    ],
    ids=["a-list", "a-preset-name", "empty"],
)
def test_a_set_file_topology_that_is_not_a_mapping_is_refused(chart, text: str, said: str) -> None:
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"topology": text}, name="demo", namespace="llm")
    assert said in str(info.value)


def _set_file(change) -> str:
    """A topology file's text (as --set-file passes it): the H200 preset with `change` applied."""
    t = preset_topology("deepseek-r1-h200-1p1d")
    change(t)
    return yaml.safe_dump(t)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            lambda t: t.update(hardwre=t.pop("hardware")),
            "topology.hardwre: unknown key; the top level takes decode, hardware, model, name, prefill, router, "
            "transfer. Every field is described in docs/fields.md.",
        ),
        (
            lambda t: t["decode"].update(grups=2),
            "topology.decode.grups: unknown key; decode takes attention_backend, attn_dp_size, chunked_prefill_size, "
            "cuda_graph_max_bs, deepep_mode, ",
        ),
        (
            lambda t: t.update(hardware="h200"),
            "topology.hardware: must be a mapping of its fields (colocated, compute_capability, gpu, gpu_memory_gib, "
            'gpus_per_node, rdma_devices, socket_interface), not a string ("h200"); write each field indented under '
            "hardware:",
        ),
        (
            lambda t: t["decode"].update(tbo="yes"),
            "topology.decode.tbo: must be a mapping of its fields (enabled, token_distribution_threshold), "
            'not a string ("yes")',
        ),
        (lambda t: t.update(transfer=None), "topology.transfer: must be a mapping of its fields ("),
    ],
    ids=["top-level-typo", "nested-typo", "section-a-string", "nested-section-a-string", "section-null"],
)
def test_a_set_file_topology_with_a_bad_key_is_refused_naming_it(chart, change, said: str) -> None:
    text = _set_file(change)
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render({"topology": text}, name="demo", namespace="llm")
    assert said in str(info.value)
    if "hardwre" in text:  # the misspelt section is also missing under its own name
        assert "topology.hardware: missing; the topology needs it" in str(info.value)
    # The chart refuses only what the pods' launcher would: the same file fails the topology's own model.
    with pytest.raises(topology.TopologyError):
        topology.parse_topology(yaml.safe_load(text), source_dir=PRESETS)


def _normalized(t: dict) -> dict:
    # Helm round-trips YAML through JSON: integer map keys (transfer.ib_devices) become strings.
    return json.loads(json.dumps(t))


@pytest.mark.sglang
@pytest.mark.skipif(not sglang_available(), reason="sglang is not installed (the `validate` extra)")
def test_configmap_topology_passes_plan_check(render, tmp_path, capsys, monkeypatch) -> None:
    # The image's DeepEP (antgroup-opt): with this machine's sgl-deep-ep full SBO over 2 nodes is refused.
    deepep_revision.install(tmp_path / "antgroup-opt", monkeypatch)
    path = _configmap_topology(render, {}, tmp_path)
    assert cli_main(["plan", str(path), "--check", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(c["ok"] for c in doc["sglang_check"])


@pytest.mark.parametrize("rank", [0, 1])
def test_launch_dry_run_matches_the_plan(render, tmp_path, capsys, rank) -> None:
    path = _configmap_topology(render, {}, tmp_path)
    assert cli_main(["plan", str(path), "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)["roles"]["decode"][rank]
    env = {
        **os.environ,
        "LWS_LEADER_ADDRESS": "demo-sglang-pd-decode-0.demo-sglang-pd-decode.llm",
        "LWS_WORKER_INDEX": str(rank),
        "LWS_GROUP_SIZE": "2",
    }
    # The command the chart renders (its KV-port flags included), with the topology where the test wrote it.
    command = _decode_leader(render({}))["containers"][0]["command"]
    assert command[:6] == ["sglang-pd", "launch", "--role", "decode", "--topology", "/etc/sglang-pd/topology.yaml"]
    proc = subprocess.run(
        # No GPUs here: the pod checks are test_pod_conformance.py's.
        [
            sys.executable,
            "-m",
            "sglang_pd.deploy.cli",
            *command[1:5],
            str(path),
            *command[6:],
            "--dry-run",
            "--skip-checks",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    launched = json.loads(proc.stdout)
    want = [a.replace(LEADER_HOST_FROM_ENV, env["LWS_LEADER_ADDRESS"]) for a in planned["argv"]]
    assert launched["argv"] == want and launched["env"] == planned["env"]
    assert launched["node_rank"] == rank
    assert launched["kv_firewall"]["peers"] == ["demo-sglang-pd-prefill.llm", "demo-sglang-pd-decode.llm"]
    assert "--node-rank" in launched["argv"] and launched["argv"][launched["argv"].index("--node-rank") + 1] == str(
        rank
    )


def test_schema_and_presets_are_in_sync_with_the_package() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/sync_chart.py", "--check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# --- values.schema.json and validateValues reject wrong values with messages naming the key ----

BAD_VALUES = [
    ({"image": {"tag": 123}}, "/image/tag"),
    ({"imageTag": "x"}, "imageTag"),
    ({"rdma": {"mode": "infiniband"}}, "/rdma/mode"),
    ({"shmSizeLimit": "lots"}, "/shmSizeLimit"),
    ({"router": {"replicas": 0}}, "/router/replicas"),
    ({"gate": {"gsm8k": {"minAccuracy": 1.5}}}, "/gate/gsm8k/minAccuracy"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"prefill": {"startupProbe": {"failureThreshold": 0}}}, "/prefill/startupProbe/failureThreshold"),
    ({"topology": {"prefill": {"tp": "eight"}}}, "/topology/prefill/tp"),
    ({"topology": {"decode": {"sbo_mode": "full"}}}, "sbo_mode"),
    ({"topology": {"router": {"decode_policy": "fastest"}}}, "/topology/router/decode_policy"),
    ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "/metrics/serviceMonitor/interval"),
    ({"kvFirewall": {"allowFrom": ["the pods"]}}, "/kvFirewall/allowFrom/0"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_wrong_values(chart, values, where) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render(values, name="demo", namespace="llm")
    assert "values don't meet the specifications of the schema" in str(info.value)
    assert where in str(info.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"model": {"source": "pvc"}}, "model.pvc.claimName: model.source is pvc but no claim is named"),
        ({"model": {"source": "hostPath"}}, "model.hostPath.path: model.source is hostPath but no path is set"),
        ({"rdma": {"mode": "none"}}, "rdma.mode: none gives pods no RDMA NIC, but topology.transfer.protocol is rdma"),
        ({"router": {"ingress": {"enabled": True}}}, "router.ingress.host: the Ingress needs a host name"),
    ],
)
def test_validate_values_names_the_fix(chart, values, message) -> None:
    with pytest.raises(helm_python.HelmError, match="VALUES VALIDATION") as info:
        chart.render(values, name="demo", namespace="llm")
    assert message in str(info.value)


def test_the_only_group_is_not_drained_away(render) -> None:
    # One decode group of 2 nodes (the default preset): evicting any pod would stop decode, as LWS recreates
    # the whole group; the budget keeps all its pods until another group runs.
    pdb = one(render(), "PodDisruptionBudget", "-decode")["spec"]
    assert pdb["minAvailable"] == 2 and "maxUnavailable" not in pdb
    opted = one(render({"decode": {"pdb": {"allowLastGroupDisruption": True}}}), "PodDisruptionBudget", "-decode")
    assert opted["spec"]["maxUnavailable"] == 1
    # Three prefill instances (the H20 preset): one at a time.
    prefill = one(render({"preset": "deepseek-v3-h20-3p2d"}), "PodDisruptionBudget", "-prefill")["spec"]
    assert prefill["maxUnavailable"] == 1 and "minAvailable" not in prefill


@pytest.mark.parametrize(
    ("source", "says"),
    [("hub", "downloads the weights from the hub"), ("pvc", "loads the weights from the pvc volume (/models, no")],
)
def test_notes_say_what_a_cold_start_does_for_the_source(chart, source, says) -> None:
    values = {"model": {"source": source, "pvc": {"claimName": "w"}}}
    notes = next(v for k, v in chart.render(values, name="demo", namespace="llm").items() if k.endswith("NOTES.txt"))
    assert says in notes
    assert ("downloads" in notes) == (source == "hub")


def test_pods_without_cuda_run_the_slim_image(render) -> None:
    docs = render()
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["image"] == "ghcr.io/sglang-pd/sglang-pd-cpu:0.1.0"
    engines = [
        c["image"]
        for d in by_kind(docs, "LeaderWorkerSet")
        for pod in lws_pod_templates(d).values()
        for c in pod["spec"]["containers"]
    ]
    assert engines and set(engines) == {"ghcr.io/sglang-pd/sglang-pd:0.1.0-sglang0.5.23"}
    # Without a slim image every pod runs the one image, as before.
    docs = render({"cpuImage": {"repository": ""}, "image": {"pullPolicy": "Always"}})
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert (router["image"], router["imagePullPolicy"]) == ("ghcr.io/sglang-pd/sglang-pd:0.1.0-sglang0.5.23", "Always")
