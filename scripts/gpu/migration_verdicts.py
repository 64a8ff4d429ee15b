"""What the migration stage (`migration_stage.py`) requires, as pure functions over what it recorded.

A stream is `{"ids": [int], "done": bool, "error": str | None, "hung": bool, "seconds": float}`.
A verdict is None when the requirement holds, else one sentence that says why not.

- The kill: every stream of the killed run completes (all its tokens, `[DONE]`, no error event,
  not hung), and the router moved at least one (else the kill hit no stream in flight). Identity
  with the uninterrupted run is measured, not required: on GPU kernels a batch of another
  composition may change a greedy token, so the figures quote the share identical, the same share
  between two uninterrupted runs, and the first divergence of every stream that differs.
- Leftovers: once the streams are over, no live engine or router holds more than it held idle.
- The control: with migration off, the same kill ends a stream with the error event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Stream = dict[str, Any]
MIGRATIONS = "sglang_pd_router_migrations_total"
#: The key of a server's reading that lists the gauges it did not export.
ABSENT = "absent"
#: The router's log line for a stream that moved (deploy/router/pd/proxy.py).
MOVED_LINE = "stream moved to another pair"


def complete(s: Stream, length: int) -> bool:
    return bool(s["done"]) and not s["error"] and not s["hung"] and len(s["ids"]) == length


def first_divergence(ref: Sequence[int], got: Sequence[int]) -> dict[str, Any] | None:
    """Where `got` first leaves `ref`: the token index and both ids (None past the shorter's end);
    None when they are equal."""
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return {"index": i, "uninterrupted": a, "got": b}
    if len(ref) == len(got):
        return None
    n = min(len(ref), len(got))
    return {"index": n, "uninterrupted": ref[n] if n < len(ref) else None, "got": got[n] if n < len(got) else None}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def moved_ids(log: str) -> set[str]:
    """The client request ids (`x-request-id`) of the streams the router's log says moved; a line
    may carry a prefix before its JSON (`up` names the component whose line it relays)."""
    moved = set()
    for line in log.splitlines():
        if MOVED_LINE in line and "{" in line:
            try:
                entry = json.loads(line[line.index("{") :])
            except json.JSONDecodeError:
                continue
            moved.add(str(entry.get("client_request_id", "")))
    return moved


def figures(
    uninterrupted: Sequence[Stream],
    again: Sequence[Stream],
    killed: Sequence[Stream],
    length: int,
    moved: Sequence[str] = (),
) -> dict[str, Any]:
    """The kill run against the uninterrupted one: completion, identity, and the latency added to
    the streams that moved (`moved`: their request ids, `mig-<index>`)."""
    if not len(uninterrupted) == len(again) == len(killed):
        raise ValueError(
            f"runs of {len(uninterrupted)}, {len(again)} and {len(killed)} streams: they ran different streams"
        )
    n = len(killed)
    differ_again = {
        i: d
        for i, (r, a) in enumerate(zip(uninterrupted, again, strict=True))
        if (d := first_divergence(r["ids"], a["ids"]))
    }
    differ_kill = {
        i: d
        for i, (r, k) in enumerate(zip(uninterrupted, killed, strict=True))
        if (d := first_divergence(r["ids"], k["ids"]))
    }
    moved_at = {int(rid.rsplit("-", 1)[1]) for rid in moved if rid.rsplit("-", 1)[-1].isdigit()}
    added = [
        k["seconds"] - r["seconds"]
        for i, (r, k) in enumerate(zip(uninterrupted, killed, strict=True))
        if i in moved_at and complete(k, length)
    ]
    return {
        "streams": n,
        "uninterrupted_complete": sum(complete(s, length) for s in uninterrupted),
        "complete": sum(complete(s, length) for s in killed),
        "error_events": sum(bool(s["error"]) for s in killed),
        "hung": sum(bool(s["hung"]) for s in killed),
        "identical_to_uninterrupted": n - len(differ_kill),
        "identical_between_uninterrupted_runs": n - len(differ_again),
        "first_divergence": {str(i): d for i, d in sorted(differ_kill.items())},
        "first_divergence_between_uninterrupted_runs": {str(i): d for i, d in sorted(differ_again.items())},
        "moved": len(moved_at),
        "added_seconds_p50": _pct(added, 0.5),
        "added_seconds_p99": _pct(added, 0.99),
        "added_seconds_max": _pct(added, 1.0),
    }


def migrations(metrics_text: str) -> dict[str, float]:
    """The router's migration counter by outcome, from its /metrics text."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(MIGRATIONS + "{"):
            labels, value = line[len(MIGRATIONS) + 1 :].rsplit("} ", 1)
            outcome = dict(p.split("=", 1) for p in labels.split(",") if "=" in p).get("outcome", '""').strip('"')
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def kill_verdict(f: dict[str, Any], moved: dict[str, float]) -> str | None:
    if f["uninterrupted_complete"] != f["streams"]:
        done = f"{f['uninterrupted_complete']} of {f['streams']}"
        return f"the uninterrupted run completed {done} streams: nothing to compare with"
    if f["hung"]:
        return f"{f['hung']} of {f['streams']} streams hung after the kill"
    if f["complete"] != f["streams"]:
        errors = f"{f['error_events']} with an error event"
        return f"{f['complete']} of {f['streams']} streams completed after the kill ({errors})"
    if not moved.get("migrated"):
        return f"the router moved no stream (migrations by outcome: {moved}): the kill hit no stream in flight"
    return None


def left_behind(idle: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """Each gauge of `now` above its idle value (0 where idle has none), by server. A server that
    did not answer, or answered with none of the gauges asked for, is listed as such: nothing it
    holds could be seen."""
    out: dict[str, Any] = {}
    for server, values in now.items():
        if "unreachable" in values:
            out[server] = values
            continue
        read = {k: v for k, v in values.items() if k != ABSENT}
        if not read:
            out[server] = {"no gauge read": values.get(ABSENT, [])}
            continue
        base = idle.get(server, {})
        over = {k: v for k, v in read.items() if v is not None and v > (base.get(k) or 0.0)}
        if over:
            out[server] = over
    return out


def leftover_verdict(idle: dict[str, Any], after: dict[str, Any]) -> str | None:
    left = left_behind(idle, after)
    return f"state left after the streams ended, above idle: {left}" if left else None


def control_verdict(streams: Sequence[Stream], kill: dict[str, Any]) -> str | None:
    if "at_s" not in kill:
        return f"the control's kill did not happen ({kill.get('not_killed', kill)})"
    if not any(s["error"] for s in streams):
        return (
            "with --migration-limit 0 the kill ended no stream with an error event: "
            "the kill touched no stream in flight"
        )
    return None
