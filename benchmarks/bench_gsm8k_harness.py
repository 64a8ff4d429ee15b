"""Throughput of the gsm8k harness itself: `sglang-pd eval gsm8k` against a server that answers at once.

The server is the scripted loopback server of `tests/support/gsm8k_server.py`, in its own process
(so that server and harness do not share one interpreter lock), answering every question correctly.
Two runs: every line of test.jsonl as a question (`--num-shots 0`, 1319 questions) and the default
5-shot prompts (1314 questions). Target: each under 5 s at --parallel 64 on a 2-core machine. The
harness's own CPU time (user + system of this process, the server excluded) is reported too.

    .venv/bin/python benchmarks/bench_gsm8k_harness.py [--parallel 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the test doubles live in tests/support, outside the package

from sglang_pd.deploy.cli import main as sglang_pd_main  # noqa: E402
from sglang_pd.deploy.evals import PACKAGED_GSM8K, load_dataset  # noqa: E402
from tests.support.gsm8k_server import Gsm8kTestServer, scripted_answers  # noqa: E402

DEFAULT_DATA = PACKAGED_GSM8K
TARGET_S = 5.0


def _serve(data: str, conn: Connection) -> None:
    problems = load_dataset(Path(data)).problems
    with Gsm8kTestServer(scripted_answers(problems, correct=lambda p: True)) as server:
        conn.send(server.base_url)
        conn.recv()  # until the parent says stop


def _run(base_url: str, data: Path, parallel: int, num_shots: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        argv = ["eval", "gsm8k", "--base-url", base_url, "--data", str(data), "--num-shots", str(num_shots)]
        argv += ["--num-questions", "all", "--parallel", str(parallel), "--quiet", "--output", str(report_path)]
        start, cpu_start = time.perf_counter(), os.times()
        with contextlib.redirect_stdout(io.StringIO()):  # the CLI's own table; ours follows
            code = sglang_pd_main(argv)
        total_s = time.perf_counter() - start
        cpu_end = os.times()
        cpu_s = (cpu_end.user - cpu_start.user) + (cpu_end.system - cpu_start.system)
        report = json.loads(report_path.read_text())
    m = report["metrics"]
    return {
        "num_shots": num_shots,
        "questions": m["n"],
        "parallel": parallel,
        "exit_code": code,
        "accuracy": m["accuracy"],
        "errors": m["errors"],
        "total_s": round(total_s, 3),
        "harness_cpu_s": round(cpu_s, 3),
        "harness_cpu_ms_per_question": round(1000 * cpu_s / m["n"], 3),
        "harness_wall_s": round(m["wall_s"], 3),
        "questions_per_s": round(m["n"] / total_s, 1),
        "latency_p50_s": m["latency_s"]["p50"],
        "latency_p99_s": m["latency_s"]["p99"],
        "under_target": total_s < TARGET_S,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"default: {DEFAULT_DATA}")
    parser.add_argument("--parallel", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if not args.data.exists():
        print(f"error: {args.data} is missing; pass --data PATH to gsm8k test.jsonl.", file=sys.stderr)
        return 2

    parent, child = mp.get_context("spawn").Pipe()
    server = mp.get_context("spawn").Process(target=_serve, args=(str(args.data), child), daemon=True)
    server.start()
    try:
        base_url = parent.recv()
        rows = [_run(base_url, args.data, args.parallel, shots) for shots in (0, 5)]
    finally:
        parent.send("stop")
        server.join(timeout=10)

    header = (
        f"{'shots':>5} {'questions':>9} {'parallel':>8} {'total s':>8} {'cpu s':>6} {'q/s':>7} {'p50 s':>7} "
        f"{'p99 s':>7}  ok"
    )
    print(f"gsm8k harness vs an instant server ({os.cpu_count()} CPUs; target < {TARGET_S:g} s)")
    print(header)
    for r in rows:
        ok = "yes" if r["under_target"] and r["errors"] == 0 and r["accuracy"] == 1.0 else "NO"
        print(
            f"{r['num_shots']:>5} {r['questions']:>9} {r['parallel']:>8} {r['total_s']:>8.2f} "
            f"{r['harness_cpu_s']:>6.2f} "
            f"{r['questions_per_s']:>7.1f} {r['latency_p50_s']:>7.3f} {r['latency_p99_s']:>7.3f}  {ok}"
        )
    result = {"benchmark": "gsm8k_harness", "cpus": os.cpu_count(), "target_s": TARGET_S, "runs": rows}
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["under_target"] and r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
