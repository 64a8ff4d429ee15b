"""Measure `make run`'s and `make test`'s installs on a fresh venv: size, seconds, and time to the first answer.

    python scripts/measure_install.py                  # make install-run in a new venv under /tmp, then `up`
    python scripts/measure_install.py --target test    # make install-test (the run install, then the rest)

Each run makes a new folder under the temporary directory with a clean export of the commit (`git archive
REV`, as CI's fresh clone: work in progress elsewhere in this checkout does not leak in), the venv and
its own model cache (SGLANG_PD_CACHE_DIR), so that neither this checkout's .venv nor an earlier conversion
of the model is reused; pip's own cache and the wheels this machine keeps on disk are used as a
developer's pip would.
After the run install it starts `sglang-pd up local-cpu` from that venv on free ports and times the
first answer through the router (`up`'s smoke exchange). Prints one JSON object; the venv is removed
unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"run": "install-run", "test": "install-test"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _du(path: Path) -> tuple[int, str]:
    """Bytes (du -sb) and du -sh's figure of `path`."""
    size = int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])
    human = subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True, check=True).stdout.split()[0]
    return size, human


def export(rev: str, dest: Path) -> str:
    """`git archive rev` unpacked into `dest`; the full commit id."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit.strip()], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise SystemExit(f"git archive {rev} failed")
    return commit.strip()


def install(target: str, src: Path, venv: Path, env: dict[str, str], log: Path) -> float:
    """Run `make install-<target>` in `src` into `venv`, echoing its step lines; seconds taken."""
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["make", TARGETS[target], f"VENV={venv}"],
            cwd=src,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.startswith("== "):
                print(f"[{time.monotonic() - t0:6.1f} s] {line.rstrip()}", file=sys.stderr, flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"make {TARGETS[target]} failed (exit {proc.returncode}); its output: {log}")
    return time.monotonic() - t0


def first_answer(venv: Path, env: dict[str, str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Start `up local-cpu` from `venv` on free ports; seconds to ready and to the first answer through the router."""
    ports = {name: _free_port() for name in ("router", "prefill-0", "prefill-0.bootstrap", "decode-0")}
    argv = [
        str(venv / "bin" / "sglang-pd"),
        "up",
        "local-cpu",
        "--port",
        str(ports.pop("router")),
        "--ports",
        ",".join(f"{k}={v}" for k, v in ports.items()),
    ]
    t0 = time.monotonic()
    out: dict[str, Any] = {"command": " ".join(argv[1:])}
    with log.open("w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        deadline = t0 + timeout_s
        try:
            for line in proc.stdout:
                sink.write(line)
                if line.startswith("ready in "):
                    out["ready_s"] = round(time.monotonic() - t0, 1)
                if line.startswith("try: curl"):  # printed once the smoke exchange answered
                    out["first_answer_s"] = round(time.monotonic() - t0, 1)
                    break
                if time.monotonic() > deadline:
                    break
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if "first_answer_s" not in out:
        why = f"exited with code {proc.returncode}" if time.monotonic() < deadline else f"within {timeout_s:g} s"
        raise SystemExit(f"`up local-cpu` gave no answer ({why}); its output: {log}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(TARGETS), default="run")
    parser.add_argument("--rev", default="HEAD", help="the commit to install (default HEAD)")
    parser.add_argument("--keep", action="store_true", help="keep the venv and logs")
    parser.add_argument("--answer-timeout", type=float, default=600.0, metavar="SECONDS")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix=f"sglang-pd-measure-{args.target}-"))
    venv = work / "venv"
    env = {**os.environ, "SGLANG_PD_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("VIRTUAL_ENV", None)
    try:
        commit = export(args.rev, work / "src")
        print(f"measuring make {TARGETS[args.target]} of {commit[:7]} in {venv}", file=sys.stderr, flush=True)
        seconds = install(args.target, work / "src", venv, env, work / "install.log")
        size, human = _du(venv)
        report: dict[str, Any] = {
            "target": f"make {TARGETS[args.target]}",
            "commit": commit,
            "install_s": round(seconds, 1),
            "venv_bytes": size,
            "du_sh": human,
            "python": sys.version.split()[0],
        }
        if args.target == "run":
            report["up"] = first_answer(venv, env, work / "up.log", args.answer_timeout)
        print(json.dumps(report, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
