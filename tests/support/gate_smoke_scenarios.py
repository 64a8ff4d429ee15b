"""`up` as `make run` starts it, and the gsm8k gate's documented smoke (docs/gsm8k-gate.md, "A smoke on the
local stack") against that stack: a real `sglang-pd up` on its default port 8000, fenced as `make run` runs it
as root, in a network namespace of its own (tests.support.netns), so that port 8000 and the rules are its own."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sglang_pd.deploy.common.procs import spawn
from tests.support.netns import REPO

GATE_DOC = REPO / "docs" / "gsm8k-gate.md"
SECTION = "## A smoke on the local stack"
CLI = [sys.executable, "-m", "sglang_pd.deploy.cli"]


def documented_commands() -> list[str]:
    """The `sglang-pd eval gsm8k` lines of the section's code block, as written."""
    text = GATE_DOC.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the section has no bash block"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip().startswith("sglang-pd eval gsm8k")]


def _run(command: str, cwd: Path) -> dict[str, Any]:
    argv = shlex.split(command)
    t0 = time.monotonic()
    done = subprocess.run([*CLI, *argv[1:]], capture_output=True, text=True, timeout=900, cwd=cwd)
    return {
        "command": command,
        "exit_status": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr[-4000:],
        "seconds": round(time.monotonic() - t0, 1),
    }


def smoke_against_up() -> dict[str, Any]:
    """Start `up local-cpu` as `make run` does, run the documented commands in a fresh folder, then the second
    with a --max-drop under what 5 questions can show (which must fail); stop the stack."""
    commands = documented_commands()
    work = Path(tempfile.mkdtemp(prefix="gate-smoke-"))
    up = spawn(
        "up",
        [*CLI, "up", "local-cpu", "--log-dir", str(work / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    stdout = up.proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any(ln.startswith(("try: ", "error: ")) for ln in lines):
        assert time.monotonic() < deadline and up.alive(), "".join(lines[-40:])
        time.sleep(0.2)
    try:
        runs = [_run(c, work) for c in commands]
        strict = commands[-1].replace("--max-drop 0.4", "--max-drop 0.3").replace("gsm8k-local-2.json", "strict.json")
        control = _run(strict, work)
    finally:
        up.proc.send_signal(signal.SIGTERM)
        code = up.proc.wait(timeout=90)
        reader.join(timeout=10)
    return {
        "commands": commands,
        "runs": runs,
        "control": control,
        "up_exit_status": code,
        "up_output": [ln.rstrip() for ln in lines],
    }


def up_lines(topology: str) -> dict[str, Any]:
    """`up TOPOLOGY` as `make run TOPOLOGY=...` starts it: its console lines until the smoke request's result."""
    work = Path(tempfile.mkdtemp(prefix="up-"))
    up = spawn(
        "up", [*CLI, "up", topology, "--log-dir", str(work / "logs")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    stdout = up.proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    try:
        while not any(ln.startswith(("try: ", "error: ")) for ln in lines):
            assert time.monotonic() < deadline and up.alive(), "".join(lines[-40:])
            time.sleep(0.2)
    finally:
        up.proc.send_signal(signal.SIGTERM)
        up.proc.wait(timeout=90)
        reader.join(timeout=10)
    return {"lines": lines}
