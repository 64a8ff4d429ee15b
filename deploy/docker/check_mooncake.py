"""The image build's check of the Mooncake transfer engine it pins (deploy/docker/Dockerfile).

The GPU image installs `mooncake-transfer-engine==MOONCAKE_VERSION` over the base image's own
Mooncake build, so the build says what it replaces and fails unless the pinned one works:

    python3 deploy/docker/check_mooncake.py base              # before the pin: what the base image has
    python3 deploy/docker/check_mooncake.py pinned VERSION    # after it: fails unless VERSION imports and runs

`pinned` checks that exactly one Mooncake distribution is installed, at VERSION, that its module
imports, and that a transfer engine can be constructed and initialized over TCP on the loopback
interface (no metadata server, no NIC: what a build container has). Standard library only: it runs
before sglang-pd's dependencies are installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

#: Both install the module `mooncake`; an environment must hold exactly one.
DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


def installed() -> dict[str, str]:
    """The Mooncake distributions installed here, with their versions."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def describe_base() -> str:
    found = installed()
    if not found:
        return "mooncake: the base image has no Mooncake distribution; the pin adds one"
    listed = ", ".join(f"{name} {version}" for name, version in found.items())
    return f"mooncake: the base image has {listed}; the pin replaces it"


def check_pinned(version: str, distribution: str = DISTRIBUTIONS[0]) -> str | None:
    """None when the pinned Mooncake is installed alone, imports and runs a transfer engine; else why not."""
    found = installed()
    if found.get(distribution) != version:
        have = ", ".join(f"{n} {v}" for n, v in found.items()) or "none"
        return (
            f"mooncake: {distribution}=={version} is pinned, but the installed Mooncake is {have}; "
            "pip did not install the pin (check the Dockerfile's pip install step and MOONCAKE_VERSION)"
        )
    others = sorted(set(found) - {distribution})
    if others:
        return (
            f"mooncake: {distribution} {version} and {', '.join(others)} are both installed and both provide the "
            f"module `mooncake`; uninstall {', '.join(others)} in the image"
        )
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-not-found, unused-ignore]
    except Exception as exc:  # an ImportError, or an OSError from a missing shared library
        return (
            f"mooncake: {distribution} {version} is installed but `from mooncake.engine import TransferEngine` "
            f"fails: {type(exc).__name__}: {exc}; pin a release built for the base image's CUDA and Python "
            "(MOONCAKE_VERSION in deploy/common/contract.py)"
        )
    try:
        engine = TransferEngine()
        status = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    except Exception as exc:
        return (
            f"mooncake: {distribution} {version} imports, but its transfer engine cannot be constructed: "
            f"{type(exc).__name__}: {exc}; pin another release (MOONCAKE_VERSION in deploy/common/contract.py)"
        )
    if status != 0:
        return (
            f"mooncake: {distribution} {version} imports, but its transfer engine failed to initialize over TCP on "
            f"127.0.0.1 (status {status}); pin another release (MOONCAKE_VERSION in deploy/common/contract.py)"
        )
    return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("base", help="print the base image's Mooncake (never fails)")
    pinned = sub.add_parser("pinned", help="fail unless the pinned Mooncake is installed alone, imports and runs")
    pinned.add_argument("version")
    pinned.add_argument("--distribution", default=DISTRIBUTIONS[0], choices=DISTRIBUTIONS)
    args = parser.parse_args(argv)
    if args.step == "base":
        print(describe_base())
        return 0
    problem = check_pinned(args.version, args.distribution)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"mooncake: {args.distribution} {args.version} imports and its transfer engine initializes over TCP")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
