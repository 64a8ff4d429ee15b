"""`sglang-pd launch`: the entrypoint of every pod.

It renders the role's command from the topology (the one renderer, `deploy/sglang/render.py`), takes the
node rank and the leader's address from LeaderWorkerSet's environment, checks the topology
against how the chart set the pod up (`PodSettings`, passed as SGLANG_PD_POD_* variables), checks
what the pod needs (GPUs, /dev/shm, locked memory for Mooncake, IB devices it can open) and then
execs sglang, or the router. With weights on a volume (the chart's model.source pvc or hostPath)
sglang gets the directory the chart mounted as --model-path, and HF_HUB_OFFLINE=1. The worker key
(SGLANG_PD_WORKER_API_KEY, from the chart's Secret) reaches sglang only here, at start, in a config
file only this user can read (`keyfile.py`; never on the command line); with a key, sglang runs as a
supervised child whose output is masked (`supervise`) instead of replacing this process, and the file
is removed when it exits. `--dry-run` prints the exact argv (the key file shown as a placeholder) and
env instead, and exits
1 when a required check fails. `--root DIR` reads the pod's files (topology, devices, /sys, the model
volume) under DIR, to check a pod's filesystem laid out elsewhere.

Before sglang starts, an engine pod fences Mooncake's KV ports (TCP MC_MIN_RPC_PORT..MC_MAX_RPC_PORT,
which authenticate no one) to loopback and its PD peers: `--kv-peers` names host names (the chart
renders the prefill and decode LeaderWorkerSets' headless Services), resolved again every few
seconds, and `--kv-allow-from` adds address ranges (kv/firewall.py). The launcher then stays as
the pod's first process to keep the rules current. Without NET_ADMIN or iptables the launch
fails, unless `--no-kv-firewall` (unsafe) turns the rules off.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from sglang_pd.deploy.common.contract import (
    ENV_LWS_GROUP_SIZE,
    ENV_LWS_LEADER_ADDRESS,
    ENV_LWS_WORKER_INDEX,
    ENV_ROUTER_WORKER_API_KEY,
    ENV_WORKER_API_KEY,
    EXIT_INVALID,
    EXIT_OK,
    Role,
    as_role,
    unsendable_key,
)
from sglang_pd.deploy.common.node import CAP_IPC_LOCK, MEMLOCK_FIX, PROC_STATUS, has_capability, memlock_limit
from sglang_pd.deploy.common.procs import mask_secrets, spawn
from sglang_pd.deploy.kv.firewall import FirewallError, Network, PeerFirewall, parse_networks
from sglang_pd.deploy.kv.listeners import mooncake_port_range
from sglang_pd.deploy.ops.group import (
    DEFAULT_LEADER_WAIT_S,
    GroupWaitError,
    LeaderPort,
    group_hosts,
    leader_port,
    resolve_all,
    wait_for_leader,
)
from sglang_pd.deploy.ops.keyfile import CONFIG_FLAG, KEY_FILE_SHOWN, KeyFile
from sglang_pd.deploy.ops.netif import interface_addresses, interface_of
from sglang_pd.deploy.sglang.render import NodeCommand, render_node
from sglang_pd.deploy.spec.topology import (
    MODEL_SOURCES,
    RDMA_MODES,
    PodSettings,
    Topology,
    check_rules,
    load_checked_topology,
)

__all__ = [
    "BootstrapInterface",
    "LaunchError",
    "PodCheck",
    "add_arguments",
    "bootstrap_interface",
    "checked_worker_key",
    "group_plan",
    "has_capability",
    "kv_firewall",
    "pod_checks",
    "pod_settings_from_env",
    "resolve_command",
    "run",
    "sglang_worker_key",
    "supervise",
    "under_root",
    "visible_gpus",
]

# LeaderWorkerSet's per-pod environment (https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/).
LWS_LEADER_ADDRESS = ENV_LWS_LEADER_ADDRESS
LWS_WORKER_INDEX = ENV_LWS_WORKER_INDEX
LWS_GROUP_SIZE = ENV_LWS_GROUP_SIZE

# sglang shares tensors between its processes through /dev/shm; NCCL needs more with many GPUs.
MIN_SHM_BYTES = 16 << 30
INFINIBAND_SYSFS = Path("/sys/class/infiniband")
INFINIBAND_DEV = Path("/dev/infiniband")

# How the chart set this pod up, for the topology's pod rules (`check_rules(t, pod)`).
POD_ENV_RDMA_MODE = "SGLANG_PD_POD_RDMA_MODE"
POD_ENV_PRIVILEGED = "SGLANG_PD_POD_PRIVILEGED"
POD_ENV_MODEL_SOURCE = "SGLANG_PD_POD_MODEL_SOURCE"
POD_ENV_STARTUP_BUDGET_S = "SGLANG_PD_POD_STARTUP_BUDGET_S"
POD_ENV_DOWNLOAD_BYTES_PER_S = "SGLANG_PD_POD_DOWNLOAD_BYTES_PER_S"
POD_ENV_LOAD_BYTES_PER_S = "SGLANG_PD_POD_LOAD_BYTES_PER_S"
POD_ENV_WARMUP_S = "SGLANG_PD_POD_WARMUP_S"
POD_ENV_WEIGHT_BYTES = "SGLANG_PD_POD_WEIGHT_BYTES"
POD_ENV_MODEL_PATH = "SGLANG_PD_POD_MODEL_PATH"
# huggingface_hub reads no network with it set (https://huggingface.co/docs/huggingface_hub/package_reference/environment_variables):
# weights on a volume must never turn into a download into the container's writable layer.
HF_OFFLINE_ENV = "HF_HUB_OFFLINE"

# NVIDIA's device plugin tells the container toolkit which GPUs a pod was granted in one of several
# ways, its DEVICE_LIST_STRATEGY (https://github.com/NVIDIA/k8s-device-plugin, "Configuration option
# details"): `envvar` sets NVIDIA_VISIBLE_DEVICES to the GPUs' UUIDs; `volume-mounts` (Bottlerocket's
# and EKS's default) sets it to this directory and mounts one empty file per GPU in it; the `cdi-*`
# strategies set nothing. In each case the toolkit creates /dev/nvidia<N> for every GPU granted.
NVIDIA_DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"
DEV = Path("/dev")
SHM = Path("/dev/shm")

# sglang's flag for its API key. The launcher gives the key in a config file instead (keyfile.py), so
# that it stays out of the pod spec, the topology ConfigMap and the process's command line; a role
# whose extra_args set the flag as well is refused. The masked logs show this placeholder for the key.
API_KEY_FLAG = "--api-key"
API_KEY_SHOWN = "${" + ENV_WORKER_API_KEY + "}"
# sglang's multi-tokenizer mode (more than one tokenizer worker) asserts that no API key is set,
# in each tokenizer worker (entrypoints/http_server.py); found in a role's extra_args with a key,
# it fails here instead, before the weights load.
TOKENIZER_WORKERS_FLAG = "--tokenizer-worker-num"
# What Kubernetes (SIGTERM, then SIGKILL after the grace period) or a terminal sends to stop the pod.
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# After sglang exits, how long its last output lines may take to come through the pipes.
DRAIN_S = 5.0


class LaunchError(RuntimeError):
    """The pod cannot start its role; the message says what to fix in the chart or the node."""


@dataclass(frozen=True)
class PodCheck:
    """One thing the pod needs; a failed check that is not `required` is a warning."""

    name: str
    ok: bool
    detail: str
    required: bool = True


def pod_settings_from_env(env: Mapping[str, str], role: Role | None = None) -> PodSettings | None:
    """The chart's pod settings from SGLANG_PD_POD_* variables; None outside the chart's pods."""
    if POD_ENV_MODEL_SOURCE not in env:
        return None
    defaults = PodSettings()
    given_rdma, given_source = env.get(POD_ENV_RDMA_MODE, defaults.rdma_mode), env[POD_ENV_MODEL_SOURCE]
    rdma_mode = next((m for m in RDMA_MODES if m == given_rdma), None)
    source = next((s for s in MODEL_SOURCES if s == given_source), None)
    if rdma_mode is None or source is None:
        raise LaunchError(
            f"{POD_ENV_RDMA_MODE}={given_rdma!r} or {POD_ENV_MODEL_SOURCE}={given_source!r} is not a value the "
            f"chart renders ({'|'.join(RDMA_MODES)}, {'|'.join(MODEL_SOURCES)}); render the pod with the chart."
        )
    try:
        budget = env.get(POD_ENV_STARTUP_BUDGET_S)
        weights = env.get(POD_ENV_WEIGHT_BYTES)
        return PodSettings(
            rdma_mode=rdma_mode,
            privileged=env.get(POD_ENV_PRIVILEGED, "true").lower() == "true",
            model_source=source,
            startup_budget_s=int(budget) if budget else None,
            download_bytes_per_s=float(env.get(POD_ENV_DOWNLOAD_BYTES_PER_S, defaults.download_bytes_per_s)),
            load_bytes_per_s=float(env.get(POD_ENV_LOAD_BYTES_PER_S, defaults.load_bytes_per_s)),
            warmup_s=int(env.get(POD_ENV_WARMUP_S, defaults.warmup_s)),
            weight_bytes=int(weights) if weights else None,
            model_path=env.get(POD_ENV_MODEL_PATH) or None,
            role=role,
        )
    except ValueError as exc:
        raise LaunchError(f"the chart's SGLANG_PD_POD_* variables are malformed: {exc}") from exc


def under_root(root: Path, path: str | Path) -> Path:
    """Where the pod's absolute `path` lies when its filesystem is laid out under `root` (`--root`)."""
    p = Path(path)
    return root / p.relative_to("/") if p.is_absolute() else p


def _memlock_check(root: Path) -> PodCheck:
    enough, shown = memlock_limit()
    if enough:
        return PodCheck("memlock", True, f"locked-memory limit {shown}")
    if has_capability(CAP_IPC_LOCK, under_root(root, PROC_STATUS)):
        return PodCheck(
            "memlock", True, f"locked-memory limit {shown}, but CAP_IPC_LOCK lets Mooncake pin KV memory past it"
        )
    return PodCheck(
        "memlock",
        False,
        f"locked-memory limit {shown} and no CAP_IPC_LOCK: Mooncake may fail to register KV memory; {MEMLOCK_FIX}",
        required=False,
    )


def _rdma_access_check(root: Path) -> PodCheck:
    # A hostPath /dev/infiniband is listed but its verbs devices open only with device-cgroup access
    # (a privileged pod, or an RDMA device plugin that grants them).
    dev_dir = under_root(root, INFINIBAND_DEV)
    devices = sorted(dev_dir.glob("uverbs*")) if dev_dir.is_dir() else []
    if not devices:
        return PodCheck(
            "rdma-access",
            False,
            f"no verbs devices under {INFINIBAND_DEV}; mount /dev/infiniband (rdma.mode hostNetwork) or request "
            "the RDMA device plugin's resource (rdma.mode devicePlugin)",
        )
    refused = []
    for dev in devices:
        try:
            os.close(os.open(dev, os.O_RDWR))
        except OSError as exc:
            refused.append(f"{dev.name} ({exc.strerror})")
    if refused:
        return PodCheck(
            "rdma-access",
            False,
            f"cannot open {', '.join(refused)}: the pod lacks device access; run it privileged "
            "(securityContext.privileged) or use an RDMA device plugin (rdma.mode devicePlugin)",
        )
    return PodCheck("rdma-access", True, f"opened {len(devices)} verbs device(s)")


def _node_rank(env: Mapping[str, str], nodes: int, role: str) -> tuple[int, str]:
    """(node rank, leader host) from LWS's environment; single-node roles need none of it."""
    if nodes == 1:
        return 0, env.get(LWS_LEADER_ADDRESS, "127.0.0.1")
    missing = [k for k in (LWS_LEADER_ADDRESS, LWS_WORKER_INDEX, LWS_GROUP_SIZE) if not env.get(k)]
    if missing:
        raise LaunchError(
            f"{role} spans {nodes} nodes but {', '.join(missing)} is not set; run it as a LeaderWorkerSet pod "
            f"(the chart does), or set {LWS_LEADER_ADDRESS}, {LWS_WORKER_INDEX} and {LWS_GROUP_SIZE} by hand."
        )
    try:
        rank, size = int(env[LWS_WORKER_INDEX]), int(env[LWS_GROUP_SIZE])
    except ValueError as exc:
        raise LaunchError(f"{LWS_WORKER_INDEX} and {LWS_GROUP_SIZE} must be integers: {exc}") from exc
    if size != nodes:
        raise LaunchError(
            f"{LWS_GROUP_SIZE}={size} but the topology's {role}.nodes={nodes}; the LeaderWorkerSet size must "
            "equal the topology's nodes per instance/group (the chart derives both from one value)."
        )
    if not 0 <= rank < nodes:
        raise LaunchError(f"{LWS_WORKER_INDEX}={rank} is outside 0..{nodes - 1}.")
    return rank, env[LWS_LEADER_ADDRESS]


def resolve_command(t: Topology, role: str, env: Mapping[str, str]) -> NodeCommand:
    """This pod's sglang command: the plan's command for its node rank, with the real leader address."""
    pd_role = as_role(role)
    if pd_role is None:
        raise LaunchError(f"role {role!r} has no sglang command; choose prefill or decode.")
    spec = t.prefill if pd_role == "prefill" else t.decode
    rank, leader = _node_rank(env, spec.nodes, pd_role)
    return render_node(t, pd_role, node_rank=rank, leader_host=leader)


def checked_worker_key(env: Mapping[str, str], name: str) -> str | None:
    """The key in `name`, None when unset; a value no HTTP header can carry is an error."""
    if name not in env:
        return None
    key = env[name]
    if not key:
        raise LaunchError(
            f"{name} is set but empty: the Secret named in the chart's workerKeySecret holds no value under "
            "workerKeySecret.key. Put the key there, or unset workerKeySecret.name to run without a worker key."
        )
    if unsendable_key(key):
        raise LaunchError(
            f"{name} contains whitespace or control characters (a trailing newline from "
            "`kubectl create secret --from-file`?), which an Authorization header cannot carry. Recreate the "
            "Secret with `--from-literal=<key>=<value>` or from a file without the newline."
        )
    return key


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1] if i + 1 < len(argv) else ""
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def sglang_worker_key(argv: list[str], env: Mapping[str, str], role: str) -> str | None:
    """The worker key sglang is to get, from SGLANG_PD_WORKER_API_KEY (None when unset), for a
    `KeyFile`.

    Raises LaunchError when the key is malformed or starts with "-" (sglang's parser would take it
    from the config file for an option), or the role's command already sets a key, or asks for more
    than one tokenizer worker (sglang refuses a key then).
    """
    key = checked_worker_key(env, ENV_WORKER_API_KEY)
    if key is None:
        return None
    if key.startswith("-"):
        raise LaunchError(
            f"{ENV_WORKER_API_KEY} starts with '-': sglang reads the key from its config file as the value "
            "after --api-key, and its parser takes a value starting with '-' for an option. Use a key that "
            "does not start with '-' (the chart's generated Secret and `up`'s generated key never do)."
        )
    # (`--config`, which the key file takes, is refused in extra_args by the topology's own rules.)
    if _flag_value(argv, API_KEY_FLAG) is not None:
        raise LaunchError(
            f"{role}.extra_args sets {API_KEY_FLAG} and {ENV_WORKER_API_KEY} is set too; keep the key in the "
            f"Secret (the chart's workerKeySecret) and remove {API_KEY_FLAG} from {role}.extra_args, where it "
            "would be readable in the topology ConfigMap and on the process's command line."
        )
    workers = _flag_value(argv, TOKENIZER_WORKERS_FLAG)
    if workers is not None and workers.strip() != "1":
        raise LaunchError(
            f"{role}.extra_args sets {TOKENIZER_WORKERS_FLAG} {workers}, and sglang refuses an API key with more "
            f"than one tokenizer worker, but {ENV_WORKER_API_KEY} is set; remove {TOKENIZER_WORKERS_FLAG} from "
            f"{role}.extra_args, or unset the chart's workerKeySecret.name."
        )
    return key


def _listed(value: str) -> list[str]:
    return [d for d in value.split(",") if d.strip()]


def visible_gpus(env: Mapping[str, str], root: Path = Path("/")) -> tuple[int, str]:
    """(GPUs this container can use, where the count came from): CUDA_VISIBLE_DEVICES when the pod
    narrows it, else the /dev/nvidia<N> devices the NVIDIA container toolkit created, else the device
    plugin's list (UUIDs in NVIDIA_VISIBLE_DEVICES, or one file per GPU in the directory it names)."""
    cuda = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cuda:
        return len(_listed(cuda)), "CUDA_VISIBLE_DEVICES"
    dev = under_root(root, DEV)
    nodes = [p for p in dev.glob("nvidia*") if p.name.removeprefix("nvidia").isdigit()] if dev.is_dir() else []
    if nodes:
        return len(nodes), f"{DEV}/nvidia<N>"
    nvidia = env.get("NVIDIA_VISIBLE_DEVICES", "").strip()
    if nvidia.startswith("/"):
        listing = under_root(root, nvidia)
        files = list(listing.iterdir()) if listing.is_dir() else []
        return len(files), f"the device plugin's list in {nvidia}"
    if nvidia and nvidia not in ("all", "void", "none"):
        return len(_listed(nvidia)), "NVIDIA_VISIBLE_DEVICES"
    return 0, f"{DEV}/nvidia<N>"


# The image's CUDA 13 user space needs an R580 or newer kernel driver (CUDA 13.0 release notes, "CUDA
# Toolkit and Corresponding Driver Versions": >= 580.65.06 on Linux); the kernel module states its version here.
NVIDIA_DRIVER_VERSION = Path("/proc/driver/nvidia/version")
MIN_DRIVER_MAJOR = 580


def _driver_check(root: Path) -> PodCheck | None:
    """The NVIDIA kernel driver against the image's CUDA; None where the pod cannot see it."""
    try:
        text = under_root(root, NVIDIA_DRIVER_VERSION).read_text()
    except OSError:
        return None
    version = next((w for w in text.split() if w.count(".") >= 1 and w.split(".")[0].isdigit()), None)
    if version is None:
        return PodCheck("driver", False, f"cannot read a driver version in {NVIDIA_DRIVER_VERSION}", required=False)
    major = int(version.split(".")[0])
    if major >= MIN_DRIVER_MAJOR:
        return PodCheck("driver", True, f"NVIDIA driver {version}")
    return PodCheck(
        "driver",
        False,
        f"NVIDIA driver {version} is older than R{MIN_DRIVER_MAJOR}, which the image's CUDA 13 needs; upgrade the "
        "nodes' driver (with the GPU operator: its driver.version)",
    )


SOCKET_IFNAME_ENV = "NCCL_SOCKET_IFNAME"
NET_SYSFS = Path("/sys/class/net")


def _interface_check(ifname: str, root: Path) -> PodCheck:
    # NCCL_SOCKET_IFNAME is a list of name prefixes; "^" excludes and "=" asks for exact names
    # (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname).
    if ifname.startswith("^"):
        return PodCheck("socket-interface", True, f"{SOCKET_IFNAME_ENV}={ifname} excludes interfaces only")
    exact = ifname.startswith("=")
    wanted = [n.strip() for n in ifname.removeprefix("=").split(",") if n.strip()]
    sysfs = under_root(root, NET_SYSFS)
    present = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
    found = [w for w in wanted if any(p == w if exact else p.startswith(w) for p in present)]
    if found:
        return PodCheck("socket-interface", True, f"{SOCKET_IFNAME_ENV}={ifname}: {', '.join(found)} present")
    return PodCheck(
        "socket-interface",
        False,
        f"{SOCKET_IFNAME_ENV}={ifname} matches none of this pod's interfaces ({', '.join(present) or 'none'}); "
        "NCCL, Gloo and NVSHMEM could not bootstrap. Name one in topology.hardware.socket_interface or the "
        "chart's fabric.socketInterface",
    )


def _model_check(model_path: str, source: str, root: Path) -> PodCheck:
    # sglang would read a hub id as a repository to download: on a volume source the directory must be
    # the mounted checkpoint, with its config.json (what sglang and transformers read first).
    if not Path(model_path).is_absolute():
        return PodCheck(
            "model",
            False,
            f"model.source is {source}, but --model-path is {model_path!r}, a hub id and no directory in the pod; "
            "set the chart's model.path to the weights' directory under model.mountPath",
        )
    config = Path(model_path) / "config.json"
    if under_root(root, config).is_file():
        return PodCheck("model", True, f"{config} is there ({source} volume)")
    return PodCheck(
        "model",
        False,
        f"no {config} on the {source} volume: copy the checkpoint there, or set the chart's model.path to the "
        "directory under model.mountPath that holds config.json",
    )


def pod_checks(
    t: Topology,
    role: str,
    env: Mapping[str, str] | None = None,
    root: Path = Path("/"),
    model_source: str | None = None,
) -> list[PodCheck]:
    """What a GPU pod of this role needs, checked before sglang spends minutes loading weights.
    `model_source` (the chart's model.source) pvc or hostPath checks the model directory too."""
    checks: list[PodCheck] = []
    if role == "router":
        return checks
    env = os.environ if env is None else env
    want = t.hardware.gpus_per_node
    have, seen_in = visible_gpus(env, root)
    checks.append(
        PodCheck(
            "gpus",
            have >= want,
            f"{have} GPU(s) visible ({seen_in}), topology needs {want} per node"
            + ("" if have >= want else f"; the pod must request {want} GPUs (hardware.gpus_per_node)"),
        )
    )
    driver = _driver_check(root)
    if driver is not None:
        checks.append(driver)
    try:
        shm = shutil.disk_usage(under_root(root, SHM)).total
    except OSError:
        shm = 0
    checks.append(
        PodCheck(
            "shm",
            shm >= MIN_SHM_BYTES,
            f"/dev/shm is {shm / 2**30:.1f} GiB"
            + ("" if shm >= MIN_SHM_BYTES else f"; mount a memory emptyDir of >= {MIN_SHM_BYTES >> 30} GiB"),
        )
    )
    if model_source is not None and model_source != "hub":
        checks.append(_model_check(t.model_path(), model_source, root))
    if t.transfer.backend.startswith("mooncake"):
        checks.append(_memlock_check(root))
    ifname = env.get(SOCKET_IFNAME_ENV, "")
    if ifname:
        checks.append(_interface_check(ifname, root))
    if t.transfer.protocol == "rdma":
        sysfs = under_root(root, INFINIBAND_SYSFS)
        present = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
        # Mooncake opens transfer.ib_devices; NCCL and NVSHMEM get hardware.rdma_devices (NCCL_IB_HCA and
        # NVSHMEM_HCA_LIST from the chart), and a name they cannot find drops NCCL to sockets silently.
        named = {d: "transfer.ib_devices" for d in t.transfer.ib_devices.values()}
        named.update({d: "hardware.rdma_devices" for d in t.hardware.rdma_devices if d not in named})
        missing = sorted(d for d in named if d not in present)
        ok = bool(present) and not missing
        detail = f"IB devices present: {', '.join(present) or 'none'}"
        if not present:
            detail += "; expose RDMA (values: rdma.mode hostNetwork or devicePlugin) or set transfer.protocol: tcp"
        elif missing:
            keys = sorted({named[d] for d in missing})
            detail += (
                f"; missing {', '.join(missing)} named in {' and '.join(keys)}: name this node's devices "
                f"(ls {INFINIBAND_SYSFS}) there"
            )
        checks.append(PodCheck("rdma", ok, detail))
        if present:
            checks.append(_rdma_access_check(root))
    return checks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--role", required=True, choices=("prefill", "decode", "router"))
    parser.add_argument("--topology", required=True, metavar="FILE", help="the topology (the chart mounts it)")
    parser.add_argument("--dry-run", action="store_true", help="print the argv and env as JSON; start nothing")
    parser.add_argument(
        "--skip-checks", action="store_true", help="start even when a pod check fails (not recommended)"
    )
    parser.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="read the pod's files (the topology, devices, /sys, /dev/shm, the model volume) under DIR instead of "
        "/: checks a pod's filesystem laid out elsewhere (with --dry-run)",
    )
    parser.add_argument(
        "--kv-peers",
        default="",
        metavar="NAME,...",
        help="host names whose addresses may reach this engine's Mooncake ports (resolved every few seconds; "
        "the chart passes the prefill and decode headless Services)",
    )
    parser.add_argument(
        "--kv-allow-from",
        default="",
        metavar="CIDR,...",
        help="address ranges that may reach this engine's Mooncake ports, besides --kv-peers",
    )
    parser.add_argument(
        NO_KV_FIREWALL_FLAG,
        action="store_true",
        help="leave the Mooncake ports open to every source (unsafe: whoever reaches them reads and "
        "overwrites this engine's KV memory)",
    )
    parser.add_argument("router_args", nargs=argparse.REMAINDER, help="after --: extra arguments for the router")


NO_KV_FIREWALL_FLAG = "--no-kv-firewall"


def kv_firewall(args: argparse.Namespace, env: Mapping[str, str]) -> PeerFirewall | None:
    """The rules this engine pod installs for its Mooncake ports (not installed yet); None for the
    router and with --no-kv-firewall. LaunchError when no peer is named or a range is malformed."""
    if args.role == "router" or args.no_kv_firewall:
        return None
    peers = [p.strip() for p in args.kv_peers.split(",") if p.strip()]
    try:
        ranges: list[Network] = parse_networks(args.kv_allow_from)
    except ValueError as exc:
        raise LaunchError(f"--kv-allow-from: {exc}.") from exc
    if not peers and not ranges:
        raise LaunchError(
            "the Mooncake ports of this engine would accept no peer: name the PD engines that may reach them "
            "with --kv-peers (host names, e.g. the prefill and decode headless Services; the chart passes them) "
            f"or --kv-allow-from (CIDRs), or pass {NO_KV_FIREWALL_FLAG} to leave them open (unsafe)."
        )
    return PeerFirewall(role=args.role, ports=mooncake_port_range(dict(env)), peers=peers, allow_from=ranges)


def _firewall_doc(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object] | None:
    """What --dry-run says about the KV ports' rules: the plan, or the problem."""
    if args.role == "router":
        return None
    try:
        fw = kv_firewall(args, env)
    except LaunchError as exc:
        return {"problem": str(exc)}
    if fw is None:
        return {"off": True}
    return {
        "chain": fw.chain,
        "ports": f"{fw.ports[0]}-{fw.ports[1]}",
        "peers": list(fw.peers),
        "allow_from": [str(n) for n in fw.allow_from],
    }


# sglang's DP-attention sockets on the leader (dist-init port + 1..6 and worker ports) unpickle what they
# receive, from any peer while this is empty (sglang 0.5.23 srt/utils/network.py, restrict_zmq_peers; a
# comma-separated list of IP addresses).
ZMQ_PEERS_ENV = "SGLANG_ZMQ_ALLOWED_PEERS"
GROUP_WAIT_ENV = "SGLANG_PD_GROUP_WAIT_S"
HOST_IP_ENV = "SGLANG_HOST_IP"


def _leader_port(argv: list[str]) -> LeaderPort:
    try:
        return leader_port(argv)
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc


def group_plan(argv: list[str], env: Mapping[str, str], nodes: int, node_rank: int) -> dict[str, object]:
    """What this engine waits for and whom its ZMQ sockets admit: the group's pods (LWS names them from
    the leader's address), loopback and this pod's own address. A rank > 0 waits for the leader's name,
    then for the leader port sglang opens first (`group.leader_port`), never for one the leader opens
    only once this rank's sglang has joined (docs/multi-node-start.md)."""
    leader = env.get(LWS_LEADER_ADDRESS, "127.0.0.1")
    hosts = group_hosts(leader, nodes) if nodes > 1 else []
    doc: dict[str, object] = {"peer_hosts": hosts, "also_allowed": ["127.0.0.1", *filter(None, [env.get(HOST_IP_ENV)])]}
    if node_rank > 0:
        port = _leader_port(argv)
        doc["wait_for"] = port.address
        doc["wait_for_port"] = port.what
    return doc


def _join_group(argv: list[str], env: Mapping[str, str], nodes: int, node_rank: int) -> str:
    """Wait for the group as `group_plan` says; the value of SGLANG_ZMQ_ALLOWED_PEERS."""
    try:
        timeout = float(env.get(GROUP_WAIT_ENV, DEFAULT_LEADER_WAIT_S))
    except ValueError as exc:
        raise LaunchError(f"{GROUP_WAIT_ENV} must be a number of seconds: {exc}") from exc
    plan = group_plan(argv, env, nodes, node_rank)
    try:
        if node_rank > 0:
            wait_for_leader(_leader_port(argv), timeout)
        hosts = plan["peer_hosts"]
        found = resolve_all(list(hosts), timeout) if isinstance(hosts, list) else []
    except GroupWaitError as exc:
        raise LaunchError(str(exc)) from exc
    also = plan["also_allowed"]
    return ",".join(dict.fromkeys([*found, *(also if isinstance(also, list) else [])]))


# The interface NCCL, Gloo and NVSHMEM (DeepEP) open their bootstrap sockets on: left to themselves they
# take the first one they like, which on a node with CNI bridges or several NICs may be one the group's
# other nodes cannot reach (NCCL: docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
# #nccl-socket-ifname). The chart sets these from fabric.socketInterface or topology.hardware.socket_interface.
BOOTSTRAP_IFNAME_ENVS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
# sglang 0.5.23 pins the source address of its outgoing TCP ZMQ connects to this (srt/environ.py:371-372,
# srt/utils/network.py:476-504, to IP-literal endpoints only), so that a leader whose sockets admit only
# SGLANG_ZMQ_ALLOWED_PEERS sees this pod's own address, not another of a multi-homed node's.
ZMQ_SOURCE_IP_ENV = "SGLANG_ZMQ_SOURCE_IP"


@dataclass(frozen=True)
class BootstrapInterface:
    """The interface the bootstrap traffic takes, where launch learnt it, and what it adds to sglang's env."""

    name: str
    address: str | None
    source: str
    env: dict[str, str]


def _pod_address(env: Mapping[str, str]) -> tuple[str, str]:
    """(this pod's IP address, where it came from): SGLANG_HOST_IP (the chart sets status.podIP), else the
    address the pod's hostname resolves to (kubelet writes it into the pod's /etc/hosts)."""
    given = env.get(HOST_IP_ENV)
    if given:
        return given, HOST_IP_ENV
    hostname = socket.gethostname()
    try:
        return str(socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)[0][4][0]), f"hostname {hostname}"
    except OSError as exc:
        raise LaunchError(
            f"this pod's address is unknown: {HOST_IP_ENV} is not set and its hostname {hostname} does not resolve "
            f"({exc}); set {HOST_IP_ENV} to the pod's IP (the chart sets it to status.podIP), or name the bootstrap "
            "interface in topology.hardware.socket_interface."
        ) from exc


def bootstrap_interface(
    t: Topology, env: Mapping[str, str], nodes: int, interfaces: Mapping[str, Sequence[str]] | None = None
) -> BootstrapInterface:
    """The bootstrap interface of an engine pod: the one named (NCCL_SOCKET_IFNAME in the pod's env, else
    topology.hardware.socket_interface), kept as it is; else the interface that holds the pod's address
    (`_pod_address`; `interfaces`: name -> addresses, this machine's by default), given to NCCL, Gloo and
    NVSHMEM, with that address as sglang's ZMQ source. LaunchError when the address is on none of them, or is
    loopback in a group that spans nodes."""
    named = env.get(BOOTSTRAP_IFNAME_ENVS[0])
    if named:
        return BootstrapInterface(named, None, BOOTSTRAP_IFNAME_ENVS[0], {})
    if t.hardware.socket_interface:
        name = t.hardware.socket_interface
        added = {k: name for k in BOOTSTRAP_IFNAME_ENVS if not env.get(k)}
        return BootstrapInterface(name, None, "topology.hardware.socket_interface", added)
    address, source = _pod_address(env)
    try:
        ip = ipaddress.ip_address(address)
    except ValueError as exc:
        raise LaunchError(
            f"{source} gives {address!r}, which is not an IP address; set {HOST_IP_ENV} to the pod's IP (the chart "
            "sets it to status.podIP)."
        ) from exc
    if ip.is_loopback and nodes > 1:
        raise LaunchError(
            f"this pod's address {address} ({source}) is a loopback address, which the group's other nodes cannot "
            f"reach; set {HOST_IP_ENV} to this node's address (the chart sets it to status.podIP), or name the "
            "bootstrap interface in topology.hardware.socket_interface."
        )
    found = interface_addresses() if interfaces is None else interfaces
    holder = interface_of(address, found)
    if holder is None:
        listed = ", ".join(f"{n} {' '.join(a) or '(no address)'}" for n, a in found.items()) or "none"
        raise LaunchError(
            f"this pod's address {address} ({source}) is on none of its interfaces ({listed}), so NCCL, Gloo and "
            f"NVSHMEM would bootstrap on one of their own choosing; set {HOST_IP_ENV} to an address of this pod, "
            "or name the interface in topology.hardware.socket_interface (or the chart's fabric.socketInterface)."
        )
    added = dict.fromkeys(BOOTSTRAP_IFNAME_ENVS, holder)
    if not ip.is_loopback:  # a loopback source cannot reach another pod's IP-literal endpoint
        added[ZMQ_SOURCE_IP_ENV] = address
    return BootstrapInterface(holder, address, source, added)


INTERFACE_CHECK = "bootstrap-interface"


def _interface_detail(choice: BootstrapInterface) -> str:
    if choice.address is None:
        return f"{choice.name}, as {choice.source} names it"
    zmq = f", {ZMQ_SOURCE_IP_ENV}={choice.env[ZMQ_SOURCE_IP_ENV]}" if ZMQ_SOURCE_IP_ENV in choice.env else ""
    return (
        f"{choice.name} holds this pod's address {choice.address} ({choice.source}): "
        f"{', '.join(BOOTSTRAP_IFNAME_ENVS)}={choice.name}{zmq}"
    )


def _router_argv(args: argparse.Namespace) -> list[str]:
    extra = [a for a in args.router_args if a != "--"]
    return ["-m", "sglang_pd.deploy.cli", "router", "--topology", args.topology, *extra]


def _with_model_path(t: Topology, path: str) -> Topology:
    """`t` serving the weights at `path` under the name clients already use."""
    model = t.model.model_copy(update={"path": path, "served_name": t.model.name})
    moved = t.model_copy(update={"model": model})
    moved._source_dir = t.source_dir
    return moved


def _spec_nodes(t: Topology, role: Role) -> int:
    return t.prefill.nodes if role == "prefill" else t.decode.nodes


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_INVALID


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    os_env = os.environ if environ is None else environ
    root = Path(args.root)
    t, _ = load_checked_topology(under_root(root, args.topology))
    pd_role = as_role(args.role)
    try:
        pod = pod_settings_from_env(os_env, pd_role)
    except LaunchError as exc:
        return _fail(str(exc))
    role_env: dict[str, str] = {}
    if pod is not None and pd_role is not None:
        broken = check_rules(t, pod).errors
        if broken:
            listed = "\n".join(f"  - {e}" for e in broken)
            return _fail(f"the pod's settings do not fit the topology:\n{listed}")
        if pod.model_source != "hub":
            if pod.model_path:
                t = _with_model_path(t, pod.model_path)
            role_env[HF_OFFLINE_ENV] = "1"
    key: str | None = None
    try:
        if pd_role is None:
            # The router reads its worker key from the environment itself; check it as sglang's is.
            for name in (ENV_ROUTER_WORKER_API_KEY, ENV_WORKER_API_KEY):
                checked_worker_key(os_env, name)
            node_rank, argv = 0, _router_argv(args)
        else:
            cmd = resolve_command(t, args.role, os_env)
            node_rank, argv, role_env = cmd.node_rank, cmd.argv, {**cmd.env, **role_env}
            key = sglang_worker_key(argv, os_env, args.role)
    except LaunchError as exc:
        return _fail(str(exc))
    checks = pod_checks(t, args.role, {**os_env, **role_env}, root, pod.model_source if pod else None)
    interface: BootstrapInterface | None = None
    if pd_role is not None:
        # A pod check, so that --skip-checks starts without it (NCCL, Gloo and NVSHMEM then pick themselves).
        try:
            interface = bootstrap_interface(t, {**os_env, **role_env}, _spec_nodes(t, pd_role))
            checks.append(PodCheck(INTERFACE_CHECK, True, _interface_detail(interface)))
        except LaunchError as exc:
            checks.append(PodCheck(INTERFACE_CHECK, False, str(exc)))
    failed = [c for c in checks if not c.ok and c.required]
    for c in checks:
        verdict = "ok" if c.ok else ("FAILED" if c.required else "WARNING")
        print(f"pod check {c.name}: {verdict}: {c.detail}", file=sys.stderr)
    if args.dry_run:
        firewall_doc = _firewall_doc(args, {**os_env, **role_env})
        doc: dict[str, object] = {
            "role": args.role,
            "node_rank": node_rank,
            "python": sys.executable,  # runs argv, which starts with the module
            "argv": argv + ([CONFIG_FLAG, KEY_FILE_SHOWN] if key else []),
            "env": role_env,
            "checks": [{"name": c.name, "ok": c.ok, "required": c.required, "detail": c.detail} for c in checks],
            "kv_firewall": firewall_doc,
        }
        if pd_role is not None:
            # Added at start, as the group's SGLANG_ZMQ_ALLOWED_PEERS is: shown apart from the role's env.
            shown = next(c.detail for c in checks if c.name == INTERFACE_CHECK)
            doc["interface"] = {"problem": shown} if interface is None else asdict(interface)
            try:
                doc["group"] = group_plan(argv, os_env, _spec_nodes(t, pd_role), node_rank)
            except LaunchError as exc:
                doc["group"] = {"problem": str(exc)}
        print(json.dumps(doc, indent=2))
        # The same verdict as a real start: the pod would not start, so neither does the dry run pass.
        if failed and not args.skip_checks:
            return _fail(f"{len(failed)} pod check(s) failed; fix them or pass --skip-checks.")
        for part in (firewall_doc, doc.get("group")):
            if isinstance(part, dict) and "problem" in part:
                return _fail(str(part["problem"]))
        return EXIT_OK
    if failed and not args.skip_checks:
        return _fail(f"{len(failed)} pod check(s) failed; fix them or pass --skip-checks.")
    if interface is not None:
        role_env.update(interface.env)
    if pd_role is not None:
        # Ranks > 0 wait for the leader (LWS starts them with it), and every rank admits only its group.
        try:
            role_env[ZMQ_PEERS_ENV] = _join_group(argv, os_env, _spec_nodes(t, pd_role), node_rank)
        except LaunchError as exc:
            return _fail(str(exc))
    sys.stdout.flush()
    env = {**os_env, **role_env}
    if args.no_kv_firewall and args.role != "router":
        low, high = mooncake_port_range(env)
        print(
            f"warning: {NO_KV_FIREWALL_FLAG}: the Mooncake ports (TCP {low}-{high}) accept every source; whoever "
            "reaches them reads and overwrites this engine's KV memory.",
            file=sys.stderr,
        )
    try:
        firewall = kv_firewall(args, env)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if firewall is not None:
        low, high = firewall.ports
        http = t.prefill.port if args.role == "prefill" else t.decode.port
        if low <= http <= high:
            # The router and kubelet's probes are no PD peers: the rules would drop them.
            print(
                f"error: the {args.role} engine's HTTP port {http} lies in Mooncake's port range {low}-{high}, "
                f"which the rules close to all but the PD pods; move {args.role}.port in the topology, or move "
                "the range with MC_MIN_RPC_PORT and MC_MAX_RPC_PORT.",
                file=sys.stderr,
            )
            return 1
        # Before sglang starts, so that no moment exists in which its Mooncake ports are open.
        try:
            firewall.install()
        except FirewallError as exc:
            print(
                f"error: cannot fence the Mooncake ports (TCP {low}-{high}): {exc} Or pass {NO_KV_FIREWALL_FLAG} "
                "to start with them open to every source (unsafe).",
                file=sys.stderr,
            )
            return 1
    # Commands name a module (`-m ...`); this interpreter, the one the image installed us in, runs it.
    if key is None and firewall is None:
        os.execvpe(sys.executable, [sys.executable, *argv], env)
        return 0  # unreachable: execvpe replaces this process
    # This process stays: to mask the key, to remove its file, and to keep the peers' addresses in the
    # rules current.
    key_file = KeyFile(key) if key is not None else None
    command = [sys.executable, *argv, *(key_file.args() if key_file else [])]
    secrets = (key,) if key is not None else ()
    if firewall is not None:
        firewall.start()
    try:
        return supervise(command, env, secrets=secrets)
    finally:
        if key_file is not None:
            key_file.remove()
        # On the host's network (rdma.mode hostNetwork) the rules would outlive the pod.
        if firewall is not None:
            with contextlib.suppress(FirewallError):
                firewall.remove()


def supervise(argv: Sequence[str], env: Mapping[str, str], secrets: tuple[str, ...]) -> int:
    """Run `argv` as a child until it exits, its stdout and stderr copied here line by line with
    `secrets` masked; SIGTERM and SIGINT are passed on to it. Returns its exit status (128 + N when
    signal N ended it). The child dies with this process, however this one dies (`procs.spawn`)."""
    # Why this process stays instead of exec'ing sglang: sglang logs its whole ServerArgs at start,
    # api_key included (sglang/srt/entrypoints/engine.py), and `kubectl logs` would show the key.
    # Staying as the pod's PID 1, it masks that output and hands Kubernetes' SIGTERM to sglang,
    # which then has the whole termination grace period to stop.
    child = spawn("sglang", argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=False)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, _frame: child.proc.send_signal(signum))
    pumps = [
        threading.Thread(target=_copy_masked, args=(src, dst, secrets), daemon=True)
        for src, dst in ((child.proc.stdout, sys.stdout.buffer), (child.proc.stderr, sys.stderr.buffer))
    ]
    for pump in pumps:
        pump.start()
    code = child.proc.wait()
    # What sglang left of its process group would hold the pipes open; what it wrote stays readable.
    child.signal_group(signal.SIGKILL)
    for pump in pumps:
        pump.join(timeout=DRAIN_S)
    return 128 - code if code < 0 else code


def _copy_masked(src: IO[bytes], dst: IO[bytes], secrets: tuple[str, ...]) -> None:
    # Whole lines, so a key is never split between two reads; flushed at once, since sglang's
    # start-up lines are how an operator follows a pod that takes minutes to load.
    for raw in iter(src.readline, b""):
        dst.write(mask_secrets(raw, secrets, API_KEY_SHOWN))
        dst.flush()
