"""The sglang options and environment variables a topology decides, and the rule that keeps them out of
`extra_args` and `env`.

The renderer (deploy/sglang/render.py) writes an option or an environment variable only through the tables
here, so they list exactly what it writes (tests/deploy/sglang/test_render.py holds them equal). `extra_args`
come last on the command line and argparse keeps an option's last value; a role's `env` is applied after the
rendered one. Either would replace a value the cross-role rules checked, so each is refused with the field to
set instead. So are the options the rules assume sglang leaves at their defaults (speculative decoding, explicit
CUDA-graph sizes, ...): the rules cannot account for them yet.

sglang 0.5.23 builds its parser with argparse's defaults (`argparse.ArgumentParser(prog="sglang serve")`,
srt/server_args.py:679, `prepare_server_args`), so `allow_abbrev` is on: any unambiguous prefix of a long option
selects it (`--chunked-prefill 8192`), as does `--option=value`. Options also have aliases (`--ep` for
`--ep-size`, srt/arg_groups/fields/parallel.py). The spellings below are those of 0.5.23's parser;
tests/deploy/spec/test_rendered.py compares them with the installed parser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_pd.deploy.common.contract import ENV_SBO_MODE, ENV_SBO_SHARED_OUTSIDE

__all__ = [
    "ASSUMED_FAMILIES",
    "ASSUMED_FLAGS",
    "DISPATCH_BUDGET_ENV",
    "RENDERED_ENV",
    "RENDERED_FLAGS",
    "OptionMatch",
    "Setting",
    "env_problems",
    "extra_args_problems",
    "match_option",
]

DISPATCH_BUDGET_ENV = "SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"


@dataclass(frozen=True)
class Setting:
    """Where the value of one sglang option or environment variable comes from.

    `field` is the topology field that sets it (`<role>` stands for prefill or decode), or "" where no field does;
    `note` then says what sets it, or why the rules cannot take another value. `aliases` are the option's other
    spellings in sglang's parser.
    """

    field: str
    aliases: tuple[str, ...] = ()
    note: str = ""


# Every option the renderer writes, under the name it writes.
RENDERED_FLAGS: dict[str, Setting] = {
    "--model-path": Setting("model.path", ("--model",)),
    "--served-model-name": Setting("model.served_name"),
    "--trust-remote-code": Setting("model.trust_remote_code"),
    "--quantization": Setting("model.quantization"),
    "--context-length": Setting("model.context_length"),
    "--page-size": Setting("model.page_size"),
    "--kv-cache-dtype": Setting("model.kv_cache_dtype"),
    "--host": Setting(
        "", note="127.0.0.1 in a CPU topology, else 0.0.0.0, where the router and the KV peers reach the server"
    ),
    "--port": Setting("<role>.port"),
    "--enable-metrics": Setting("", note="always on: the chart's PodMonitor scrapes it"),
    "--disaggregation-mode": Setting("", note="the role the command is rendered for"),
    "--disaggregation-transfer-backend": Setting("transfer.backend"),
    "--disaggregation-bootstrap-port": Setting("prefill.bootstrap_port"),
    "--disaggregation-ib-device": Setting("transfer.ib_devices"),
    "--tp-size": Setting("<role>.tp", ("--tensor-parallel-size",)),
    "--attn-dp-size": Setting("<role>.attn_dp_size", ("--attention-data-parallel-size",)),
    "--moe-dense-tp-size": Setting("<role>.attn_dp_size", note="1 under DP attention"),
    "--enable-dp-lm-head": Setting("<role>.dp_lm_head"),
    "--ep-size": Setting("<role>.ep", ("--expert-parallel-size", "--ep")),
    "--moe-a2a-backend": Setting("<role>.moe_a2a_backend"),
    "--deepep-mode": Setting("<role>.deepep_mode"),
    "--moe-runner-backend": Setting("<role>.moe_runner_backend"),
    "--attention-backend": Setting("<role>.attention_backend"),
    "--nnodes": Setting("<role>.nodes"),
    "--node-rank": Setting("", note="each node's rank, which the launcher sets"),
    "--dist-init-addr": Setting(
        "", ("--nccl-init-addr",), note="the instance leader's address, which the launcher sets on every node"
    ),
    "--enable-two-batch-overlap": Setting("<role>.tbo.enabled"),
    "--tbo-token-distribution-threshold": Setting("<role>.tbo.token_distribution_threshold"),
    "--mem-fraction-static": Setting("<role>.mem_fraction_static"),
    "--max-running-requests": Setting("<role>.max_running_requests"),
    "--chunked-prefill-size": Setting("<role>.chunked_prefill_size"),
    "--max-prefill-tokens": Setting("<role>.max_prefill_tokens"),
    "--enable-single-batch-overlap": Setting("decode.sbo"),
    "--cuda-graph-max-bs-decode": Setting("decode.cuda_graph_max_bs"),
}

# Options the renderer leaves at sglang's defaults and the rules rely on it: each changes what a rule computes.
ASSUMED_FLAGS: dict[str, Setting] = {
    "--dp-size": Setting("<role>.attn_dp_size", ("--data-parallel-size",)),
    "--enable-dp-attention": Setting("<role>.attn_dp_size"),
    "--pp-size": Setting(
        "",
        ("--pipeline-parallel-size",),
        note="the rules count <role>.tp GPUs an instance, and pipeline stages would multiply them",
    ),
    "--max-total-tokens": Setting(
        "", note="it sizes the KV pool, from which sglang derives the running batch the dispatch budget must hold"
    ),
    "--cuda-graph-max-bs-prefill": Setting(
        "", note="prefill CUDA-graph batches go through the same DeepEP buffers the rules size"
    ),
    "--cuda-graph-config": Setting(
        "decode.cuda_graph_max_bs", note="its JSON wins over every --cuda-graph-* option, the rendered ones too"
    ),
    "--config": Setting("", note="a config file sets sglang options past these rules; write them in the topology"),
}

# Option families, by the prefix every member starts with.
ASSUMED_FAMILIES: dict[str, Setting] = {
    "--cuda-graph-bs-": Setting(
        "decode.cuda_graph_max_bs",
        note="explicit capture sizes; the rules hold the largest captured batch to decode.dispatch_token_budget",
    ),
    "--speculative-": Setting(
        "",
        ("--no-speculative-",),  # the negation of its boolean options
        note="draft tokens multiply the tokens a decode rank dispatches a step, which the rules do not count",
    ),
}

# Every environment variable the renderer exports.
RENDERED_ENV: dict[str, Setting] = {
    ENV_SBO_MODE: Setting("decode.sbo"),
    "SGLANG_DEEPGEMM_ON_H20": Setting("hardware.gpu", note="1 on H20 with decode.sbo: full"),
    "SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS": Setting(
        "decode.sbo_send_sms", note="with decode.sbo: full; checked against the link and the down GEMM's tiles"
    ),
    ENV_SBO_SHARED_OUTSIDE: Setting("decode.sbo", note="1 with decode.sbo: full: the shared expert on the alt stream"),
    DISPATCH_BUDGET_ENV: Setting("decode.dispatch_token_budget"),
    "SGLANG_SCHEDULER_SKIP_ALL_GATHER": Setting("", note="1 on a one-GPU server with an MoE all-to-all"),
    "MC_FORCE_TCP": Setting("transfer.protocol"),
}

# KV pages are copied byte for byte between the roles, so these must be one value for both.
_SHARED_BY_ROLES = ("--page-size", "--kv-cache-dtype")


@dataclass(frozen=True)
class OptionMatch:
    """The option an `extra_args` entry sets, as sglang's parser reads it."""

    option: str  # its name in the tables (a family's prefix plus the rest, for a family member)
    setting: Setting
    rendered: bool
    spelling: str  # "" (the option's own name), "alias" or "abbreviation"


def _spellings(table: Mapping[str, Setting]) -> list[tuple[str, str, Setting]]:
    return [(s, name, setting) for name, setting in table.items() for s in (name, *setting.aliases)]


_RENDERED_SPELLINGS = _spellings(RENDERED_FLAGS)
_ASSUMED_SPELLINGS = _spellings(ASSUMED_FLAGS)
_FAMILY_PREFIXES = _spellings(ASSUMED_FAMILIES)


def match_option(arg: str) -> OptionMatch | None:
    """The rendered or assumed option `arg` sets (`--name`, `--name=value`, an alias or an abbreviation), or None.

    An abbreviation counts when it is a prefix of one of these options: argparse takes it for that option when it
    is unambiguous, and refuses the command when it is not, so it never stands for an option left to extra_args
    (the test compares the prefixes with sglang's option strings).
    """
    if not arg.startswith("--") or arg == "--":  # a value, or argparse's end of options
        return None
    name = arg.split("=", 1)[0]
    for spellings, rendered in ((_RENDERED_SPELLINGS, True), (_ASSUMED_SPELLINGS, False)):
        for spelling, option, setting in spellings:
            if name == spelling:
                return OptionMatch(option, setting, rendered, "" if spelling == option else "alias")
    for prefix, family, setting in _FAMILY_PREFIXES:
        if name.startswith(prefix):
            return OptionMatch(name, setting, False, "" if prefix == family else "alias")
    for spellings, rendered in ((_RENDERED_SPELLINGS, True), (_ASSUMED_SPELLINGS, False)):
        for spelling, option, setting in spellings:
            if spelling.startswith(name):
                return OptionMatch(option, setting, rendered, "abbreviation")
    for prefix, _, setting in _FAMILY_PREFIXES:
        if prefix.startswith(name):
            return OptionMatch(prefix + "*", setting, False, "abbreviation")
    return None


def _field(setting: Setting, role: str) -> str:
    return setting.field.replace("<role>", role)


def extra_args_problems(role: str, extra_args: Sequence[str]) -> list[str]:
    """One error for each entry of `<role>.extra_args` that sets an option the topology decides."""
    problems = []
    for i, arg in enumerate(extra_args):
        found = match_option(arg)
        if found is None:
            continue
        name = arg.split("=", 1)[0]
        where = f"{role}.extra_args[{i}]: {name}"
        if found.spelling == "alias":
            where += f" (sglang's alias of {found.option})"
        elif found.spelling == "abbreviation":
            where += f" (a prefix of {found.option}, which sglang's parser reads as that option)"
        field = _field(found.setting, role)
        note = f" ({found.setting.note})" if found.setting.note and field else ""
        if found.option in _SHARED_BY_ROLES:
            problems.append(
                f"{where} must be equal on prefill and decode (KV pages are copied byte for byte between them); "
                f"set it once in {field} and remove it from extra_args."
            )
        elif found.rendered and field:
            problems.append(
                f"{where} is rendered from {field}{note}; set {field} instead and remove it from extra_args: "
                "extra_args come last and sglang keeps the last value, so the rules would check one value and "
                "sglang run another."
            )
        elif found.rendered:
            problems.append(
                f"{where} is rendered by sglang-pd ({found.setting.note}); remove it from extra_args: extra_args "
                "come last and sglang keeps the last value."
            )
        elif field:
            problems.append(
                f"{where} changes what the topology rules check, through {field}{note}; set {field} instead and "
                "remove it from extra_args."
            )
        else:
            problems.append(
                f"{where} changes what the topology rules check ({found.setting.note}), and no topology field "
                "models it yet; remove it from extra_args."
            )
    return problems


def env_problems(role: str, env: Mapping[str, str]) -> list[str]:
    """One error for each key of `<role>.env` that the renderer exports."""
    problems = []
    for key in env:
        setting = RENDERED_ENV.get(key)
        if setting is None:
            continue
        field = _field(setting, role)
        note = f" ({setting.note})" if setting.note else ""
        if field:
            problems.append(
                f"{role}.env.{key}: set {field} instead; the renderer exports {key} from it{note}, and {role}.env, "
                "applied after it, would replace the value the rules checked."
            )
        else:
            problems.append(
                f"{role}.env.{key}: the renderer exports it{note}; remove it from {role}.env, which, applied after "
                "it, would replace that value."
            )
    return problems
