"""`extra_args` and `env` cannot replace a value the topology rules checked, in any spelling sglang's parser reads.

The spellings are compared with sglang 0.5.23's own parser where it is installed: its aliases, and every prefix
argparse would take for an option (sglang builds its parser with `allow_abbrev` on).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

import pytest

from sglang_pd.deploy.spec.rendered import (
    ASSUMED_FAMILIES,
    ASSUMED_FLAGS,
    RENDERED_ENV,
    RENDERED_FLAGS,
    OptionMatch,
    match_option,
)
from sglang_pd.deploy.spec.topology import PRESETS_DIR, check_rules, parse_topology
from tests.support.override_cases import OVERRIDES

has_sglang = importlib.util.find_spec("sglang") is not None
PRESET_DIR = PRESETS_DIR


def errors_of(d: dict) -> list[str]:
    return check_rules(parse_topology(d, source_dir=PRESET_DIR)).errors


@pytest.mark.parametrize("case", OVERRIDES)
def test_an_override_of_a_checked_value_is_refused(preset_dict, case: str) -> None:
    override = OVERRIDES[case]
    assert errors_of(override.control(preset_dict())) == []  # the control: the same topology without the override
    [error] = errors_of(override.apply(preset_dict()))
    assert error.startswith(override.says), error


def with_extra(preset_dict, role: str, *args: str) -> dict:
    d = preset_dict()
    d[role]["extra_args"] = list(args)
    return d


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--chunked-prefill=8192"], "prefill.extra_args[0]: --chunked-prefill (a prefix of --chunked-prefill-size"),
        (["--chunked-prefill-size=8192"], "prefill.extra_args[0]: --chunked-prefill-size is rendered from"),
        (["--nccl-init-addr", "h:1"], "prefill.extra_args[0]: --nccl-init-addr (sglang's alias of --dist-init-addr)"),
        (["--tp", "4"], "prefill.extra_args[0]: --tp (a prefix of --tp-size, which sglang's parser reads"),
        (["--ep=4"], "prefill.extra_args[0]: --ep (sglang's alias of --ep-size) is rendered from prefill.ep"),
        (["--model", "x"], "prefill.extra_args[0]: --model (sglang's alias of --model-path) is rendered from"),
        (["--dp-size", "2"], "prefill.extra_args[0]: --dp-size changes what the topology rules check, through"),
        (["--max-total-tokens", "9"], "prefill.extra_args[0]: --max-total-tokens changes what the topology rules"),
        (["--speculative-algorithm", "EAGLE"], "prefill.extra_args[0]: --speculative-algorithm changes what the"),
        (["--specul", "EAGLE"], "prefill.extra_args[0]: --specul (a prefix of --speculative-*"),
        (["--config", "c.yaml"], "prefill.extra_args[0]: --config changes what the topology rules check (a config"),
        (["--cuda-graph-max-bs", "256"], "prefill.extra_args[0]: --cuda-graph-max-bs (a prefix of"),
        (["--page-size=32"], "prefill.extra_args[0]: --page-size must be equal on prefill and decode"),
        (["--load-format", "dummy", "--port", "1"], "prefill.extra_args[2]: --port is rendered from prefill.port"),
    ],
)
def test_every_spelling_of_a_checked_option_is_refused(preset_dict, args: list[str], says: str) -> None:
    [error] = errors_of(with_extra(preset_dict, "prefill", *args))
    assert error.startswith(says), error


def test_options_the_rules_do_not_depend_on_stay_allowed(preset_dict) -> None:
    # What the one-GPU presets pass, and options near checked ones in name only.
    allowed = ["--load-format", "dummy", "--sampling-backend", "pytorch", "--grammar-backend", "none"]
    allowed += [
        "--enable-metrics-for-all-schedulers",
        "--max-queued-requests",
        "9",
        "--disaggregation-decode-polling-interval",
    ]
    allowed += ["2", "--cuda-graph-backend-decode", "full", "--"]
    assert errors_of(with_extra(preset_dict, "decode", *allowed)) == []


@pytest.mark.parametrize("key", RENDERED_ENV)
def test_a_rendered_env_key_in_env_is_refused(preset_dict, key: str) -> None:
    d = preset_dict()
    d["prefill"]["env"] = {key: "1", "NCCL_DEBUG": "INFO"}
    [error] = errors_of(d)
    assert error.startswith(f"prefill.env.{key}: "), error
    field = RENDERED_ENV[key].field
    assert (f"set {field} instead" if field else "remove it from prefill.env") in error


# --- the spellings, against sglang 0.5.23's own parser ----------------------------------------------------


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    if not has_sglang:
        pytest.skip("sglang is not installed (the `validate` extra + sglang --no-deps)")
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
    ServerArgs.add_cli_args(parser)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.sglang
def test_sglang_abbreviates_options(sglang_parser) -> None:
    assert sglang_parser.allow_abbrev  # otherwise the prefix rule below would refuse more than needed


@pytest.mark.sglang
def test_each_option_lists_sglangs_aliases(sglang_parser) -> None:
    actions = _actions(sglang_parser)
    for table in (RENDERED_FLAGS, ASSUMED_FLAGS):
        for name, setting in table.items():
            assert name in actions, f"sglang has no {name}"
            assert set(actions[name].option_strings) == {name, *setting.aliases}, name
    for prefix, setting in ASSUMED_FAMILIES.items():
        for spelling in (prefix, *setting.aliases):
            assert any(o.startswith(spelling) for o in actions), spelling


FAMILY_PREFIXES = tuple(p for prefix, s in ASSUMED_FAMILIES.items() for p in (prefix, *s.aliases))


def _refused(option: str) -> bool:
    spellings = {s for t in (RENDERED_FLAGS, ASSUMED_FLAGS) for n, st in t.items() for s in (n, *st.aliases)}
    return option in spellings or option.startswith(FAMILY_PREFIXES)


def _misreads(parser: argparse.ArgumentParser, match: Callable[[str], OptionMatch | None]) -> list[str]:
    """Every string argparse would read as an option (each option string and each prefix of one, alone and with
    `=value`) that `match` judges otherwise than sglang's parser: it must refuse what the parser reads as a checked
    option, name that option, and refuse nothing else. An ambiguous prefix is left out: sglang refuses it."""
    actions = _actions(parser)
    options = sorted(actions)
    wrong = []
    for p in sorted({o[:n] for o in options for n in range(3, len(o) + 1)}):
        longer = [o for o in options if o.startswith(p)]
        if p not in actions and len(longer) > 1:
            continue  # argparse: "ambiguous option", the command fails
        action = actions[p] if p in actions else actions[longer[0]]  # an exact option string wins
        checked = any(_refused(o) for o in action.option_strings)
        for arg in (p, f"{p}=1"):
            found = match(arg)
            if checked != (found is not None):
                wrong.append(f"{arg}: sglang reads {action.option_strings[0]}, the rule says {found}")
            elif (
                found is not None
                and not found.option.endswith("*")
                and found.option not in action.option_strings
                and not found.option.startswith(FAMILY_PREFIXES)
            ):
                wrong.append(f"{arg}: sglang reads {action.option_strings[0]}, the rule names {found.option}")
    return wrong


@pytest.mark.sglang
def test_the_rule_refuses_exactly_what_sglang_reads_as_a_checked_option(sglang_parser) -> None:
    assert _misreads(sglang_parser, match_option) == []


@pytest.mark.sglang
def test_a_rule_blind_to_abbreviations_is_caught(sglang_parser) -> None:
    """The control: a rule that knows only whole option names misses what argparse abbreviates."""

    def exact_only(arg: str) -> OptionMatch | None:
        found = match_option(arg)
        return None if found is None or found.spelling == "abbreviation" else found

    assert any(
        w.startswith("--chunked-prefill=1: sglang reads --chunked-prefill-size")
        for w in _misreads(sglang_parser, exact_only)
    )
