"""Topologies whose `extra_args` or `env` would override a value the topology rules checked, each with the words
its refusal must contain; shared by the rule's tests, `plan`/`launch` tests and the chart's plan-hook tests.

Each starts from the deepseek-r1-h200-1p1d preset, which the rules accept; without its override each case is
accepted too (the tests check that control).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OVERRIDES", "Override"]


@dataclass(frozen=True)
class Override:
    """Set `fields` on `role` (the control, which the rules accept), then add `extra_args` and `env` to it."""

    role: str
    says: str
    fields: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def control(self, topology: dict[str, Any]) -> dict[str, Any]:
        t = copy.deepcopy(topology)
        t[self.role].update(copy.deepcopy(self.fields))
        return t

    def apply(self, topology: dict[str, Any]) -> dict[str, Any]:
        t = self.control(topology)
        spec = t[self.role]
        spec["extra_args"] = [*spec.get("extra_args", []), *self.extra_args]
        spec["env"] = {**spec.get("env", {}), **self.env}
        return t


OVERRIDES: dict[str, Override] = {
    # 8192 // attn_dp_size 8 = 1,024 tokens a rank through DeepEP low-latency buffers of 128 (DeepEP's host
    # assert `x.size(0) <= num_max_dispatch_tokens_per_rank`, csrc/deep_ep.cpp:1555 at the image's revision).
    "prefill chunk": Override(
        "prefill",
        "prefill.extra_args[0]: --chunked-prefill-size is rendered from prefill.chunked_prefill_size; set "
        "prefill.chunked_prefill_size instead",
        fields={"deepep_mode": "low_latency", "chunked_prefill_size": 128},
        extra_args=["--chunked-prefill-size", "8192"],
    ),
    "decode graph sizes": Override(
        "decode",
        "decode.extra_args[0]: --cuda-graph-bs-decode changes what the topology rules check, through "
        "decode.cuda_graph_max_bs",
        extra_args=["--cuda-graph-bs-decode", "1", "64", "128", "256"],
    ),
    "host": Override(
        "decode",
        "decode.extra_args[0]: --host is rendered by sglang-pd (127.0.0.1 in a CPU topology, else 0.0.0.0",
        extra_args=["--host", "127.0.0.1"],
    ),
    "second rendezvous": Override(
        "decode",
        "decode.extra_args[0]: --dist-init-addr is rendered by sglang-pd (the instance leader's address",
        extra_args=["--dist-init-addr", "10.0.0.9:5000"],
    ),
    "decode context length": Override(
        "decode",
        "decode.extra_args[0]: --context-length is rendered from model.context_length; set model.context_length "
        "instead",
        extra_args=["--context-length", "131072"],
    ),
    "SBO mode through env": Override(
        "decode",
        "decode.env.SGLANG_PD_SBO_MODE: set decode.sbo instead",
        env={"SGLANG_PD_SBO_MODE": "shared-only"},
    ),
}
