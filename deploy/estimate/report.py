"""An estimate as JSON for machines or a table for people."""

from __future__ import annotations

import json

from sglang_pd.deploy.estimate.estimate import Estimate, SboTerms

__all__ = ["format_estimate"]


def _table(e: Estimate) -> str:
    p, d = e.prefill, e.decode
    rows = [
        ("phase", "tok/s per GPU", "latency", "bound"),
        ("prefill", f"{p.tokens_per_s_per_gpu:,.0f}", f"TTFT {p.latency_ms:,.0f} ms", p.bound),
        ("decode", f"{d.tokens_per_s_per_gpu:,.0f}", f"ITL {d.latency_ms:.1f} ms", d.bound),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    sbo = (
        f"SBO {_saving_words(e.sbo_saving, 'saves', 'costs')},"
        if e.sbo_applies
        else "SBO does not apply (needs DeepEP low-latency),"
    )
    lines = [
        f"estimate for {e.topology} on {e.gpu}: input {e.input_len}, output {e.output_len} tokens, "
        f"decode batch {e.decode_batch} per rank",
        "",
        *("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows),
        "",
        f"decode overlaps: {sbo} TBO would {_saving_words(e.tbo_saving, 'save', 'cost')}",
        *([_sbo_line(e.sbo)] if e.sbo else []),
        f"P:D ratio: {e.pd_ratio:.2f} prefill instances per decode group balance these lengths",
        f"KV capacity (decode): {e.kv.tokens_per_gpu:,} tokens per GPU; the batch needs "
        f"{e.kv.tokens_needed_per_gpu:,} (at most {e.kv.max_batch_per_rank} requests per rank): "
        + ("fits" if e.kv.fits else "DOES NOT FIT"),
    ]
    for phase, est in (("prefill", p), ("decode", d)):
        parts = ", ".join(f"{k} {v:,.1f}" for k, v in est.breakdown_ms.items())
        lines.append(f"{phase} pass, ms by resource on the critical path: {parts}")
    if e.warnings:
        lines += ["", "warnings:", *(f"  - {w}" for w in e.warnings)]
    lines += ["", "assumptions:", *(f"  - {a}" for a in e.assumptions)]
    return "\n".join(lines)


def _saving_words(fraction: float, save: str, cost: str) -> str:
    """A fraction of the ITL saved, in words that stay right when it is negative (an overlap that costs)."""
    if round(fraction, 3) == 0:
        return f"{save} nothing of the ITL"
    if fraction < 0:
        return f"{cost} {-fraction:.1%} more ITL"
    return f"{save} {fraction:.1%} of the ITL"


def _us(v: float) -> str:
    return f"{v:+.0f} us"


def _sbo_line(t: SboTerms) -> str:
    """SBO's gain or loss per MoE layer and per step, with the send-SM setting it assumes."""
    if t.runs == "full":
        what = f"combine-send on {t.send_sms} SMs, {t.send_sms_source}"
        head = f"SBO ({t.mode}; {what})" if t.mode == "full" else f"SBO (off here; full would run {what})"
        halves = (
            f"{_us(t.combine_us_per_layer)} down GEMM against combine-send; the shared expert on the alternate "
            "stream, as without SBO"
        )
    else:
        head = "SBO (shared-only: sglang runs no down-GEMM/combine overlap here)"
        halves = f"{_us(t.shared_us_per_layer)} shared expert in the dispatch window instead of the alternate stream"
    verdict = "gain" if t.us_per_layer >= 0 else "LOSS"
    return (
        f"{head}: {_us(t.us_per_layer)} per MoE layer ({halves}); {t.ms_per_step:+.2f} ms per step over "
        f"{t.moe_layers} MoE layers: a {verdict}"
    )


def format_estimate(e: Estimate, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(e.as_dict(), indent=2)
    if fmt == "table":
        return _table(e)
    raise ValueError(f"unknown estimate format {fmt!r}; choose table or json")
