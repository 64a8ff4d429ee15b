"""Fit a rendered sglang command to the sglang that is installed, using that sglang's own parser.

The renderer writes sglang 0.5.23's flags (the release this project deploys). A machine may run
another release: sglang 0.5.17 is the last one built for torch 2.11, and some flags differ. Where a
flag the renderer wrote is missing from the installed parser, a known equivalent takes its place;
a flag with no equivalent is an error that names it and the installed version, never silently
dropped. Nothing here guesses: the option strings come from `ServerArgs.add_cli_args` of the
sglang that will run the command.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypedDict

from sglang_pd.deploy.common.contract import SGLANG_VERSION

__all__ = [
    "EQUIVALENTS",
    "FlagReport",
    "FlagRow",
    "SglangVersionError",
    "adapt_argv",
    "compatibility_rows",
    "flag_report",
    "flag_summary",
    "installed_options",
]

DEPLOYED_VERSION = SGLANG_VERSION  # the release the renderer writes for


class SglangVersionError(ValueError):
    """A rendered flag that the installed sglang does not accept and that has no equivalent."""


@dataclass(frozen=True)
class _Equivalent:
    older: tuple[str, ...]  # option strings the older form needs from the parser
    rewrite: Callable[[str], list[str]]  # the flag's value -> the older form


# Newer flag -> how releases without it say the same thing (each checked against the parsers of sglang
# 0.5.17 and 0.5.23; tests/deploy/sglang/test_compat.py holds 0.5.17's option strings).
EQUIVALENTS: dict[str, _Equivalent] = {
    # 0.5.23 spells DP attention `--attn-dp-size N`; 0.5.17 knows only `--dp-size N --enable-dp-attention`.
    "--attn-dp-size": _Equivalent(
        ("--dp-size", "--enable-dp-attention"),
        lambda v: ["--dp-size", v, "--enable-dp-attention"],
    ),
}


@dataclass(frozen=True)
class FlagRow:
    """One rendered flag against the installed parser: as is, rewritten, or refused."""

    flag: str
    status: str  # "ok", "rewritten" or "unsupported"
    replacement: str = ""


@functools.cache
def installed_options() -> tuple[str, frozenset[str]] | None:
    """(version, option strings) of the importable sglang, or None when sglang does not import."""
    try:
        import sglang
        from sglang.srt.server_args import ServerArgs
    except Exception:  # any import failure means "no usable sglang here"
        return None
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    options = frozenset(o for action in parser._actions for o in action.option_strings)
    return str(getattr(sglang, "__version__", "unknown")), options


def _flags(argv: Iterable[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def compatibility_rows(argv: list[str], options: frozenset[str]) -> list[FlagRow]:
    """Each flag of `argv` as the installed parser would take it."""
    rows = []
    for flag in dict.fromkeys(_flags(argv)):
        if flag in options:
            rows.append(FlagRow(flag, "ok"))
        elif flag in EQUIVALENTS and all(o in options for o in EQUIVALENTS[flag].older):
            rows.append(FlagRow(flag, "rewritten", " ".join(EQUIVALENTS[flag].rewrite("N"))))
        else:
            rows.append(FlagRow(flag, "unsupported"))
    return rows


def adapt_argv(argv: list[str], options: frozenset[str], version: str = "installed") -> list[str]:
    """`argv` with every flag the installed parser lacks replaced by its equivalent.

    A flag is `--flag value` or `--flag=value`. Raises SglangVersionError naming each flag that has
    none (the flag alone: a value may be a secret).
    """
    out: list[str] = []
    missing: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, joined, value = arg.partition("=")
        if not arg.startswith("--") or flag in options:
            out.append(arg)
            i += 1
            continue
        eq = EQUIVALENTS.get(flag)
        if eq is None or not all(o in options for o in eq.older):
            missing.append(flag)
            out.append(arg)
            i += 1
        elif joined:
            out += eq.rewrite(value)
            i += 1
        else:
            out += eq.rewrite(argv[i + 1] if i + 1 < len(argv) else "")
            i += 2
    if missing:
        raise SglangVersionError(
            f"the installed sglang {version} does not accept {', '.join(missing)} (rendered for sglang "
            f"{DEPLOYED_VERSION}) and no equivalent is known; install sglang=={DEPLOYED_VERSION}, or remove the "
            "setting that renders it from the topology."
        )
    return out


class FlagReport(TypedDict):
    """The installed sglang against the rendered flags (JSON in `plan --check` and `doctor`)."""

    installed: str
    rendered_for: str
    flags: int
    rewritten: dict[str, str]  # flag -> its older form
    unsupported: list[str]


def flag_report(argvs: Iterable[list[str]]) -> FlagReport | None:
    """What the installed sglang makes of the rendered flags: the version table `plan --check` and
    `doctor` print. None when sglang does not import here."""
    installed = installed_options()
    if installed is None:
        return None
    version, options = installed
    rows: dict[str, FlagRow] = {}
    for argv in argvs:
        for row in compatibility_rows(argv, options):
            rows.setdefault(row.flag, row)
    return FlagReport(
        installed=version,
        rendered_for=DEPLOYED_VERSION,
        flags=len(rows),
        rewritten={r.flag: r.replacement for r in rows.values() if r.status == "rewritten"},
        unsupported=sorted(r.flag for r in rows.values() if r.status == "unsupported"),
    )


def flag_summary(report: FlagReport) -> str:
    """One line for a table: the installed release against the flags rendered for the deployed one."""
    rewritten, unsupported = report["rewritten"], report["unsupported"]
    parts = [f"installed sglang {report['installed']}, {report['flags']} flags rendered for {report['rendered_for']}"]
    if rewritten:
        parts.append("rewritten: " + ", ".join(f"{k} -> {v}" for k, v in rewritten.items()))
    if unsupported:
        parts.append("NOT ACCEPTED: " + ", ".join(unsupported))
    if not rewritten and not unsupported:
        parts.append("all as rendered")
    return "; ".join(parts)
