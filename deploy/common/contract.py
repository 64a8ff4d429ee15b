"""Names every part of sglang-pd agrees on: roles, default ports, routing policies, the Kubernetes
labels and annotations the chart sets and the router reads, shared environment variables, and
the commands' exit statuses.

The Helm chart cannot import Python, so tests render it and check it against these constants.
Nothing here imports the rest of the package; every part may import it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

__all__ = [
    "ANNOTATION_BOOTSTRAP_PORT",
    "ANNOTATION_PORT",
    "DEFAULT_BOOTSTRAP_PORT",
    "DEFAULT_DECODE_PORT",
    "DEFAULT_PREFILL_PORT",
    "DEFAULT_ROUTER_PORT",
    "ENV_LWS_GROUP_SIZE",
    "ENV_LWS_LEADER_ADDRESS",
    "ENV_LWS_WORKER_INDEX",
    "ENV_ROUTER_ADMIN_KEY",
    "ENV_ROUTER_API_KEYS",
    "ENV_ROUTER_WORKER_API_KEY",
    "ENV_SBO_MODE",
    "ENV_SBO_SHARED_OUTSIDE",
    "ENV_WORKER_API_KEY",
    "EXIT_FAILED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "LABEL_COMPONENT",
    "LABEL_INSTANCE",
    "LABEL_LWS_WORKER_INDEX",
    "LABEL_PART_OF",
    "PART_OF",
    "POLICIES",
    "PREFILL_ONLY_POLICIES",
    "ROLES",
    "WORKER_AUTH_HEADER",
    "Role",
    "RoutingPolicy",
    "SBOMode",
    "as_role",
    "policy_problem",
    "worker_selector",
]

# -- exit statuses: every command's, with one meaning each -----------------------------------------
EXIT_OK = 0
# What was asked is wrong or failed its check: a topology rule or sglang's verdict (`plan`, `up`,
# `launch`), an SBO half this machine cannot serve (`doctor --expect`), the gsm8k gate (`eval`).
EXIT_INVALID = 1
EXIT_USAGE = 2  # the command line itself
# Something the command needs is not here: sglang for `plan --check`, the gsm8k data (`eval`).
EXIT_UNAVAILABLE = 3
# The system did not work: a component did not come up or failed (`up`), the endpoint (`eval`).
EXIT_FAILED = 4

Role = Literal["prefill", "decode"]
"""The two kinds of PD engine. The router is a component, not a role."""
ROLES: tuple[Role, ...] = get_args(Role)


def as_role(value: object) -> Role | None:
    """`value` as a `Role` (typed as one), None when it names none."""
    return next((r for r in ROLES if r == value), None)


# -- sglang ---------------------------------------------------------------------------------------
# The sglang release this project deploys: the renderer writes its flags, the plugin's hooks are
# written against it, the image installs it (deploy/docker/Dockerfile's SGLANG_VERSION, checked
# equal by tests/test_packaging.py) and the Makefile reads it from here.
SGLANG_VERSION = "0.5.23"
# The sglang release the GPU machine runs: the last one pinned to its torch 2.11 (0.5.13-0.5.17 pin it,
# 0.5.18+ pin 2.13). The plugin supports it too (its initialize_moe_config reads server_args); the
# Makefile installs it with --no-deps beside the venv, in .venv/sglang-<version>, for the plugin's tests.
SGLANG_GPU_VERSION = "0.5.17"
# The DeepEP that takes our sm_90 down GEMM's signals: deepseek-ai/DeepEP branch antgroup-opt (DeepEP
# PR #483) at this commit. The image builds it (deploy/docker/Dockerfile's DEEPEP_REF, checked equal by
# tests/test_packaging.py), scripts/gpu/build_deepep.sh builds it on the GPU machine, and the plugin's
# tests quote its signatures (tests/support/deepep_revision.py).
DEEPEP_REVISION = "76f027117d76c69ee1862a1dc2a608dfc17dd652"
# The Mooncake transfer engine release: the GPU image pins `mooncake-transfer-engine` at it over the base
# image's own build (deploy/docker/Dockerfile's MOONCAKE_VERSION, which the Makefile passes from here and
# deploy/docker/check_mooncake.py checks in the build), and pyproject.toml's kv-cpu and kv-cuda extras pin
# the same release (tests/test_packaging.py holds all of them equal to this).
MOONCAKE_VERSION = "0.3.13.post1"

# -- ports ----------------------------------------------------------------------------------------
# sglang's defaults for the prefill bootstrap server (--disaggregation-bootstrap-port), and the
# HTTP ports of one local stack (instances take consecutive ports from these).
DEFAULT_BOOTSTRAP_PORT = 8998
DEFAULT_PREFILL_PORT = 30000
DEFAULT_DECODE_PORT = 30001
DEFAULT_ROUTER_PORT = 8000

# -- routing policies -----------------------------------------------------------------------------
RoutingPolicy = Literal["round_robin", "random", "power_of_two", "least_load", "cache_aware"]
POLICIES: tuple[RoutingPolicy, ...] = get_args(RoutingPolicy)
# cache_aware keeps per-worker prompt-prefix trees: only a prefill worker holds a prompt's KV
# cache, so prefix affinity means nothing on decode.
PREFILL_ONLY_POLICIES: frozenset[str] = frozenset({"cache_aware"})


def policy_problem(role: str, name: str) -> str | None:
    """Why `name` cannot route `role` workers (one sentence with the fix), or None when it can."""
    if name not in POLICIES:
        return f"{role} policy {name!r} is unknown. Use one of: {', '.join(POLICIES)}."
    if role != "prefill" and name in PREFILL_ONLY_POLICIES:
        others = ", ".join(p for p in POLICIES if p not in PREFILL_ONLY_POLICIES)
        return (
            f"{role} policy {name!r} routes by prompt prefix and is for prefill only. Use one of {others} for {role}."
        )
    return None


# -- Kubernetes -----------------------------------------------------------------------------------
# Labels the chart puts on every GPU pod (helm/sglang-pd/templates/_helpers.tpl,
# "sglang-pd.podLabels"): the component is the role.
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_PART_OF = "app.kubernetes.io/part-of"
PART_OF = "sglang-pd"
# LeaderWorkerSet labels each pod with its rank in the group; only rank 0 (the leader) serves HTTP.
# https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/
LABEL_LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
# Annotations on leader pods: the engine's HTTP port and a prefill's bootstrap port.
ANNOTATION_PORT = "sglang-pd/port"
ANNOTATION_BOOTSTRAP_PORT = "sglang-pd/bootstrap-port"


def worker_selector(role: Role, release: str | None = None) -> str:
    """The label selector of a role's leader pods, as the chart labels them; `release` narrows it
    to one Helm release (the chart's router passes its own)."""
    scope = f"{LABEL_INSTANCE}={release}" if release else f"{LABEL_PART_OF}={PART_OF}"
    return f"{scope},{LABEL_COMPONENT}={role},{LABEL_LWS_WORKER_INDEX}=0"


# -- environment ----------------------------------------------------------------------------------
# Router secrets, read from the environment so they stay out of process listings.
ENV_ROUTER_API_KEYS = "SGLANG_PD_ROUTER_API_KEYS"
ENV_ROUTER_ADMIN_KEY = "SGLANG_PD_ROUTER_ADMIN_KEY"
ENV_ROUTER_WORKER_API_KEY = "SGLANG_PD_ROUTER_WORKER_API_KEY"
# The key between the router and its workers: the router sends it (falling back to this name when
# ENV_ROUTER_WORKER_API_KEY is unset), the reference engine requires it on every route, and sglang
# takes it as `--api-key`. It travels as WORKER_AUTH_HEADER: Bearer <key>, sglang's form.
ENV_WORKER_API_KEY = "SGLANG_PD_WORKER_API_KEY"
WORKER_AUTH_HEADER = "authorization"


# The topology's `decode.sbo`, rendered as ENV_SBO_MODE and read by the sglang plugin (its docstring
# is the values schema's description of the field).
class SBOMode(StrEnum):
    """Single-batch overlap on decode: both halves, the shared-expert half alone, or none."""

    OFF = "off"
    FULL = "full"
    SHARED_ONLY = "shared-only"


# The decode's single-batch-overlap mode, rendered by the launcher and read by the sglang plugin.
ENV_SBO_MODE = "SGLANG_PD_SBO_MODE"
# sglang's switch that runs the shared expert on the alternate stream under SBO (`srt/environ.py`), rendered
# with full SBO; the plugin's shared-stream hook makes sm_90 honour it.
ENV_SBO_SHARED_OUTSIDE = "SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO"
# What LeaderWorkerSet sets in every pod of a group (same reference as the labels above).
ENV_LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
ENV_LWS_GROUP_SIZE = "LWS_GROUP_SIZE"


def unsendable_key(key: str) -> bool:
    """Whether an API key holds whitespace or control characters, which a `Bearer` header cannot
    carry (a trailing newline from `kubectl create secret --from-file` is the usual one). The one
    check of a key's form: `launch`, `up` and the router's client to its workers all use it."""
    return any(c.isspace() or not c.isprintable() for c in key)
