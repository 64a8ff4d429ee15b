"""Where requests spent their time inside each sglang server, read from its own histograms.

sglang (srt/observability/metrics_collector.py, exported with `--enable-metrics`, which the
renderer always gives) times every request's stages and observes each into a histogram:
`sglang:per_stage_req_latency_seconds`, split by the label `stage` (on a prefill server
`prefill_bootstrap`, `prefill_forward`, `chunked_prefill`, `prefill_transfer_kv_cache`; on a decode
server `decode_prepare`, `decode_bootstrap`, `decode_waiting`, `decode_transferred`; the stage names
are sglang's RequestStage in srt/observability/req_time_stats.py), besides the waiting queue's
`sglang:queue_time_seconds` and the TTFT and end-to-end time its tokenizer records (on a decode
server; a prefill server records neither). A histogram's `_sum` and `_count` only grow, so two
readings around a run that had the servers to itself give the mean time per stage of that run's
requests: the routers stage reads them around each arm's round, to narrow down where an arm's
difference arises. The stages of the two servers overlap in time (the decode's
`decode_transferred` spans the prefill's queue, forward and KV send), so they are read side by
side, not added up.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

#: The histograms read, and the key each gets when it has no `stage` label.
HISTOGRAMS = {
    "sglang:per_stage_req_latency_seconds": "stage",
    "sglang:queue_time_seconds": "queue",
    "sglang:time_to_first_token_seconds": "ttft",
    "sglang:e2e_request_latency_seconds": "e2e",
}

#: The starts of the lines read: each histogram's sum and count series.
SERIES = tuple(f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("sum", "count"))

#: A histogram's sum or count line: name, suffix, labels (optional), value.
_LINE = re.compile(r"^(sglang:[A-Za-z0-9_]+)_(sum|count)(?:\{([^}]*)\})? (\S+)$", re.M)
_STAGE = re.compile(r'(?:^|,)stage="([^"]*)"')

#: Per key (a stage's name, or HISTOGRAMS' key): [sum of seconds, count of observations].
Reading = dict[str, list[float]]


def parse(text: str) -> Reading:
    """The sums and counts of HISTOGRAMS in one /metrics text, summed over label sets except
    `stage`, which keys its own entry. Summing is right for DP-attention ranks, each a scheduler
    timing its own requests; only the first rank of a tensor-parallel group records them, unless
    sglang runs with --enable-metrics-for-all-schedulers (then each rank counts the same requests)."""
    out: Reading = {}
    for name, suffix, labels, value in _LINE.findall(text):
        if name not in HISTOGRAMS:
            continue
        stage = _STAGE.search(labels or "")
        key = stage.group(1) if stage and HISTOGRAMS[name] == "stage" else HISTOGRAMS[name]
        entry = out.setdefault(key, [0.0, 0.0])
        entry[0 if suffix == "sum" else 1] += float(value)
    return out


def delta(before: Mapping[str, Reading], after: Mapping[str, Reading]) -> dict[str, Reading]:
    """Per server, what each key gained between two readings (servers not read twice left out)."""
    out: dict[str, Reading] = {}
    for server, now in after.items():
        if server not in before:
            continue
        then = before[server]
        gained: Reading = {}
        for key, (s, n) in now.items():
            s0, n0 = then.get(key, (0.0, 0.0))
            gained[key] = [s - s0, n - n0]
        out[server] = gained
    return out


def total(deltas: Iterable[Mapping[str, Reading]]) -> dict[str, Reading]:
    """Deltas of several runs added up, per server and key."""
    out: dict[str, Reading] = {}
    for one in deltas:
        for server, reading in one.items():
            mine = out.setdefault(server, {})
            for key, (s, n) in reading.items():
                entry = mine.setdefault(key, [0.0, 0.0])
                entry[0] += s
                entry[1] += n
    return out


def means(summed: Mapping[str, Reading]) -> dict[str, dict[str, dict[str, float]]]:
    """Per server and key with observations: the mean in ms and how many observations it is over
    (a request's; `chunked_prefill` is observed once per chunk)."""
    return {
        server: {
            key: {"mean_ms": round(s / n * 1e3, 3), "count": int(n)} for key, (s, n) in sorted(reading.items()) if n > 0
        }
        for server, reading in summed.items()
    }
