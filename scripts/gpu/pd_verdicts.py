"""What the one-GPU PD check requires of its outputs: identity by token ids, and controls that must fail.

Pure functions over recorded outputs, so that `tests/scripts/test_pd_verdicts.py` shows on a CPU
that each one can fail. An output is what one request returned: `{"status": int, "ids": [int] |
None, ...}`. A verdict is None when the requirement holds, else one sentence that says why not.

- Identity: every prompt, in every request form, must give the single server's greedy token ids
  through the PD stack: both answered 200, both returned all `length` tokens, and the ids are equal.
  A shorter output is a mismatch, even one that agrees on its prefix.
- The context control: two prompts that end alike (the same last tokens) must give different
  outputs on the single server. A model that answers from the last token alone cannot show a
  missing or stale KV page; this one must.
- The KV-page fault control: without the fault the control prompts through the stack must give
  the single server's ids; while the check's fault corrupts one KV page of each on its way to the
  decode server (`faults/pd_check_kv_fault.py`), every control's output must differ from the single
  server's, and the fault log must show one fault per control at least. A control that matches
  means the check cannot see a corrupted page.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Output = dict[str, Any]


def _complete(out: Output, side: str, length: int) -> str | None:
    """Why `out` is not a complete greedy output of `length` tokens, or None."""
    if out.get("status") != 200:
        return f"{side} answered HTTP {out.get('status')}" + (f": {out['error']}" if out.get("error") else "")
    ids = out.get("ids")
    if not isinstance(ids, list):
        return f"{side} returned no token ids" + (f" ({out['error']})" if out.get("error") else "")
    if len(ids) != length:
        return f"{side} returned {len(ids)} tokens, not {length}"
    return None


def mismatch(ref: Output, got: Output, length: int) -> str | None:
    """None when `got` (the PD stack's) has exactly the token ids of `ref` (the single server's)."""
    why = _complete(ref, "single", length) or _complete(got, "pd", length)
    if why:
        return why
    a, b = ref["ids"], got["ids"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    return None if first is None else f"token {first} differs: single {a[first]}, pd {b[first]}"


def compare_form(ref: Sequence[Output], got: Sequence[Output], length: int) -> dict[str, Any]:
    """One request form, prompt by prompt: the verdict and both sides' ids and statuses (the evidence)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(ref)} reference outputs against {len(got)}: the two sides ran different prompts")
    rows = []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        why = mismatch(r, g, length)
        rows.append(
            {
                "prompt": i,
                "verdict": why or "identical",
                "single": {"status": r.get("status"), "ids": r.get("ids")},
                "pd": {"status": g.get("status"), "ids": g.get("ids")},
            }
        )
    same = sum(row["verdict"] == "identical" for row in rows)
    return {"identical": f"{same}/{len(rows)}", "all_identical": same == len(rows), "prompts": rows}


def context_verdict(a: Output, b: Output, length: int) -> str | None:
    """None when two prompts that end alike gave complete and different outputs on the single server."""
    why = _complete(a, "the first prompt", length) or _complete(b, "the second prompt", length)
    if why:
        return f"context control: {why}"
    if a["ids"] == b["ids"]:
        return (
            "context control: two prompts with different contexts and the same last tokens gave the same "
            f"{length} tokens, so the model answers from the last tokens alone and cannot show a wrong KV page"
        )
    return None


def read_fault_log(path: Path) -> list[dict[str, Any]]:
    """The fault log's events, in order (none when the file does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fault_verdict(
    ref: Sequence[Output],
    clean: Sequence[Output],
    got: Sequence[Output],
    events: Sequence[dict[str, Any]],
    length: int,
) -> str | None:
    """None when the controls through the stack equal the single server's without the fault
    (`clean`), the fault fired for every control, and every control's output with it (`got`)
    differs from the single server's (`ref`); else why the check could not see a corrupted KV page."""
    if not ref or not (len(ref) == len(clean) == len(got)):
        return f"fault control: {len(ref)} reference outputs against {len(clean)} and {len(got)} controls"
    for i, (r, c) in enumerate(zip(ref, clean, strict=True)):
        why = mismatch(r, c, length)
        if why:
            return (
                f"fault control: control {i} differs without the fault ({why}), so a difference with it proves nothing"
            )
    faults = [e for e in events if e.get("event") == "fault"]
    if not faults:
        armed = sum(e.get("event") == "armed" for e in events)
        return (
            f"fault control: the fault log shows no fault (the wrapper was armed in {armed} processes), "
            "so the control outputs prove nothing"
        )
    if len(faults) < len(ref):
        return f"fault control: {len(faults)} faults for {len(ref)} control prompts; each needs one"
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        why = _complete(r, "single", length) or _complete(g, "pd", length)
        if why:
            return f"fault control: control {i}: {why}"
        if r["ids"] == g["ids"]:
            return (
                f"fault control: control {i} gave the single server's {length} tokens with one KV page "
                "corrupted, so a wrong page would pass the identity check unseen"
            )
    return None
