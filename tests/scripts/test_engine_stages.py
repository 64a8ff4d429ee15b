"""scripts/gpu/engine_stages.py: sglang's stage histograms read from /metrics text as sglang's
prometheus_client writes it, and the mean time per stage of what ran between two readings."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from tests.support.paths import SGLANG_RECORDINGS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
stages = importlib.import_module("engine_stages")

#: sglang 0.5's stage names (srt/observability/req_time_stats.py, RequestStage, those observed as
#: metrics) and the keys of the histograms without a stage.
KNOWN_KEYS = {
    "request_process", "prefill_forward", "chunked_prefill", "prefill_bootstrap", "prefill_transfer_kv_cache",
    "decode_prepare", "decode_bootstrap", "decode_waiting", "decode_transferred", "fake_output", "quick_finish",
    "queue", "ttft", "e2e",
}  # fmt: skip
LABELS = 'engine_type="prefill",model_name="tiny-deepseek-v3",moe_ep_rank="0",pp_rank="0"'


def metrics(forward_s: float, forward_n: int, queue_s: float, queue_n: int) -> str:
    """A prefill server's /metrics: two DP-attention ranks (each its own scheduler, timing its own
    requests), buckets and `_created` lines beside the sums and counts, and a histogram the reader
    does not ask for."""
    lines = ["# HELP sglang:per_stage_req_latency_seconds The latency of each stage of requests."]
    lines.append("# TYPE sglang:per_stage_req_latency_seconds histogram")
    for rank in ("0", "1"):
        stage = f'{{{LABELS},stage="prefill_forward",dp_rank="{rank}",tp_rank="0"}}'
        bucket = f'{{{LABELS},le="0.001",stage="prefill_forward",dp_rank="{rank}",tp_rank="0"}}'
        lines += [
            f"sglang:per_stage_req_latency_seconds_bucket{bucket} 0.0",
            f"sglang:per_stage_req_latency_seconds_sum{stage} {forward_s / 2}",
            f"sglang:per_stage_req_latency_seconds_count{stage} {forward_n / 2}",
            f"sglang:per_stage_req_latency_seconds_created{stage} 1.79e9",
        ]
    lines += [
        f'sglang:per_stage_req_latency_seconds_sum{{{LABELS},stage="prefill_bootstrap",tp_rank="0"}} 0.5',
        f'sglang:per_stage_req_latency_seconds_count{{{LABELS},stage="prefill_bootstrap",tp_rank="0"}} 5.0',
        f'sglang:queue_time_seconds_sum{{{LABELS},tp_rank="0"}} {queue_s}',
        f'sglang:queue_time_seconds_count{{{LABELS},tp_rank="0"}} {queue_n}',
        f'sglang:inter_token_latency_seconds_sum{{{LABELS},tp_rank="0"}} 99.0',
        f'sglang:inter_token_latency_seconds_count{{{LABELS},tp_rank="0"}} 99.0',
    ]
    return "\n".join(lines) + "\n"


def test_sums_and_counts_are_read_per_stage_over_ranks() -> None:
    got = stages.parse(metrics(2.0, 40, 1.0, 20))
    assert got == {"prefill_forward": [2.0, 40.0], "prefill_bootstrap": [0.5, 5.0], "queue": [1.0, 20.0]}
    assert stages.parse("# nothing exported\n") == {}


def test_what_ran_between_two_readings_is_its_mean_per_stage() -> None:
    first = stages.delta(
        {"prefill": stages.parse(metrics(2.0, 40, 1.0, 20))}, {"prefill": stages.parse(metrics(2.5, 50, 1.0, 20))}
    )
    second = stages.delta(
        {"prefill": stages.parse(metrics(2.5, 50, 1.0, 20))}, {"prefill": stages.parse(metrics(4.5, 60, 1.3, 30))}
    )
    got = stages.means(stages.total([first, second]))
    # 20 requests forwarded in 2.5 s; 10 queued for 0.3 s; the bootstrap stage saw none of them.
    assert got == {
        "prefill": {"prefill_forward": {"mean_ms": 125.0, "count": 20}, "queue": {"mean_ms": 30.0, "count": 10}}
    }


def test_a_server_read_only_once_is_left_out() -> None:
    # Its /metrics failed after the run: a difference against nothing would count its whole life.
    assert stages.delta({}, {"decode": stages.parse(metrics(2.0, 40, 1.0, 20))}) == {}


def test_series_without_labels_are_read() -> None:
    assert stages.parse("sglang:queue_time_seconds_sum 1.5\nsglang:queue_time_seconds_count 3\n") == {
        "queue": [1.5, 3.0]
    }


def test_the_reader_reads_what_real_sglang_wrote() -> None:
    """The sum and count lines the GPU check recorded from sglang's PD servers after its requests."""
    recorded = {
        f"{path.name} {role}": server["stage_histograms"]["lines"]
        for path in sorted(SGLANG_RECORDINGS.glob("sglang-*-http.json"))
        for role, server in json.loads(path.read_text()).get("servers", {}).items()
        if role in ("prefill", "decode") and "stage_histograms" in server
    }
    if not recorded:
        pytest.skip("no recording holds the stage histograms yet: the GPU check's pd stage writes them")
    for where, lines in recorded.items():
        got = stages.parse("\n".join(lines))
        assert got and set(got) <= KNOWN_KEYS, (where, got)
        assert all(n > 0 and s >= 0 for s, n in got.values()), (where, got)
