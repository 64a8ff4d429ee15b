"""Lay out a rendered GPU pod's filesystem and environment as Kubernetes, LWS and NVIDIA's device plugin would.

What a pod sees comes from four places, each modelled from its documentation:
- kubelet: ConfigMap volumes (every key a file, or the `items` chosen, at the mount path), emptyDir
  and hostPath volumes, and the env list with downward-API `fieldRef`s and `secretKeyRef`s
  (https://kubernetes.io/docs/concepts/storage/volumes/, .../inject-data-application/);
- LeaderWorkerSet: LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX in every pod of a group
  (https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/);
- NVIDIA's device plugin and container toolkit: /dev/nvidia<N> for each GPU granted, plus
  NVIDIA_VISIBLE_DEVICES as its DEVICE_LIST_STRATEGY says: `envvar` lists the GPUs' UUIDs,
  `volume-mounts` names /var/run/nvidia-container-devices, one empty file per GPU in it
  (https://github.com/NVIDIA/k8s-device-plugin, "Configuration option details");
- the node: its RDMA devices in /sys/class/infiniband (and, where the pod may use them, the verbs
  devices in /dev/infiniband), and the capabilities the container runtime grants (/proc/self/status).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# linux/capability.h bits; Docker's and containerd's default set (CapEff 00000000a80425fb).
DEFAULT_CAPS = 0xA80425FB
CAP_BITS = {"NET_ADMIN": 12, "IPC_LOCK": 14, "SYS_RAWIO": 17}
ALL_CAPS = 0x000001FFFFFFFFFF
Strategy = Literal["envvar", "volume-mounts"]
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"


@dataclass(frozen=True)
class Node:
    """A well-prepared GPU node: its GPUs (by the device plugin's strategy) and its RDMA devices."""

    strategy: Strategy = "envvar"
    rdma_devices: tuple[str, ...] = tuple(f"mlx5_{i}" for i in range(8))
    ip: str = "10.0.0.11"
    # What the NVIDIA kernel module reports in /proc/driver/nvidia/version.
    driver: str = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder)"
    # Its network interfaces, as a host-network pod sees them in /sys/class/net.
    interfaces: tuple[str, ...] = ("lo", "eth0", "bond0", "cni0")
    # Files a model volume (pvc or hostPath) holds, relative to the volume's root.
    volume_files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuPod:
    """One GPU pod template of a rendered LeaderWorkerSet, at one worker index of its group."""

    role: str
    template: str  # leaderTemplate or workerTemplate
    index: int
    size: int
    leader_address: str
    spec: dict[str, Any]

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.spec["containers"][0])

    @property
    def name(self) -> str:
        return f"{self.role}/{self.template}/{self.index}"


def gpu_pods(docs: list[dict[str, Any]]) -> list[GpuPod]:
    """Every pod of one group of each rendered LeaderWorkerSet: the leader (index 0) and each worker index."""
    pods = []
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        name, tpl = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
        size = int(tpl["size"])
        role = lws["metadata"]["labels"]["app.kubernetes.io/component"]
        # LWS names the group's leader pod <set>-<group> and its headless Service as the set.
        leader = f"{name}-0.{name}.llm"
        for index in range(size):
            template = "leaderTemplate" if index == 0 and "leaderTemplate" in tpl else "workerTemplate"
            pods.append(GpuPod(role, template, index, size, leader, tpl[template]["spec"]))
    return pods


def _requests(container: dict[str, Any], name: str) -> int:
    return int(container.get("resources", {}).get("limits", {}).get(name, 0))


def _env(container: dict[str, Any], pod: GpuPod, node: Node, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        source = e["valueFrom"]
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in ("status.podIP", "metadata.name"), f"{pod.name}: unmodelled downward-API field {path}"
            # LWS names a group's leader <set>-<group>, its workers <set>-<group>-<index>.
            leader = pod.leader_address.split(".")[0]
            env[e["name"]] = node.ip if path == "status.podIP" else leader + (f"-{pod.index}" if pod.index else "")
        else:
            ref = source["secretKeyRef"]
            env[e["name"]] = secrets[ref["name"]][ref["key"]]
    env.update(
        {"LWS_LEADER_ADDRESS": pod.leader_address, "LWS_GROUP_SIZE": str(pod.size), "LWS_WORKER_INDEX": str(pod.index)}
    )
    return env


def _config_map(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    assert found, f"the pod mounts ConfigMap {name}, which the chart does not render"
    return dict(found[0]["data"])


def _write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def mount_config_maps(root: Path, docs: list[dict[str, Any]], spec: dict[str, Any], container: dict[str, Any]) -> None:
    """Write the ConfigMap volumes `container` mounts under `root`: every key a file, or the `items` chosen."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            data = _config_map(docs, volume["configMap"]["name"])
            items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                _write(root / mount["mountPath"].lstrip("/") / item["path"], data[item["key"]])


def lay_out(
    root: Path, docs: list[dict[str, Any]], pod: GpuPod, node: Node, secrets: dict[str, dict[str, str]] | None = None
) -> dict[str, str]:
    """Write `pod`'s filesystem under `root` and return its environment."""
    c = pod.container
    under = lambda p: root / str(p).lstrip("/")  # noqa: E731
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    rdma_granted = pod.spec.get("hostNetwork", False) or any("rdma" in k for k in c["resources"]["limits"])
    for mount in c.get("volumeMounts", []):
        volume, target = volumes[mount["name"]], under(mount["mountPath"])
        target.mkdir(parents=True, exist_ok=True)
        if mount["mountPath"] == "/dev/infiniband":
            for i, _ in enumerate(node.rdma_devices):
                _write(target / f"uverbs{i}")
        elif "persistentVolumeClaim" in volume or ("hostPath" in volume and mount["name"] == "model"):
            for rel, text in node.volume_files.items():
                _write(target / rel, text)
    if rdma_granted and not pod.spec.get("hostNetwork"):
        # An RDMA device plugin hands the pod the verbs devices of the NICs it shares.
        for i, _ in enumerate(node.rdma_devices):
            _write(under("/dev/infiniband") / f"uverbs{i}")
    for dev in node.rdma_devices:
        (under("/sys/class/infiniband") / dev).mkdir(parents=True, exist_ok=True)
    for name in node.interfaces if pod.spec.get("hostNetwork") else ("lo", "eth0"):
        (under("/sys/class/net") / name).mkdir(parents=True, exist_ok=True)
    mount_config_maps(root, docs, pod.spec, c)
    # The Secrets the chart renders (its generated worker key), then those the test adds.
    rendered = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in (d.get("data") or {}).items()}
        for d in docs
        if d["kind"] == "Secret"
    }
    env = _env(c, pod, node, {**rendered, **(secrets or {})})
    gpus = _requests(c, "nvidia.com/gpu")
    uuids = [f"GPU-{pod.role}-{pod.index}-{i:02d}" for i in range(gpus)]
    for i in range(gpus):
        _write(under("/dev") / f"nvidia{i}")
    _write(under("/dev") / "nvidiactl")
    _write(under("/proc/driver/nvidia/version"), node.driver + "\n")
    if node.strategy == "envvar":
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(uuids) or "void"
    else:
        env["NVIDIA_VISIBLE_DEVICES"] = DEVICE_LIST_DIR
        for u in uuids:
            _write(under(DEVICE_LIST_DIR) / u)
    security = c.get("securityContext", {})
    caps = ALL_CAPS if security.get("privileged") else DEFAULT_CAPS
    for name in security.get("capabilities", {}).get("add", []):
        caps |= 1 << CAP_BITS[name]
    _write(under("/proc/self/status"), f"Name:\tsglang-pd\nCapPrm:\t{caps:016x}\nCapEff:\t{caps:016x}\n")
    return env


def dry_run_doc(stdout: str) -> dict[str, Any]:
    """The JSON document `sglang-pd launch --dry-run` printed."""
    return dict(json.loads(stdout))
