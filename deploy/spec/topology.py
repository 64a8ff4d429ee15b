"""The topology file: pydantic models of a PD deployment, loading, and the cross-role rules.

A topology (YAML) describes the model, the hardware and the roles; every other artefact
(sglang commands, the local stack, pod entrypoints, the Helm ConfigMap) is derived from it.
Per-field checks live on the models; checks that relate fields of different sections live in
`check_rules`, which returns errors (the topology cannot be deployed) and warnings.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from sglang_pd.deploy.common.contract import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_DECODE_PORT,
    DEFAULT_PREFILL_PORT,
    DEFAULT_ROUTER_PORT,
    Role,
    RoutingPolicy,
    SBOMode,
    policy_problem,
)
from sglang_pd.deploy.spec.model_shape import ShapeError, checkpoint_bytes
from sglang_pd.deploy.spec.presets import PRESETS_DIR
from sglang_pd.deploy.spec.rendered import DISPATCH_BUDGET_ENV, env_problems, extra_args_problems
from sglang_pd.deploy.spec.sbo_sms import send_sms_problems

__all__ = [
    "GPU_CAPABILITY",
    "MODEL_SOURCES",
    "RDMA_MODES",
    "UNPRIVILEGED_HOST_RDMA",
    "DecodeSpec",
    "HardwareSpec",
    "InstanceEndpoint",
    "ModelSource",
    "ModelSpec",
    "PodSettings",
    "PrefillSpec",
    "RdmaMode",
    "RouterSpec",
    "RuleReport",
    "SBOMode",
    "Topology",
    "TopologyError",
    "TransferSpec",
    "check_rules",
    "estimate_weight_bytes",
    "find_topology",
    "load_checked_topology",
    "load_topology",
    "parse_topology",
    "required_startup_s",
    "startup_budget_problem",
]

# sglang's default for SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK (sglang/srt/environ.py).
DEFAULT_DISPATCH_TOKEN_BUDGET = 128
# Shipped presets (`local-cpu`, ...) and model configs (deepseek-v3-config.json). A config is found
# by file name when a topology's relative `model.config_json` is not beside it (as in a pod).
SHIPPED_CONFIGS_DIR = PRESETS_DIR

Port = Annotated[int, Field(ge=1, le=65535)]
Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]
Positive = Annotated[int, Field(ge=1)]

# Compute capability of each GPU type a topology may name: sglang's predicates (SBO halves,
# attention defaults, the sm_90 SBO refusal) depend on it, and `plan --check` evaluates them
# with it. `hardware.compute_capability` covers a type missing here.
# Values from NVIDIA's CUDA GPU list (developer.nvidia.com/cuda-gpus); Ampere and Ada serve PD but not SBO.
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "A100": (8, 0),
    "A800": (8, 0),
    "L40S": (8, 9),
    "L20": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
    "H20": (9, 0),
    "H800": (9, 0),
    "GH200": (9, 0),
    "B100": (10, 0),
    "B200": (10, 0),
    "GB200": (10, 0),
    "B300": (10, 3),
    "GB300": (10, 3),
}


class TopologyError(ValueError):
    """A topology file that cannot be loaded or deployed; the message names the field and the fix."""


# `hardware.gpu` of the local reference stack.
CPU_GPU = "cpu"
# The field reference (scripts/gen_fields_doc.py writes it from these models).
FIELDS_DOC = "docs/fields.md"


def canonical_gpu(name: str) -> str | None:
    """`name` as GPU_CAPABILITY spells it (case-insensitive), `cpu`, or None for a GPU type not in the table."""
    key = name.strip().upper()
    if key == CPU_GPU.upper():
        return CPU_GPU
    return key if key in GPU_CAPABILITY else None


def gpu_problem(name: str, compute_capability: str | None) -> str | None:
    """Why `hardware.gpu: name` cannot be planned, with the nearest known names; None when it can."""
    if canonical_gpu(name) is not None or compute_capability:
        return None
    known = [*GPU_CAPABILITY, CPU_GPU]
    near = difflib.get_close_matches(name.strip().upper(), [k.upper() for k in known], n=3, cutoff=0.5)
    hint = f"Did you mean {' or '.join(canonical_gpu(n) or n for n in near)}? " if near else ""
    return (
        f"hardware.gpu: {name!r} is not a GPU type sglang-pd knows (known: {', '.join(known)}; case does not "
        f"matter). {hint}For another GPU type, set hardware.compute_capability (e.g. '9.0') as well."
    )


class _Strict(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default).
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """What is served."""

    path: str = Field(description="Local model directory or Hugging Face hub id.")
    served_name: str | None = Field(None, description="Name clients pass as `model`; defaults to `path`.")
    quantization: str | None = Field(None, description="sglang --quantization (None: from the checkpoint).")
    context_length: Positive | None = None
    page_size: Positive = Field(64, description="KV page size in tokens; 64 for FlashMLA.")
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16"] = "auto"
    trust_remote_code: bool = False
    config_json: Path | None = Field(
        None,
        description="config.json for shape checks: a path relative to the topology file, or the name of "
        "a shipped one (deepseek-v3-config.json).",
    )

    @property
    def name(self) -> str:
        return self.served_name or self.path


class HardwareSpec(_Strict):
    """The machines each role runs on."""

    gpu: str = Field(
        description=f"GPU type, one of {', '.join(GPU_CAPABILITY)} (any case), or `cpu` for the local reference "
        "stack; another type needs compute_capability too."
    )
    gpu_memory_gib: float = Field(gt=0)
    gpus_per_node: Positive
    rdma_devices: list[str] = Field(
        default_factory=list,
        description="RDMA devices of a node: one shared list, or one per GPU (length = gpus_per_node). The chart "
        "gives them to NCCL (NCCL_IB_HCA) and NVSHMEM (NVSHMEM_HCA_LIST); NVSHMEM gives each GPU its closest NIC "
        "(docs/cluster-prerequisites.md).",
    )
    socket_interface: str | None = Field(
        None,
        description="Host interface for NCCL, Gloo and NVSHMEM bootstrap traffic (the chart sets NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME and NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME to it), e.g. bond0; None: each picks one, which on "
        "host-network nodes with CNI and bridge interfaces may be one the other nodes cannot reach.",
    )
    compute_capability: str | None = Field(
        None,
        pattern=r"^\d+\.\d+$",
        description="CUDA compute capability, e.g. '9.0'; needed only for a GPU type sglang-pd does not know.",
    )
    colocated: bool = Field(
        False,
        description="Prefill and decode run on one node and share its GPUs, each taking part of their memory "
        "(mem_fraction_static), as `sglang-pd up` runs them; false: each instance has nodes of its own.",
    )

    @field_validator("gpu")
    @classmethod
    def _gpu_as_the_table_spells_it(cls, v: str) -> str:
        # `h200` and `H200` are one GPU: every table keyed by the name (GPU_CAPABILITY, the estimate's
        # hardware.yaml, the SBO send-SM defaults) then finds it. An unknown name is a rule error
        # (`gpu_problem`), so that it is reported with the other rules.
        return canonical_gpu(v) or v.strip()

    def capability(self) -> tuple[int, int] | None:
        """The GPUs' compute capability: the explicit field, else the known GPU type's, else None."""
        if self.compute_capability:
            major, minor = self.compute_capability.split(".")
            return int(major), int(minor)
        return GPU_CAPABILITY.get(self.gpu.upper())


class TBOSpec(_Strict):
    enabled: bool = False
    token_distribution_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 0.48


MoEA2ABackend = Literal["none", "deepep"]
DeepEPMode = Literal["normal", "low_latency", "auto"]
# sglang's --moe-runner-backend values that apply to DeepSeek-class FP8/BF16 checkpoints.
MoERunnerBackend = Literal[
    "auto", "deep_gemm", "triton", "triton_kernel", "cutlass", "flashinfer_cutlass", "flashinfer_cutedsl",
    "flashinfer_trtllm",
]  # fmt: skip
# sglang's --attention-backend values for MLA models on NVIDIA GPUs.
AttentionBackend = Literal["fa3", "flashmla", "flashinfer", "triton", "cutlass_mla", "trtllm_mla", "fa4"]


class _RoleSpec(_Strict):
    nodes: Positive = Field(1, description="Nodes per instance (prefill) or per group (decode).")
    tp: Positive = Field(description="sglang --tp: GPUs of one instance/group.")
    attn_dp_size: Positive = Field(1, description="sglang --attn-dp-size (DP attention); 1 = off.")
    ep: Positive = Field(1, description="sglang --ep (expert parallel size).")
    moe_a2a_backend: MoEA2ABackend = "none"
    deepep_mode: DeepEPMode = "auto"
    moe_runner_backend: MoERunnerBackend = Field(
        "auto",
        description="sglang --moe-runner-backend; decode.sbo: full needs deep_gemm on Hopper (sglang's SboFlags).",
    )
    attention_backend: AttentionBackend | None = Field(
        None, description="sglang --attention-backend; None: sglang's default for the GPU (fa3 on Hopper for MLA)."
    )
    dp_lm_head: bool = Field(
        False,
        description="sglang --enable-dp-lm-head: a replicated LM head under DP attention. Off is sglang's default "
        "(a vocab-sharded head; sglang PR #32313).",
    )
    tbo: TBOSpec = Field(default_factory=TBOSpec)
    mem_fraction_static: Fraction | None = None
    max_running_requests: Positive | None = None
    chunked_prefill_size: int | None = Field(None, ge=-1)
    max_prefill_tokens: Positive | None = None
    port: Port = DEFAULT_PREFILL_PORT
    extra_args: list[str] = Field(default_factory=list, description="Appended to the sglang argv.")
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env", mode="before")
    @classmethod
    def _env_values_are_strings(cls, v: Any) -> Any:
        # YAML turns `EP_MIN_TOKENS_PER_PART: 1` into an int; environment values are strings.
        if isinstance(v, dict):
            return {k: (str(x).lower() if isinstance(x, bool) else str(x)) for k, x in v.items()}
        return v

    @property
    def attn_tp(self) -> int:
        """Tensor-parallel size inside one attention DP rank."""
        return self.tp // self.attn_dp_size if self.tp % self.attn_dp_size == 0 else 0


class PrefillSpec(_RoleSpec):
    """Prefill instances: TP (usually 8 on one node), TBO, DeepEP normal."""

    instances: Positive = 1
    bootstrap_port: Port = DEFAULT_BOOTSTRAP_PORT


class DecodeSpec(_RoleSpec):
    """Decode groups: DP attention + EP across nodes, DeepEP low-latency, SBO."""

    groups: Positive = 1
    port: Port = DEFAULT_DECODE_PORT
    sbo: SBOMode = SBOMode.OFF
    cuda_graph_max_bs: Positive | None = Field(None, description="sglang --cuda-graph-max-bs-decode.")
    dispatch_token_budget: Positive = Field(
        DEFAULT_DISPATCH_TOKEN_BUDGET,
        description="SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK: tokens one rank may dispatch.",
    )
    sbo_send_sms: Annotated[int, Field(ge=1, strict=True)] | None = Field(
        None,
        description="SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS with sbo: full: SMs DeepEP's combine sends on while the "
        "down GEMM runs on the rest. None: the default for the GPU type (deploy/spec/sbo_sms.py); the rules check it "
        "against the link and the GEMM's tiles (docs/topology.md).",
    )

    @field_validator("sbo", mode="before")
    @classmethod
    def _sbo_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return SBOMode.FULL if v else SBOMode.OFF
        return v


class TransferSpec(_Strict):
    """KV transfer between prefill and decode."""

    backend: Literal["mooncake", "nixl", "mori", "mooncake_tcp", "fake"] = "mooncake"
    protocol: Literal["rdma", "tcp"] = "rdma"
    ib_devices: dict[int, str] = Field(
        default_factory=dict, description="GPU index -> IB device for KV transfer (empty: auto)."
    )


class RouterSpec(_Strict):
    """The OpenAI-facing PD router."""

    host: str = "0.0.0.0"
    port: Port = DEFAULT_ROUTER_PORT
    prefill_policy: RoutingPolicy = "cache_aware"
    decode_policy: RoutingPolicy = "power_of_two"
    max_concurrent_requests: Positive = 1024
    max_queued_requests: Annotated[int, Field(ge=0)] = 2048
    queue_timeout_s: float = Field(60.0, gt=0)
    request_timeout_s: float = Field(1800.0, gt=0)

    @field_validator("decode_policy")
    @classmethod
    def _decode_policy_fits_decode(cls, v: str) -> str:
        problem = policy_problem("decode", v)
        if problem is not None:
            raise ValueError(problem)
        return v


class Topology(_Strict):
    """A whole PD deployment."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=40)
    model: ModelSpec
    hardware: HardwareSpec
    prefill: PrefillSpec
    decode: DecodeSpec
    transfer: TransferSpec = Field(default_factory=TransferSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    # Where the file came from, for relative paths; not part of the file.
    _source_dir: Path | None = PrivateAttr(None)

    @property
    def source_dir(self) -> Path | None:
        return self._source_dir

    @property
    def is_local(self) -> bool:
        """All roles on this one host (the reference stack), rather than GPU nodes."""
        return self.hardware.gpu.lower() == "cpu"

    @property
    def colocated(self) -> bool:
        """Every instance on one node, sharing its GPUs: a CPU topology, or `hardware.colocated`."""
        return self.is_local or self.hardware.colocated

    def model_path(self) -> str:
        """What sglang gets as --model-path: a model folder given relative to the topology file (as the
        shipped `single-h200` preset does) becomes absolute; hub ids and absolute paths pass through."""
        p = Path(self.model.path)
        if p.is_absolute() or self.source_dir is None:
            return self.model.path
        beside = self.source_dir / p
        return str(beside.resolve()) if beside.is_dir() else self.model.path

    def config_json_path(self) -> Path | None:
        p = self.model.config_json
        if p is None or p.is_absolute():
            return p
        beside = (self.source_dir or Path.cwd()) / p
        shipped = SHIPPED_CONFIGS_DIR / p
        return shipped if not beside.exists() and shipped.exists() else beside

    def load_model_config(self) -> dict[str, Any] | None:
        """The model's config.json as a dict, when the topology names one."""
        path = self.config_json_path()
        if path is None:
            return None
        try:
            return dict(json.loads(path.read_text()))
        except FileNotFoundError as exc:
            raise TopologyError(
                f"model.config_json: file {path} does not exist; give a path to the model's config.json "
                "(relative to the topology file) or remove the key."
            ) from exc
        except json.JSONDecodeError as exc:
            raise TopologyError(f"model.config_json: {path} is not valid JSON ({exc}).") from exc

    def instance_endpoints(self, role: Role) -> list[InstanceEndpoint]:
        """Where each prefill instance or decode group listens. On one host (a colocated topology)
        instances take consecutive ports from the role's; in a cluster each is its own pod and
        listens on the role's ports themselves."""
        spec = self.prefill if role == "prefill" else self.decode
        count = self.prefill.instances if role == "prefill" else self.decode.groups
        step = 1 if self.colocated else 0
        return [
            InstanceEndpoint(
                role=role,
                index=i,
                port=spec.port + i * step,
                bootstrap_port=self.prefill.bootstrap_port + i * step if role == "prefill" else None,
            )
            for i in range(count)
        ]

    def static_workers(self) -> tuple[list[tuple[str, int]], list[str]]:
        """Worker URLs known without discovery: the local stack's. Clusters discover pods instead."""
        if not self.is_local:
            return [], []
        prefill = [(ep.url, ep.bootstrap_port or DEFAULT_BOOTSTRAP_PORT) for ep in self.instance_endpoints("prefill")]
        return prefill, [ep.url for ep in self.instance_endpoints("decode")]


@dataclass(frozen=True)
class InstanceEndpoint:
    """The ports of one prefill instance or decode group (`Topology.instance_endpoints`)."""

    role: Role
    index: int
    port: int
    bootstrap_port: int | None  # prefill only
    host: str = "127.0.0.1"

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _section_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model whose keys sit at `loc` inside a topology (`()` is the top level), or None (a dict's keys)."""
    model: type[BaseModel] = Topology
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _unknown_key_message(loc: tuple[int | str, ...]) -> str:
    section = _section_at(loc[:-1])
    where = ".".join(str(p) for p in loc[:-1]) or "the top level"
    # Sorted, and in the chart's words (`sglang-pd.unknownKeys` in templates/_helpers.tpl), which
    # has no string similarity: the "did you mean" hint is launch's alone.
    allowed = f"; {where} takes {', '.join(sorted(section.model_fields))}" if section is not None else ""
    near = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1) if section is not None else []
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"unknown key{hint}{allowed}. Every field is described in {FIELDS_DOC}."


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid topology"]
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            msg = _unknown_key_message(tuple(err["loc"]))
        elif err["type"] == "missing":
            msg = "required key is missing"
        else:
            msg = err["msg"]
            if "input" in err and not isinstance(err["input"], dict | list):
                msg += f" (got {err['input']!r})"
        lines.append(f"  {path}: {msg}")
    return "\n".join(lines)


def parse_topology(data: Any, source: str = "<topology>", source_dir: Path | None = None) -> Topology:
    """Validate already-loaded YAML data; raises TopologyError naming every bad key path."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: a topology must be a YAML mapping at the top level, got {type(data).__name__}.")
    try:
        topology = Topology.model_validate(data)
    except ValidationError as exc:
        raise TopologyError(_format_validation_error(exc, source)) from exc
    topology._source_dir = source_dir
    return topology


def find_topology(name: str | Path) -> Path:
    """A topology file path, or the name of a shipped preset (`local-cpu`, ...)."""
    path = Path(name)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.y*ml"))
        hint = f" It holds {', '.join(inside)}." if inside else ""
        raise TopologyError(
            f"{name}: is a folder, not a topology file; give a topology YAML file or a preset name "
            f"(e.g. local-cpu).{hint}"
        )
    if path.exists():
        return path
    preset = PRESETS_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and preset.exists():
        return preset
    presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
    raise TopologyError(f"{name}: no such topology file, nor a preset of that name (presets: {presets}).")


def load_topology(name: str | Path) -> Topology:
    """Read and validate a topology file or preset (per-field checks only; see `check_rules`)."""
    path = find_topology(name)
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise TopologyError(f"{path}: malformed YAML{where}: {getattr(exc, 'problem', exc)}.") from exc
    return parse_topology(data, str(path), path.parent.resolve())


def load_checked_topology(name: str | Path) -> tuple[Topology, RuleReport]:
    """`load_topology` then `check_rules`; a broken rule raises TopologyError listing every one."""
    t = load_topology(name)
    rules = check_rules(t)
    if rules.errors:
        listed = "\n".join(f"  - {e}" for e in rules.errors)
        raise TopologyError(f"{name}: the topology breaks {len(rules.errors)} rule(s):\n{listed}")
    return t, rules


# --- model size and start-up time -------------------------------------------------------------

# What a GPU pod does before its /health answers, for the startup budget a pod needs (the chart's
# defaults are the same numbers): download the checkpoint (hub only), read it into GPU memory, then
# sglang's warm-up (DeepGEMM JIT compiles its kernels there, 10-20 minutes on a cold cache). The read
# rate is what network filesystems (NFS, Lustre) often give one node, 0.5-1 GB/s: a probe that kills a
# slow loader recreates its whole LeaderWorkerSet group, so the budget errs long.
DEFAULT_DOWNLOAD_BYTES_PER_S = 500_000_000
DEFAULT_LOAD_BYTES_PER_S = 1_000_000_000
DEFAULT_WARMUP_S = 1200


def estimate_weight_bytes(cfg: dict[str, Any]) -> int:
    """Checkpoint size of a config.json (`model_shape.checkpoint_bytes`), as a topology error."""
    try:
        return checkpoint_bytes(cfg)
    except ShapeError as e:
        raise TopologyError(str(e)) from None


def required_startup_s(
    weight_bytes: int,
    model_source: str,
    download_bytes_per_s: float = DEFAULT_DOWNLOAD_BYTES_PER_S,
    load_bytes_per_s: float = DEFAULT_LOAD_BYTES_PER_S,
    warmup_s: int = DEFAULT_WARMUP_S,
) -> int:
    """Seconds from container start to a healthy sglang server on a cold node. Each step is rounded up to
    whole seconds in integers, as the chart's template does (templates/_helpers.tpl, startupSeconds), so
    that both arrive at the same number."""

    def seconds(rate: float) -> int:
        return -(-weight_bytes // int(rate))

    download = seconds(download_bytes_per_s) if model_source == "hub" else 0
    return download + seconds(load_bytes_per_s) + warmup_s


# The chart's `rdma.mode` and `model.source` values.
RdmaMode = Literal["hostNetwork", "devicePlugin", "none"]
RDMA_MODES: tuple[RdmaMode, ...] = get_args(RdmaMode)
ModelSource = Literal["hub", "pvc", "hostPath"]
MODEL_SOURCES: tuple[ModelSource, ...] = get_args(ModelSource)


@dataclass(frozen=True)
class PodSettings:
    """How the pods of a cluster deployment are set up (the chart's values, or what a pod sees).

    The cross-role rules check these against the topology when they are known: `sglang-pd launch`
    reads them from the environment the chart sets; offline checks pass them explicitly. The
    startup figures are the ones the chart derived its startup probe from, so that the pod checks
    the budget with the chart's numbers, never with defaults of its own.
    """

    rdma_mode: RdmaMode = "hostNetwork"
    privileged: bool = True
    model_source: ModelSource = "pvc"
    startup_budget_s: int | None = None
    download_bytes_per_s: float = DEFAULT_DOWNLOAD_BYTES_PER_S
    load_bytes_per_s: float = DEFAULT_LOAD_BYTES_PER_S
    warmup_s: int = DEFAULT_WARMUP_S
    # The checkpoint size the chart's budget assumes (model.sizeBytes or its estimate); None: estimated
    # here from model.config_json.
    weight_bytes: int | None = None
    # The weights' directory inside the pod (model.source pvc or hostPath): sglang's --model-path.
    model_path: str | None = None
    # The role whose pod this is, for messages naming its chart values; None: offline checks.
    role: Role | None = None


# --- cross-role rules -------------------------------------------------------------------------


@dataclass(frozen=True)
class RuleReport:
    """The result of the cross-role rules: errors block a deployment, warnings do not."""

    errors: list[str]
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return not self.errors


# NVSHMEM's NIC selection (https://docs.nvidia.com/nvshmem/api/gen/env.html): by default each PE takes the
# NIC closest to its GPU. NVSHMEM_HCA_PE_MAPPING (`hca_name:port:count`, comma-separated; PE0, PE1, ... of a
# node in turn) and NVSHMEM_HCA_LIST take effect only with NVSHMEM_ENABLE_NIC_PE_MAPPING=1, and NVSHMEM
# ignores the mapping when a list is set. docs/cluster-prerequisites.md says why the chart sets no mapping.
NVSHMEM_MAPPING_ENV = "NVSHMEM_HCA_PE_MAPPING"
NVSHMEM_ENABLE_MAPPING_ENV = "NVSHMEM_ENABLE_NIC_PE_MAPPING"
NVSHMEM_HCA_LIST_ENV = "NVSHMEM_HCA_LIST"
# Attention backends that force a KV page size (sglang/srt/arg_groups/overrides.py).
PAGE_SIZES_OF_BACKEND: dict[str, tuple[int, ...]] = {"flashmla": (64,), "trtllm_mla": (32, 64)}


def _role_rules(t: Topology, role: str, spec: _RoleSpec, errors: list[str]) -> None:
    gpn = t.hardware.gpus_per_node
    count = "instance" if role == "prefill" else "group"
    if spec.tp % spec.attn_dp_size:
        errors.append(
            f"{role}.attn_dp_size: {spec.attn_dp_size} does not divide {role}.tp={spec.tp}; each attention "
            f"DP rank needs a whole number of GPUs (tp = attn_dp_size x attention TP). "
            f"Set attn_dp_size to a divisor of {spec.tp}."
        )
    if spec.tp != spec.nodes * gpn:
        errors.append(
            f"{role}.tp: {spec.tp} GPUs per {count} do not fill {role}.nodes={spec.nodes} x "
            f"hardware.gpus_per_node={gpn} = {spec.nodes * gpn} GPUs. "
            f"Set {role}.tp to {spec.nodes * gpn} or {role}.nodes to match."
        )
    if spec.moe_a2a_backend == "deepep" and spec.ep != spec.tp:
        errors.append(
            f"{role}.ep: DeepEP is the all-to-all ({role}.moe_a2a_backend=deepep), which needs ep = tp, "
            f"but ep={spec.ep} and tp={spec.tp}. Set {role}.ep to {spec.tp}."
        )
    if spec.ep > 1 and spec.tp % spec.ep:
        errors.append(f"{role}.ep: {spec.ep} must divide {role}.tp={spec.tp}.")
    # What extra_args and env would override (deploy/spec/rendered.py): the values these rules check.
    errors += extra_args_problems(role, spec.extra_args)
    errors += env_problems(role, spec.env)
    if NVSHMEM_MAPPING_ENV in spec.env:
        _nic_mapping_rules(t, role, spec, errors)


def _nic_mapping_rules(t: Topology, role: str, spec: _RoleSpec, errors: list[str]) -> None:
    """A role's own NVSHMEM_HCA_PE_MAPPING (in <role>.env): what NVSHMEM needs for it to take effect as meant."""
    key = f"{role}.env.{NVSHMEM_MAPPING_ENV}"
    value = spec.env[NVSHMEM_MAPPING_ENV]
    gpn = t.hardware.gpus_per_node
    entries = [e.split(":") for e in value.split(",")]
    if not value or any(len(e) != 3 or not e[0] or not e[1].isdigit() or not e[2].isdigit() for e in entries):
        errors.append(
            f"{key}: {value!r} is not NVSHMEM's format, comma-separated hca_name:port:count entries "
            f"(e.g. mlx5_0:1:2,mlx5_1:1:2 puts PE0 and PE1 on port 1 of mlx5_0, PE2 and PE3 on mlx5_1); fix it."
        )
        return
    pes = sum(int(e[2]) for e in entries)
    if pes != gpn:
        errors.append(
            f"{key}: its counts add up to {pes} PEs, but a node runs hardware.gpus_per_node={gpn} (one PE per GPU); "
            f"make the counts add up to {gpn}."
        )
    unknown = sorted({e[0] for e in entries} - set(t.hardware.rdma_devices))
    if t.hardware.rdma_devices and unknown:
        errors.append(
            f"{key}: {', '.join(unknown)} not among hardware.rdma_devices ({', '.join(t.hardware.rdma_devices)}); "
            "name the node's RDMA devices."
        )
    if spec.env.get(NVSHMEM_ENABLE_MAPPING_ENV) != "1":
        errors.append(
            f"{key}: NVSHMEM ignores the mapping unless {NVSHMEM_ENABLE_MAPPING_ENV}=1; "
            f'add {NVSHMEM_ENABLE_MAPPING_ENV}: "1" to {role}.env.'
        )
    if spec.env.get(NVSHMEM_HCA_LIST_ENV):
        errors.append(
            f"{key}: NVSHMEM ignores the mapping when {NVSHMEM_HCA_LIST_ENV} is set too; remove "
            f"{role}.env.{NVSHMEM_HCA_LIST_ENV}."
        )
    if spec.moe_a2a_backend == "deepep" and spec.deepep_mode == "normal" and spec.nodes > 1:
        # DeepEP's normal mode runs one NVSHMEM job per local GPU index, with one PE per node (its Buffer takes
        # the NVSHMEM id of its RDMA root rank, deep_ep/buffers/legacy.py in sgl-deep-ep 0.1.2.post1): every
        # GPU is PE 0 of its node there, so the mapping's first entry would serve them all.
        errors.append(
            f"{key}: {role}.deepep_mode is normal, in which every GPU is the only NVSHMEM PE of its node, so the "
            f"mapping would put every GPU on its first NIC; remove {key} and {role}.env.{NVSHMEM_ENABLE_MAPPING_ENV} "
            "(NVSHMEM then gives each GPU its closest NIC)."
        )


def _shape_rules(t: Topology, cfg: dict[str, Any], errors: list[str]) -> None:
    heads = cfg.get("num_attention_heads")
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts")
    for role, spec in (("prefill", t.prefill), ("decode", t.decode)):
        if heads and spec.attn_tp and heads % spec.attn_tp:
            errors.append(
                f"{role}.attn_dp_size: attention TP = tp / attn_dp_size = {spec.attn_tp} does not divide "
                f"the model's num_attention_heads={heads} ({t.config_json_path()}). "
                f"Choose attn_dp_size so that tp / attn_dp_size divides {heads}."
            )
        if experts and spec.ep > 1 and experts % spec.ep:
            errors.append(
                f"{role}.ep: {spec.ep} does not divide the model's {experts} routed experts; "
                f"choose ep among the divisors of {experts}."
            )


def check_rules(t: Topology, pod: PodSettings | None = None) -> RuleReport:
    """The cross-role rules of a deployable topology; with `pod`, also those of its cluster pods."""
    errors: list[str] = []
    warnings: list[str] = []
    p, d = t.prefill, t.decode

    gpu_error = gpu_problem(t.hardware.gpu, t.hardware.compute_capability)
    if gpu_error is not None:
        errors.append(gpu_error)
    _role_rules(t, "prefill", p, errors)
    _role_rules(t, "decode", d, errors)

    if d.sbo is not SBOMode.OFF:
        if d.moe_a2a_backend != "deepep" or d.deepep_mode != "low_latency":
            errors.append(
                f"decode.sbo: single-batch overlap ({d.sbo.value}) overlaps DeepEP low-latency dispatch/"
                f"combine, but decode uses moe_a2a_backend={d.moe_a2a_backend}, deepep_mode={d.deepep_mode}. "
                "Set decode.moe_a2a_backend: deepep and decode.deepep_mode: low_latency, or sbo: off."
            )
        if d.attn_dp_size == 1 and d.tp > 1:
            errors.append(
                "decode.sbo: single-batch overlap needs DP attention on a multi-GPU decode (decode.attn_dp_size > 1); "
                f"set decode.attn_dp_size (e.g. {d.tp}) or sbo: off."
            )
    if d.sbo is SBOMode.FULL:
        _sbo_runner_rule(t, errors)
    if d.tbo.enabled:
        warnings.append(
            "decode.tbo.enabled: two-batch overlap on decode cost 8-22% throughput in ATOM's measurements "
            "(GPT-OSS-120B on 2x MI355X, ROCm/ATOM docs/TBO.md), where prefill-only TBO gained up to 17%; "
            "prefer decode.sbo and keep TBO for prefill."
        )

    # Per-rank decode batch: DP attention splits running requests over attn_dp_size schedulers.
    per_rank = math.ceil(d.max_running_requests / d.attn_dp_size) if d.max_running_requests else None
    if d.moe_a2a_backend == "deepep" and d.deepep_mode in ("low_latency", "auto"):
        if per_rank is not None and per_rank > d.dispatch_token_budget:
            errors.append(
                f"decode.dispatch_token_budget: {d.dispatch_token_budget} tokens per rank cannot hold the "
                f"per-rank decode batch max_running_requests/attn_dp_size = {d.max_running_requests}/"
                f"{d.attn_dp_size} = {per_rank}; DeepEP low-latency buffers are sized by the budget and "
                f"overflow at run time. Raise decode.dispatch_token_budget to >= {per_rank} or lower "
                "decode.max_running_requests."
            )
        if d.cuda_graph_max_bs is not None and d.cuda_graph_max_bs > d.dispatch_token_budget:
            errors.append(
                f"decode.cuda_graph_max_bs: {d.cuda_graph_max_bs} exceeds decode.dispatch_token_budget="
                f"{d.dispatch_token_budget}; a captured batch would overflow DeepEP's dispatch buffer. "
                f"Raise dispatch_token_budget to >= {d.cuda_graph_max_bs} or lower cuda_graph_max_bs."
            )
    if p.moe_a2a_backend == "deepep" and p.deepep_mode == "low_latency":
        # Every prefill forward goes through the low-latency buffers, which hold sglang's default budget
        # (the renderer exports decode.dispatch_token_budget to the decode only); a chunk is one forward.
        # Under DP attention sglang gives each rank chunked_prefill_size // attn_dp_size tokens
        # (srt/arg_groups/parallel_hook.py:314-336, `_handle_data_parallelism`).
        chunk, ranks = p.chunked_prefill_size, p.attn_dp_size
        if chunk is None or chunk <= 0 or chunk // ranks > DEFAULT_DISPATCH_TOKEN_BUDGET:
            shown = "unset (sglang then picks thousands)" if chunk is None else str(chunk)
            if chunk is not None and chunk > 0 and ranks > 1:
                shown += f", {chunk // ranks} tokens a rank once sglang divides it by prefill.attn_dp_size={ranks}"
            errors.append(
                f"prefill.chunked_prefill_size: {shown}, but with prefill.deepep_mode: low_latency each prefill chunk "
                f"is one DeepEP low-latency dispatch of at most {DEFAULT_DISPATCH_TOKEN_BUDGET} tokens a rank "
                f"(sglang's {DISPATCH_BUDGET_ENV}); a larger one fails DeepEP's host assert at run time. "
                f"Set prefill.chunked_prefill_size to at most {DEFAULT_DISPATCH_TOKEN_BUDGET * ranks}, or "
                "prefill.deepep_mode: normal."
            )
    if d.cuda_graph_max_bs is not None and per_rank is not None and d.cuda_graph_max_bs > per_rank:
        warnings.append(
            f"decode.cuda_graph_max_bs: {d.cuda_graph_max_bs} is above the per-rank batch {per_rank}; "
            "graphs for larger batches are captured but never used."
        )
    if not t.is_local and per_rank is not None:
        _graph_cover_rule(d, per_rank, errors, warnings)

    for role, spec in (("prefill", p), ("decode", d)):
        allowed = PAGE_SIZES_OF_BACKEND.get(spec.attention_backend or "")
        if allowed and t.model.page_size not in allowed:
            # sglang snaps the page size of that role only (arg_groups/overrides.py,
            # _mla_backend_page_constraints), and KV pages must be equal on both roles.
            errors.append(
                f"{role}.attention_backend: {spec.attention_backend} takes {'/'.join(map(str, allowed))}-token pages "
                f"and sglang would change this role's page size from model.page_size={t.model.page_size}, so prefill "
                f"and decode pages would differ. Set model.page_size: {allowed[-1]} or another attention backend."
            )

    ports = {
        "prefill.port": p.port,
        "prefill.bootstrap_port": p.bootstrap_port,
        "decode.port": d.port,
        "router.port": t.router.port,
    }
    if t.colocated:
        for role, spec in (("prefill", p), ("decode", d)):
            if spec.nodes > 1:
                why = "a CPU topology runs on this host" if t.is_local else "hardware.colocated puts all on one node"
                errors.append(
                    f"{role}.nodes: {spec.nodes}, but {why}; set {role}.nodes: 1"
                    + ("." if t.is_local else " or hardware.colocated: false.")
                )
        # One host: every listening port must be distinct (instances take consecutive ports).
        spans = {
            "prefill.port": p.instances,
            "prefill.bootstrap_port": p.instances,
            "decode.port": d.groups,
            "router.port": 1,
        }
        taken: dict[int, str] = {}
        for key, base in ports.items():
            for port in range(base, base + spans[key]):
                if port in taken:
                    errors.append(
                        f"{key}: port {port} is also used by {taken[port]} on this host; choose another port."
                    )
                taken.setdefault(port, key)
    elif p.bootstrap_port == p.port:
        errors.append(
            f"prefill.bootstrap_port: {p.bootstrap_port} equals prefill.port; the bootstrap server and the "
            "HTTP server both listen on the prefill leader. Choose another bootstrap_port (default 8998)."
        )

    if t.transfer.ib_devices and t.transfer.protocol == "tcp":
        warnings.append("transfer.ib_devices: ignored with transfer.protocol=tcp.")
    for gpu in t.transfer.ib_devices:
        if not 0 <= gpu < t.hardware.gpus_per_node:
            errors.append(f"transfer.ib_devices.{gpu}: GPU index out of range 0..{t.hardware.gpus_per_node - 1}.")
    rdma = t.hardware.rdma_devices
    if rdma and t.transfer.ib_devices:
        # KV transfer (Mooncake) and NCCL/NVSHMEM would use different NICs of the same node: one list is stale.
        unknown = sorted(set(t.transfer.ib_devices.values()) - set(rdma))
        if unknown:
            errors.append(
                f"transfer.ib_devices: {', '.join(unknown)} not among hardware.rdma_devices ({', '.join(rdma)}); "
                "name the same devices in both, or leave transfer.ib_devices empty (Mooncake then picks them)."
            )

    try:
        cfg = t.load_model_config()
    except TopologyError as exc:  # reported with the other rules rather than alone
        errors.append(str(exc))
        cfg = None
    if t.model.config_json is None:
        warnings.append(
            "model.config_json: unset, so the checks against the model's shape are skipped (attention heads against "
            "attention TP, routed experts against ep, the decode's SBO send SMs against the GEMM's tiles, and the "
            "checkpoint size behind a pod's startup budget). Set it to the model's config.json."
        )
    if cfg is not None:
        _shape_rules(t, cfg, errors)
    _sbo_send_sms_rule(t, cfg, errors, warnings)
    if pod is not None and not t.is_local:
        _pod_rules(t, pod, cfg, errors)
    return RuleReport(errors=errors, warnings=warnings)


def _sbo_runner_rule(t: Topology, errors: list[str]) -> None:
    # sglang overlaps the down GEMM with combine only for these runners
    # (sglang/srt/batch_overlap/single_batch_overlap.py, SboFlags.enable_combine_down_gemm_two_stream_overlap):
    # DeepGEMM before Blackwell, FlashInfer's CuteDSL on Blackwell. `auto` never qualifies, even where
    # it runs DeepGEMM kernels.
    cap = t.hardware.capability()
    blackwell = cap is not None and cap[0] >= 10
    wanted = "flashinfer_cutedsl" if blackwell else "deep_gemm"
    runner = t.decode.moe_runner_backend
    if runner == wanted:
        return
    errors.append(
        f"decode.moe_runner_backend: sbo: full overlaps the down GEMM with combine only when sglang runs with "
        f"--moe-runner-backend {wanted} on {t.hardware.gpu}, but it is {runner} (sglang's SboFlags); without it "
        f"only the shared-expert half runs. Set decode.moe_runner_backend: {wanted}, or decode.sbo: shared-only."
    )


def _sbo_send_sms_rule(t: Topology, cfg: dict[str, Any] | None, errors: list[str], warnings: list[str]) -> None:
    # decode.sbo_send_sms against the link and the down GEMM's tiles (deploy/spec/sbo_sms.py), judged on a layout
    # the rules above accept: its figures assume one.
    more_errors, more_warnings = send_sms_problems(t, cfg)
    warnings += more_warnings
    if not errors:
        errors += more_errors


def _graph_cover_rule(d: DecodeSpec, per_rank: int, errors: list[str], warnings: list[str]) -> None:
    # With DP attention a decode step runs a CUDA graph only when every rank's batch fits one, so a
    # rank above cuda_graph_max_bs sends the whole group to eager mode.
    if d.cuda_graph_max_bs is None:
        warnings.append(
            f"decode.cuda_graph_max_bs: unset, so sglang sizes graphs from GPU memory; the per-rank decode batch is "
            f"{per_rank} (max_running_requests / attn_dp_size). Set decode.cuda_graph_max_bs: {per_rank}."
        )
    elif d.cuda_graph_max_bs < per_rank:
        errors.append(
            f"decode.cuda_graph_max_bs: {d.cuda_graph_max_bs} is below the per-rank decode batch "
            f"max_running_requests / attn_dp_size = {d.max_running_requests}/{d.attn_dp_size} = {per_rank}; "
            "above it every rank of the group runs without CUDA graphs. "
            f"Set decode.cuda_graph_max_bs: {per_rank} (and dispatch_token_budget >= it) or lower "
            "decode.max_running_requests."
        )


def _pod_rules(t: Topology, pod: PodSettings, cfg: dict[str, Any] | None, errors: list[str]) -> None:
    if t.transfer.protocol == "rdma" and pod.rdma_mode == "hostNetwork" and not pod.privileged:
        # A hostPath /dev/infiniband is visible but cannot be opened without device-cgroup access.
        errors.append(UNPRIVILEGED_HOST_RDMA)
    if pod.startup_budget_s is not None:
        if pod.weight_bytes is not None:
            size = pod.weight_bytes
        elif cfg is not None:
            try:
                size = estimate_weight_bytes(cfg)
            except TopologyError as exc:
                errors.append(str(exc))
                return
        else:
            errors.append(
                "model.config_json: the pod's startup budget can be checked only against the model's size; "
                "set model.config_json, or the chart's model.sizeBytes."
            )
            return
        need = required_startup_s(size, pod.model_source, pod.download_bytes_per_s, pod.load_bytes_per_s, pod.warmup_s)
        if pod.startup_budget_s < need:
            errors.append(startup_budget_problem(pod.role, pod.startup_budget_s, need, pod.model_source, pod.warmup_s))


# The chart's validateValues renders these same sentences (templates/_helpers.tpl), so that a value set
# the chart refuses reads as `sglang-pd launch` would refuse it; tests/helm/test_pod_conformance.py holds
# them equal.
UNPRIVILEGED_HOST_RDMA = (
    "securityContext.privileged: rdma.mode hostNetwork mounts the host's /dev/infiniband, whose verbs devices a "
    "container opens only when privileged, but securityContext.privileged is false; Mooncake and DeepEP would fail "
    "to open the NICs. Leave securityContext.privileged unset (automatic) or true, or set rdma.mode=devicePlugin "
    "with an RDMA device plugin."
)


def startup_budget_problem(role: str | None, budget_s: int, need_s: int, model_source: str, warmup_s: int) -> str:
    """Why a startup probe of `budget_s` seconds restarts a pod that needs `need_s` forever, and the fix."""
    where = f"{role}.startupProbe" if role else "startupProbe"
    steps = "download and load" if model_source == "hub" else "load"
    advice = (
        " Serving the weights from a volume (model.source=pvc or hostPath) removes the download."
        if model_source == "hub"
        else ""
    )
    return (
        f"{where}: a startup budget of {budget_s}s (failureThreshold x periodSeconds) cannot cover a cold start of "
        f"this model (~{need_s}s: {steps} the weights, warm-up of {warmup_s}s); the probe would restart the pod "
        f"forever. Raise {where}.failureThreshold so that the budget is >= {need_s}s, or unset it to derive it."
        + advice
    )
