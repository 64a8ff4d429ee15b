"""The GPU check's migration stage (scripts/gpu/migration_stage.py): its verdicts fail when they
should, and the stage itself runs end to end against reference engines started by a real `up`.

On one GPU the stage runs against sglang (`gpu_pd_check.py --stages migration`); here the same code
runs a 1P2D `local-cpu-mla` stack, kills a decode, and judges the streams, with the control router
(`--migration-limit 0`) breaking streams as it must.
"""

from __future__ import annotations

import importlib
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from tests.support.polling import free_port, free_ports

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts/gpu"))
verdicts = importlib.import_module("migration_verdicts")
stage = importlib.import_module("migration_stage")

PRESETS = Path(__file__).resolve().parents[2] / "deploy/spec/presets"
N = 6


def s(
    ids: list[int], *, done: bool = True, error: str | None = None, hung: bool = False, seconds: float = 1.0
) -> dict[str, Any]:
    return {"ids": ids, "done": done, "error": error, "hung": hung, "seconds": seconds}


REF = [s([1, 2, 3, 4, 5, 6]), s([7, 8, 9, 10, 11, 12])]


def test_first_divergence_names_the_token_and_both_ids() -> None:
    assert verdicts.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert verdicts.first_divergence([1, 2, 3], [1, 5, 3]) == {"index": 1, "uninterrupted": 2, "got": 5}
    # A stream cut short differs where it ends.
    assert verdicts.first_divergence([1, 2, 3], [1, 2]) == {"index": 2, "uninterrupted": 3, "got": None}


def test_a_clean_kill_passes_and_quotes_identity_and_latency() -> None:
    killed = [s([1, 2, 3, 4, 5, 6], seconds=1.5), s([7, 8, 9, 10, 99, 12], seconds=3.0)]
    f = verdicts.figures(REF, REF, killed, N, moved=["mig-0"])
    assert f["complete"] == 2 and f["identical_to_uninterrupted"] == 1
    assert f["first_divergence"] == {"1": {"index": 4, "uninterrupted": 11, "got": 99}}
    assert f["identical_between_uninterrupted_runs"] == 2
    # Only the moved stream's latency counts: stream 1 stayed on its decode.
    assert f["moved"] == 1 and f["added_seconds_max"] == 0.5
    assert verdicts.kill_verdict(f, {"migrated": 1.0}) is None


@pytest.mark.parametrize(
    ("killed", "moved", "why"),
    [
        (
            [s(REF[0]["ids"]), s([7, 8], done=False, error='{"code": 502}')],
            {"migrated": 1.0},
            "1 of 2 streams completed",
        ),
        ([s(REF[0]["ids"]), s([7, 8, 9], done=False, hung=True)], {"migrated": 1.0}, "1 of 2 streams hung"),
        ([s(REF[0]["ids"]), s([7, 8, 9, 10, 11])], {"migrated": 1.0}, "1 of 2 streams completed"),  # one token short
        ([s(REF[0]["ids"]), s(REF[1]["ids"])], {"limit": 1.0}, "the router moved no stream"),
    ],
)
def test_each_way_the_kill_fails_is_named(killed: list[dict[str, Any]], moved: dict[str, float], why: str) -> None:
    verdict = verdicts.kill_verdict(verdicts.figures(REF, REF, killed, N), moved)
    assert verdict is not None and why in verdict


def test_leftovers_above_idle_fail_and_idle_levels_pass() -> None:
    idle = {"prefill": {"sglang:num_used_tokens": 0.0}, "router": {"sglang_pd_router_active_requests": 0.0}}
    assert verdicts.leftover_verdict(idle, idle) is None
    # A server whose /metrics held none of the gauges shows nothing: that is no pass.
    unread = {"prefill": {verdicts.ABSENT: ["sglang:num_used_tokens"]}}
    assert "no gauge read" in (verdicts.leftover_verdict(idle, unread) or "")
    left = {"prefill": {"sglang:num_used_tokens": 48.0}, "router": {"sglang_pd_router_active_requests": 0.0}}
    assert "prefill" in (verdicts.leftover_verdict(idle, left) or "")
    assert "unreachable" in (verdicts.leftover_verdict(idle, {"decode-1": {"unreachable": "ConnectError"}}) or "")


def test_the_control_must_break_a_stream_and_must_have_killed() -> None:
    assert verdicts.control_verdict([s([1]), s([2], error="upstream")], {"at_s": 0.4}) is None
    assert "no stream" in (verdicts.control_verdict([s([1]), s([2])], {"at_s": 0.4}) or "")
    assert "did not happen" in (verdicts.control_verdict([s([1])], {"not_killed": "ended"}) or "")


def test_the_kill_waits_for_every_stream_to_be_bound_to_its_decode() -> None:
    # Until its first token a stream may still be retried on the other decode: a kill then breaks
    # nothing even with migration off, and the control could not fail.
    assert not stage.kill_moment([5, 9, 0, 3, 7, 2, 4, 6], 48)
    assert stage.kill_moment([5, 9, 1, 3, 7, 2, 4, 6], 48)
    # A quarter must still be in the first half of their answer, so the kill lands mid-answer.
    assert not stage.kill_moment([30, 40, 48, 25, 26, 27, 23, 24], 48)
    assert stage.kill_moment([30, 40, 48, 25, 26, 27, 23, 22], 48)


def test_moved_streams_are_read_from_the_routers_log_lines() -> None:
    log = "\n".join(
        [
            'router | {"msg": "stream moved to another pair", "client_request_id": "mig-3", "to": "http://d1"}',
            '{"msg": "stream moved to another pair", "client_request_id": "mig-11"}',
            '{"msg": "request finished", "client_request_id": "mig-4"}',
            "router | stream moved to another pair {not json",
        ]
    )
    assert verdicts.moved_ids(log) == {"mig-3", "mig-11"}


def test_migrations_are_read_by_outcome_from_the_router_metrics() -> None:
    text = (
        "# TYPE sglang_pd_router_migrations_total counter\n"
        'sglang_pd_router_migrations_total{outcome="migrated"} 3.0\n'
        'sglang_pd_router_migrations_total{outcome="limit"} 1.0\n'
        "sglang_pd_router_migrations_created 1.7e9\n"
    )
    assert verdicts.migrations(text) == {"migrated": 3.0, "limit": 1.0}


def test_the_derived_topology_has_two_decodes_and_absolute_model_paths(tmp_path: Path) -> None:
    path = stage.one_prefill_two_decodes(PRESETS / "single-h200.yaml", tmp_path, mem_fraction=0.25)
    t = yaml.safe_load(path.read_text())
    assert t["decode"]["groups"] == 2 and t["name"] == "single-h200-1p2d"
    assert t["prefill"]["mem_fraction_static"] == t["decode"]["mem_fraction_static"] == 0.25
    assert Path(t["model"]["config_json"]).is_absolute() and Path(t["model"]["config_json"]).exists()
    ports = stage.Ports.of(path)
    assert ports.decodes == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    # `plan` accepts it: the ports are distinct and three servers fit the GPU's memory.
    import subprocess

    plan = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.cli", "plan", str(path), "--format", "json"],
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stderr


def _two_free_ports() -> int:
    """A port p with p + 1 free too (a colocated topology's decodes take consecutive ports)."""
    for _ in range(100):
        p = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two consecutive free ports")


@pytest.mark.slow
@pytest.mark.serial
def test_the_stage_runs_against_reference_engines(tmp_path: Path) -> None:
    path = stage.one_prefill_two_decodes(PRESETS / "local-cpu-mla.yaml", tmp_path)
    t = yaml.safe_load(path.read_text())
    prefill, bootstrap, router, control = free_ports(4)
    t["prefill"].update(port=prefill, bootstrap_port=bootstrap)
    t["decode"]["port"] = _two_free_ports()
    t["router"]["port"] = router
    path.write_text(yaml.safe_dump(t, sort_keys=False))
    key = "migration-stage-test-key"
    report = stage.run(
        tmp_path,
        path,
        stage.REFERENCE,
        up_args=("--no-kv-firewall", "--no-smoke"),
        env={ENV_WORKER_API_KEY: key},
        auth={"Authorization": f"Bearer {key}"},
        ready_s=180.0,
        streams=8,
        max_new=48,
        control_port=control,
    )
    assert report["verdicts"] == {"migration": None, "leftovers": None, "control": None}, report["verdicts"]
    f = report["figures"]
    # fp32 reference engines are deterministic: a moved stream is the uninterrupted one, token for token.
    assert f["identical_to_uninterrupted"] == f["streams"] == 8, f
    assert report["migrations"].get("migrated", 0) >= 1
    # The router's log named the moved streams, and only their latency is quoted.
    assert len(report["moved_streams"]) == f["moved"] >= 1 and f["added_seconds_p50"] is not None
    assert report["restart_s"] > 0  # the control waited for a new decode-0, not the router's stale view
    # The gauges were read for real: the idle reading names each engine's gauges.
    assert "sglang_pd_refengine_kv_pages_used" in report["idle"]["prefill"], report["idle"]
