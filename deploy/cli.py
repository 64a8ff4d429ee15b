"""The `sglang-pd` command line: one verb per job.

Exit codes: 0 ok; 1 the topology (or what sglang said of it) is invalid; 2 bad usage;
3 a requested check could not run here (e.g. sglang is not installed).
Verbs import their heavy modules lazily so that `plan` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_pd.deploy.common.argtypes import positive_int
from sglang_pd.deploy.common.contract import EXIT_INVALID, EXIT_OK, EXIT_USAGE
from sglang_pd.deploy.spec.topology import TopologyError, load_checked_topology

__all__ = ["main"]


def _cmd_plan(args: argparse.Namespace) -> int:
    from sglang_pd.deploy.ops.plan import build_plan, format_plan

    given = [flag for flag, value in _ESTIMATE_INPUTS.items() if getattr(args, value) is not None]
    if given and not args.estimate:
        print(
            f"error: {' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only to the performance "
            f"estimate; add --estimate (sglang-pd plan {args.topology} --estimate "
            f"{' '.join(f'{g} N' for g in given)}).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    t, rules = load_checked_topology(args.topology)
    if args.estimate:
        from sglang_pd.deploy.ops.plan import estimate_report

        if args.format not in ("table", "json"):
            print(f"error: --estimate prints a table or JSON, not {args.format}.", file=sys.stderr)
            return EXIT_USAGE
        input_len = args.input_len or DEFAULT_INPUT_LEN
        output_len = args.output_len or DEFAULT_OUTPUT_LEN
        print(estimate_report(t, args.format, input_len, output_len, args.decode_batch))
        return EXIT_OK
    plan = build_plan(t, rules)
    status = EXIT_OK
    if args.check:
        from sglang_pd.deploy.ops.plan import check_plan

        # On stderr, so that --format json|yaml|shell keeps stdout for the plan alone.
        def progress(line: str) -> None:
            print(line, file=sys.stderr, flush=True)

        progress(f"plan --check {t.name}: SBO against DeepEP, then every command through sglang's resolver")
        plan, status, note = check_plan(plan, local_deepep=args.local_deepep, progress=progress)
        if note:
            print(f"note: {note}", file=sys.stderr)
    print(format_plan(plan, args.format))
    return status


# `plan --estimate`'s inputs (flag -> argparse dest); their defaults apply only with --estimate.
_ESTIMATE_INPUTS = {"--input-len": "input_len", "--output-len": "output_len", "--decode-batch": "decode_batch"}
DEFAULT_INPUT_LEN = 4096
DEFAULT_OUTPUT_LEN = 1536


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-pd")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


# Verbs whose implementation lives in its own subpackage: verb -> (module, help).
DELEGATED = {
    "launch": ("sglang_pd.deploy.ops.launch", "a pod's entrypoint: render this node's command, check the pod, exec it"),
    "router": ("sglang_pd.deploy.router.cli", "run the OpenAI-compatible PD router"),
    "kv-probe": ("sglang_pd.deploy.kv.cli", "check KV transfer (Mooncake) between a prefill and a decode host"),
    "engine": ("sglang_pd.deploy.refengine.cli", "run one reference engine (prefill, decode or both) on CPU"),
    "up": ("sglang_pd.deploy.ops.up", "run a topology here: engines and router as child processes"),
    "eval": ("sglang_pd.deploy.evals.cli", "run an accuracy gate against an OpenAI-compatible endpoint"),
    "doctor": ("sglang_pd.deploy.ops.doctor", "what this machine can serve: versions, GPU, SBO halves and why not"),
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the chosen delegated `verb` has its module imported (keeps `plan` fast)."""
    parser = argparse.ArgumentParser(
        prog="sglang-pd",
        description="Prefill/decode-disaggregated SGLang: plan, run and check a PD deployment.",
    )
    parser.add_argument("--version", action="version", version=f"sglang-pd {_version()}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("plan", help="show and check a topology: nodes, GPUs, per-node sglang commands")
    p.add_argument("topology", metavar="FILE", help="topology YAML, or a preset name (e.g. local-cpu)")
    p.add_argument("--format", choices=("table", "json", "yaml", "shell"), default="table")
    p.add_argument(
        "--check",
        action="store_true",
        help="also run sglang's own argument resolver on every command (needs the `validate` extra)",
    )
    p.add_argument(
        "--local-deepep",
        action="store_true",
        help="with --check, judge SBO with the DeepEP installed here rather than the one the image builds",
    )
    p.add_argument(
        "--estimate",
        action="store_true",
        help="predict prefill tok/s and TTFT, decode ITL and tok/s, the P:D ratio and the KV fit (docs/estimate.md)",
    )
    p.add_argument(
        "--input-len",
        type=positive_int,
        metavar="N",
        help=f"with --estimate: prompt tokens (default {DEFAULT_INPUT_LEN})",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        metavar="M",
        help=f"with --estimate: generated tokens (default {DEFAULT_OUTPUT_LEN})",
    )
    p.add_argument(
        "--decode-batch",
        type=positive_int,
        metavar="B",
        help="with --estimate: requests per decode rank (default: the topology's)",
    )
    p.set_defaults(func=_cmd_plan)

    for name, (module, help_text) in DELEGATED.items():
        vp = sub.add_parser(name, help=help_text)
        if name == verb:
            mod = importlib.import_module(module)
            mod.add_arguments(vp)
            vp.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(verb).parse_args(argv)
    try:
        return int(args.func(args))
    except TopologyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # `sglang-pd plan ... | head`: the reader left; not an error
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
