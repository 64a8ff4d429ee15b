"""The one-rank SBO run's report: its parts' outputs in one JSON file and a short table.

`scripts/gpu/gpu_sbo_one_rank.sh` leaves in its output folder the kernels' test logs
(`kernel_tests_<group>.log`), the PTX check (`ptx_fences.json`), the layer benchmark at each
``max_block_n`` (`decode_1gpu_bn<N>.json`), the DeepEP build log and `steps.jsonl` (one line per
step: its exit status and seconds). This reads them, judges each part, writes
`sbo_one_rank.json` (the form of `benchmarks/results/sbo_one_rank_*.json`) and prints the table.

    python3 scripts/gpu/sbo_one_rank_report.py OUT_DIR [--commit SHA] [--command "..."]

Standard library only: it runs on the GPU machine's bare Python as well as here.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

__all__ = ["FULL_PREFIXES", "decision_160", "layer_rows", "main", "pytest_result", "report", "table"]

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_PROGRESS = re.compile(r"^([.FEsxX]+)\s*\[\s*\d+%\]\s*$")
#: The overlapped variants of bench_moe_layer.py judged against the baselines: full SBO with the shared
#: expert in the dispatch window (``full@S``) and on the alternate stream (``full_alt@S``, what is rendered).
FULL_PREFIXES = ("full@", "full_alt@")
_PROGRESS_KIND = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}


def pytest_result(text: str) -> dict[str, Any]:
    """The counts of a ``pytest -q`` log: from its summary line, or from its progress lines when
    the run was cut off before the summary (``complete`` False)."""
    summary = next(
        (line for line in reversed(text.splitlines()) if re.search(r"\b(passed|failed|errors?|skipped)\b.* in ", line)),
        None,
    )
    failures = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    if summary is not None:
        counts: dict[str, int] = {}
        for n, kind in _COUNT.findall(summary):
            counts["error" if kind.startswith("error") else kind] = int(n)
        seconds = re.search(r" in ([\d.]+)s", summary)
        return {"complete": True, "counts": counts, "seconds": float(seconds.group(1)) if seconds else None,
                "summary": summary.strip("= "), "failures": failures}  # fmt: skip
    progress: dict[str, int] = {}
    for line in text.splitlines():
        m = _PROGRESS.match(line.strip())
        if m:
            for ch in m.group(1):
                progress[_PROGRESS_KIND[ch]] = progress.get(_PROGRESS_KIND[ch], 0) + 1
    return {"complete": False, "counts": progress, "seconds": None, "summary": "cut off (no summary line)",
            "failures": failures}  # fmt: skip


def _pct(new: float, base: float) -> float:
    return round(100.0 * (new / base - 1.0), 2)


def layer_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """Per token count: each variant's time, full@S against none and deepgemm (+: slower), the
    replay check's verdict and the derived waves."""
    rows = []
    for r in bench.get("decode", []):
        v = r["variants"]
        us = {k: round(x["us"], 1) for k, x in v.items() if "us" in x}
        fulls = [k for k in us if k.startswith(FULL_PREFIXES)]
        check = r.get("replay_check", {})
        tallies = check.get("tallies", {})
        controls = {k: f"{t['mismatched_replays']}/{t['replays']}" for k, t in tallies.items() if t["must_fail"]}
        row: dict[str, Any] = {
            "tokens_per_rank": r["tokens_per_rank"],
            "expected_m": r.get("expected_m"),
            "max_block_n_full": r.get("max_block_n_full"),
            "recv_tokens": r.get("recv_tokens"),
            "experts_without_tokens": r.get("experts_without_tokens"),
            "us": us,
            "full_vs_none_pct": {k: _pct(us[k], us["none"]) for k in fulls if "none" in us},
            "full_vs_deepgemm_pct": {k: _pct(us[k], us["deepgemm"]) for k in fulls if "deepgemm" in us},
            "deepgemm_vs_none_pct": _pct(us["deepgemm"], us["none"]) if {"none", "deepgemm"} <= us.keys() else None,
            "variants_ok": all(x.get("ok") for x in v.values()),
            "errors": {k: x["error"] for k, x in v.items() if "error" in x},
            "replay_check": None
            if not check
            else {
                "replays": check.get("replays"),
                "ok": check.get("verdict", {}).get("ok", False),
                "problems": check.get("verdict", {}).get("problems", ["no verdict"]),
                "controls_caught": controls,
            },
            "waves": {
                s: {k: w[k] for k in ("gemm_waves", "released_in_last_wave", "row_blocks", "send_rounds") if k in w}
                for s, w in r.get("waves", {}).items()
            },
        }
        rows.append(row)
    return rows


def decision_160(b256: dict[str, Any], b160: dict[str, Any]) -> dict[str, Any]:
    """Does sglang's ``max_block_n`` 160 rule (H20) cost our kernel? Per token count where it
    applies: full SBO at 160 against 256 (the first ``full@S`` both runs have), and ``none``, whose
    kernels are the same in both runs, as the spread between the two runs."""
    by_t = {r["tokens_per_rank"]: r for r in layer_rows(b256)}
    out: dict[str, Any] = {"rows": []}
    for r in layer_rows(b160):
        other = by_t.get(r["tokens_per_rank"])
        fulls = [k for k in r["us"] if k.startswith("full@") and other and k in other["us"]]
        if other is None or not fulls or "none" not in r["us"] or "none" not in other["us"]:
            continue
        full = fulls[0]
        full_pct = _pct(r["us"][full], other["us"][full])
        none_pct = _pct(r["us"]["none"], other["us"]["none"])
        out["rows"].append({
            "tokens_per_rank": r["tokens_per_rank"],
            "variant": full,
            "max_block_n_full": r["max_block_n_full"],
            "full_160_vs_256_pct": full_pct,
            "none_spread_pct": none_pct,
            # beyond what the same kernels moved between the two runs, with 1 % to spare
            "costs": r["max_block_n_full"] == 160 and full_pct > abs(none_pct) + 1.0,
        })  # fmt: skip
    applied = [x for x in out["rows"] if x["max_block_n_full"] == 160]
    costly = [x["tokens_per_rank"] for x in applied if x["costs"]]
    out["reading"] = (
        "no token count where the 160 rule applies was measured in both runs"
        if not applied
        else f"max_block_n 160 costs full SBO more than the runs' spread + 1 % at T = {costly}"
        if costly
        else "max_block_n 160 costs full SBO no more than the runs' spread + 1 % where it applies"
    )
    return out


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError as exc:
        return {"unreadable": f"{path.name}: {exc}"}


def report(out: Path, commit: str = "unknown", command: str = "", layer_only: bool = False) -> dict[str, Any]:
    """Everything in ``out`` judged: ``verdict.ok`` only if every part ran to its end and passed.
    ``layer_only``: the run was the layer benchmark alone (``LAYER_ONLY=1``), so the kernels' tests and
    the PTX check are recorded as not run instead of failing the verdict."""
    problems: list[str] = []
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()] if (
        out / "steps.jsonl"
    ).is_file() else []  # fmt: skip
    tests = {
        p.stem.removeprefix("kernel_tests_"): pytest_result(p.read_text(errors="replace"))
        for p in sorted(out.glob("kernel_tests_*.log"))
    }
    if not tests and not layer_only:
        problems.append("no kernel test log")
    for group, outcome in tests.items():
        if not outcome["complete"]:
            problems.append(f"kernel tests {group}: cut off before the end ({outcome['counts']})")
        if outcome["counts"].get("failed") or outcome["counts"].get("error"):
            problems.append(f"kernel tests {group}: {outcome['summary']}")
        elif outcome["complete"] and not outcome["counts"].get("passed"):
            problems.append(f"kernel tests {group}: none passed ({outcome['summary']}): no GPU seen?")
    ptx = _read_json(out / "ptx_fences.json")
    if not layer_only and (not ptx or not ptx.get("ok")):
        problems.append(f"PTX fences: {'no ptx_fences.json' if ptx is None else 'not ok'}")
    layers: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    for path in sorted(out.glob("decode_1gpu_bn*.json"), key=lambda p: -int(p.stem.removeprefix("decode_1gpu_bn"))):
        bn = path.stem.removeprefix("decode_1gpu_bn")
        bench = _read_json(path) or {}
        raw[f"max_block_n_{bn}"] = bench
        rows = layer_rows(bench)
        layers[f"max_block_n_{bn}"] = rows
        if not bench.get("complete"):
            problems.append(f"layer bn {bn}: incomplete ({bench.get('aborted') or bench.get('error') or 'no result'})")
        for r in rows:
            if not r["variants_ok"]:
                problems.append(f"layer bn {bn} T={r['tokens_per_rank']}: a variant failed {r['errors'] or ''}".strip())
            if r["replay_check"] is None:
                problems.append(f"layer bn {bn} T={r['tokens_per_rank']}: no replay check")
            elif not r["replay_check"]["ok"]:
                problems.append(f"layer bn {bn} T={r['tokens_per_rank']}: {'; '.join(r['replay_check']['problems'])}")
    if not layers:
        problems.append("no layer benchmark result")
    first: dict[str, Any] = next((b for b in raw.values() if b.get("gpu")), {})
    result: dict[str, Any] = {
        "what": "SBO's real chain on one GPU: the kernels' GPU tests, the PTX fence check, and one decode MoE "
        "layer against sglang's baselines with a combine-send SM sweep and a per-replay bit-for-bit check "
        "with a must-fail control",
        "command": command,
        "commit": commit,
        "gpu": first.get("gpu"),
        "date": first.get("date"),
        "software": {
            "torch": first.get("torch"),
            "triton": first.get("triton"),
            "deep_ep": first.get("deep_ep", {}).get("revision"),
            "deepgemm": first.get("deepgemm"),
        },
        "parts": "the layer benchmark only (LAYER_ONLY=1): kernel tests and PTX check not run"
        if layer_only
        else "kernel tests, PTX check, layer benchmark",
        "steps": steps,
        "kernel_tests": tests,
        "ptx_fences": ptx,
        "layer": layers,
        "max_block_n_160_decision": decision_160(raw["max_block_n_256"], raw["max_block_n_160"])
        if {"max_block_n_256", "max_block_n_160"} <= raw.keys()
        else None,
        "verdict": {"ok": not problems, "problems": problems},
        "raw": raw,
    }
    return result


def _signed(pct: float | None) -> str:
    return f"{pct:+6.1f}" if pct is not None else f"{'-':>6}"


def table(result: dict[str, Any]) -> str:
    """The short table printed last."""
    lines = [f"SBO one rank: {result.get('gpu')}, commit {result['commit']}"]
    for group, t in result["kernel_tests"].items():
        secs = f" in {t['seconds']:.0f} s" if t["seconds"] else ""
        lines.append(f"  kernel tests {group:<10} {t['counts']}{secs}{'' if t['complete'] else ' (CUT OFF)'}")
    ptx = result["ptx_fences"] or {}
    lines.append(f"  PTX fences: {len(ptx.get('unfenced', [])) if ptx else '?'} unfenced of {ptx.get('releases', '?')}")
    for name, rows in result["layer"].items():
        if not rows:
            lines.append(f"  layer {name}: no rows")
            continue
        fulls = [k for k in rows[0]["us"] if k.startswith(FULL_PREFIXES)]
        base = [k for k in ("none", "deepgemm", "shared") if k in rows[0]["us"]]
        lines.append(f"  layer {name} (us; full@S: % slower than none / than deepgemm):")
        lines.append("    " + f"{'T':>4} {'em':>4} " + " ".join(f"{k:>8}" for k in base) + " | " +
                     " ".join(f"{k:>13}" for k in fulls) + " | replay check")  # fmt: skip
        for r in rows:
            cells = " ".join(f"{r['us'].get(k, float('nan')):8.1f}" for k in base)
            vs = " ".join(
                f"{_signed(r['full_vs_none_pct'].get(k))}/{_signed(r['full_vs_deepgemm_pct'].get(k))}" for k in fulls
            )
            rc = r["replay_check"]
            check = (
                "-"
                if rc is None
                else ("ok" if rc["ok"] else "FAILED")
                + f" x{rc['replays']}, caught "
                + ", ".join(rc["controls_caught"].values())
            )
            lines.append(f"    {r['tokens_per_rank']:>4} {r['expected_m']:>4} {cells} | {vs} | {check}")
    decision = result.get("max_block_n_160_decision")
    if decision:
        cells = ", ".join(
            f"T={x['tokens_per_rank']} {x['full_160_vs_256_pct']:+.1f} % (none {x['none_spread_pct']:+.1f} %)"
            for x in decision["rows"]
        )
        lines.append(f"  max_block_n 160 vs 256: {cells}; {decision['reading']}")
    verdict = result["verdict"]
    lines.append("  verdict: " + ("ok" if verdict["ok"] else "FAILED: " + " | ".join(verdict["problems"])))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the output folder of gpu_sbo_one_rank.sh")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--command", default="")
    p.add_argument("--layer-only", action="store_true", help="the run had no kernel tests or PTX check")
    args = p.parse_args(argv)
    if not args.out.is_dir():
        p.error(f"{args.out} is not a folder: pass the OUT_DIR gpu_sbo_one_rank.sh wrote")
    result = report(args.out, args.commit, args.command, args.layer_only)
    (args.out / "sbo_one_rank.json").write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
