"""`sglang-pd router --processes N`: real router processes in front of protocol-faithful test
workers (real processes too). Every serving process serves on the one port; worker health, admin
changes and metrics are the group's, whichever process a connection lands on; the control
process's probes keep workers timed as sglang's healthy; a dead serving process is replaced;
SIGTERM leaves nothing behind."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_pd.deploy.router.config import KubernetesDiscoveryConfig, RouterConfig
from sglang_pd.deploy.router.exceptions import WorkerRegistrationError
from sglang_pd.deploy.router.group.process_group import ProcessGroup, _config_from_json, split_limits
from tests.support.polling import free_port, wait_until
from tests.support.router_group import RouterGroup, gone
from tests.support.router_worker_server import WorkerProcess, start_workers

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

CHAT = "/v1/chat/completions"
ADMIN = {"authorization": "Bearer admin-key"}
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class Group(RouterGroup):
    """A started group with the workers behind it."""

    prefill: WorkerProcess
    decode: WorkerProcess


# Faster probes than the defaults (a frozen worker out within 3 x 0.5 + 1 = 2.5 s, not 11 s).
FAST_PROBES = ("--health-interval", "0.5", "--health-timeout", "1")


def _serves_a_pair(group: RouterGroup) -> bool:
    ready = group.fresh("GET", "/readiness")
    return ready.status_code == 200 and ready.json()["prefill"] == ready.json()["decode"] == 1


@pytest.fixture
def group(worker_processes: tuple[WorkerProcess, WorkerProcess], tmp_path: Path) -> Iterator[Group]:
    prefill, decode = worker_processes
    running = Group(tmp_path / "router.log", free_port(), "--admin-key", "admin-key", *FAST_PROBES,
                    "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url)  # fmt: skip
    running.prefill, running.decode = prefill, decode
    try:
        # Ready means every serving process is up and serves.
        wait_until(lambda: running.started() == 2, 30)
        wait_until(lambda: _serves_a_pair(running), 10)
        yield running
    finally:
        running.stop(grace_s=10)


def test_every_serving_process_serves_the_one_port(group: Group) -> None:
    statuses = [group.fresh("POST", CHAT, json=BODY).status_code for _ in range(40)]
    assert statuses == [200] * 40
    served_by = {x.get("router_process") for x in group.lines() if x["msg"] == "request finished"}
    assert served_by == {0, 1}  # 40 connections, hashed over two sockets: both took some
    assert len(group.serving_pids()) == 2


def test_metrics_of_any_process_count_the_whole_group(group: Group) -> None:
    for _ in range(30):
        assert group.fresh("POST", CHAT, json=BODY).status_code == 200
    for _ in range(6):  # whichever process answers the scrape
        text = group.fresh("GET", "/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("sglang_pd_router_requests_total{"))
        assert line.endswith(" 30.0"), line
        assert 'sglang_pd_router_worker_healthy{role="decode",worker="' + group.decode.url + '"} 1.0' in text


def test_admin_changes_reach_every_process(group: Group) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    added = group.fresh("POST", "/workers", json={"url": dead, "role": "decode"}, headers=ADMIN)
    assert added.status_code == 201, added.text
    assert added.json()["url"] == dead and added.json()["healthy"] is False  # checked before the answer
    for _ in range(8):
        decodes = group.fresh("GET", "/workers", headers=ADMIN).json()["decode"]
        assert dead in [w["url"] for w in decodes]
    refused = group.fresh("POST", "/workers", json={"url": "http://bad host:1", "role": "decode"}, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
    # The control process refuses the cloud metadata address as a single router does.
    metadata = {"url": "http://169.254.169.254:80", "role": "decode"}
    refused = group.fresh("POST", "/workers", json=metadata, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "url"
    assert "169.254.169.254" in refused.json()["error"]["message"]
    removed = group.fresh("DELETE", f"/workers?url={dead}", headers=ADMIN)
    assert removed.status_code == 200 and removed.json()["removed"][0]["url"] == dead
    for _ in range(8):
        decodes = group.fresh("GET", "/workers", headers=ADMIN).json()["decode"]
        assert [w["url"] for w in decodes] == [group.decode.url]
    again = group.fresh("DELETE", f"/workers?url={dead}", headers=ADMIN)
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


@pytest.mark.serial  # a latency bound: three test processes on two cores stretch the probe rounds
def test_a_frozen_worker_is_out_of_every_process_and_back(group: Group) -> None:
    def everyone(decodes: int) -> bool:
        return all(group.fresh("GET", "/readiness").json()["decode"] == decodes for _ in range(6))

    os.kill(group.decode.child.pid, signal.SIGSTOP)
    try:
        took = wait_until(lambda: everyone(0), 8)
    finally:
        os.kill(group.decode.child.pid, signal.SIGCONT)
    assert took < 3.5  # three failed liveness probes: 3 x 0.5 s + timeout 1 s, then one publish
    back = wait_until(lambda: everyone(1), 5)
    assert back < 2.0  # the generation probe in flight, or the next one, passes
    assert group.fresh("POST", CHAT, json=BODY).status_code == 200


def test_workers_timed_as_sglang_are_admitted_and_kept_with_the_defaults(tmp_path: Path) -> None:
    # The control process probes, with the default settings, workers whose /health takes
    # sglang's 1 s tick; every serving process sees them healthy through a stretch of traffic.
    prefills, decodes = start_workers(1, 1, no_log=True, token_delay=0.01)
    group = RouterGroup(tmp_path / "router.log", free_port(), "--prefill", prefills[0].url,
                        str(prefills[0].bootstrap_port), "--decode", decodes[0].url)  # fmt: skip
    try:
        wait_until(lambda: group.started() == 2, 30)
        wait_until(lambda: _serves_a_pair(group), 10)
        end = time.monotonic() + 4.5  # two liveness rounds
        while time.monotonic() < end:
            assert group.fresh("POST", CHAT, json={**BODY, "stream": True}).status_code == 200
            assert _serves_a_pair(group)
        assert not [x for x in group.lines() if x.get("msg") in ("worker became unhealthy", "worker ejected")]
    finally:
        group.stop()
        for worker in prefills + decodes:
            worker.stop()


def test_a_dead_serving_process_is_replaced(group: Group) -> None:
    first = group.serving_pids()
    os.kill(first[0], signal.SIGKILL)
    # Meanwhile new connections go to the process that is left: nothing fails.
    statuses = [group.fresh("POST", CHAT, json=BODY).status_code for _ in range(20)]
    assert statuses == [200] * 20
    wait_until(lambda: len(group.serving_pids()) == 2 and first[0] not in group.serving_pids(), 10)
    wait_until(lambda: sum(1 for x in group.lines() if x["msg"] == "router started") == 3, 15)
    assert any(x["msg"] == "serving process is down; restarting it" for x in group.lines())
    statuses = [group.fresh("POST", CHAT, json=BODY).status_code for _ in range(20)]
    assert statuses == [200] * 20


def test_sigterm_drains_every_process_and_leaves_nothing(group: Group) -> None:
    pids = group.serving_pids()
    environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0") if v)
    workdir = Path(environ[b"PROMETHEUS_MULTIPROC_DIR"].decode())
    assert any(workdir.iterdir())
    group.child.proc.send_signal(signal.SIGTERM)
    assert group.child.proc.wait(timeout=20) == 0
    for pid in pids:
        assert gone(pid)
    assert not workdir.exists()  # the metrics files
    assert any(x["msg"] == "draining" and x.get("router_process") == 1 for x in group.lines())


def test_a_port_in_use_is_refused_naming_its_owner(worker_processes: tuple[WorkerProcess, WorkerProcess]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        prefill, decode = worker_processes
        done = subprocess.run(
            [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--host", "127.0.0.1", "--port", str(port),
             "--processes", "2", "--prefill", prefill.url, "--decode", decode.url],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    assert done.returncode == 2
    assert f"127.0.0.1:{port} is in use by pid {os.getpid()}" in done.stderr


def test_processes_must_be_positive() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--processes", "0"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2 and "--processes 0: it must be 1 or more" in done.stderr


def test_a_bad_worker_key_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sglang_pd.deploy.router.cli", "--processes", "2", "--worker-api-key", "a b"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 2 and "worker API key" in done.stderr


# -- pieces, without processes ------------------------------------------------------------------


def test_the_config_travels_to_serving_processes_whole() -> None:
    config = RouterConfig(
        port=9000,
        api_keys=("k1", "k2"),
        admin_key="adm",
        max_concurrent_requests=7,
        prefill_workers=(("http://p:1", 8998), ("http://q:1", None)),
        decode_workers=("http://d:1",),
        kubernetes=KubernetesDiscoveryConfig(namespace="ns", port=31000),
        allow_link_local_workers=True,
    )
    assert _config_from_json(json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_the_control_process_refuses_link_local_workers_unless_allowed() -> None:
    with pytest.raises(WorkerRegistrationError, match=r"169\.254\.169\.254"):
        ProcessGroup(RouterConfig(decode_workers=("http://169.254.169.254:80",)), worker_api_key="", processes=2)
    config = RouterConfig(decode_workers=("http://169.254.169.254:80",), allow_link_local_workers=True)
    group = ProcessGroup(config, worker_api_key="", processes=2)
    assert [w.url for w in group.registry.decode] == ["http://169.254.169.254:80"]


def test_admission_limits_are_split_between_processes() -> None:
    config = RouterConfig(max_concurrent_requests=5, max_queued_requests=3)
    shares = [split_limits(config, 3, i) for i in range(3)]
    assert [(c.max_concurrent_requests, c.max_queued_requests) for c in shares] == [(2, 1), (2, 1), (1, 1)]
    unlimited = split_limits(RouterConfig(max_concurrent_requests=0, max_queued_requests=0), 4, 3)
    assert (unlimited.max_concurrent_requests, unlimited.max_queued_requests) == (0, 0)
    with pytest.raises(ValueError, match="--max-concurrent-requests 3 is below --processes 4"):
        ProcessGroup(RouterConfig(max_concurrent_requests=3), worker_api_key="", processes=4)


def test_reports_from_serving_processes_move_health() -> None:
    config = RouterConfig(decode_workers=("http://127.0.0.1:1",), health_failure_threshold=1)
    group = ProcessGroup(config, worker_api_key="", processes=2)
    worker = group.registry.decode[0]
    worker.healthy = worker.checked = True
    group._on_report("stalled", worker.url, "decode", "no bytes on its 1 open stream(s) for 5 s")
    assert not worker.healthy and "no bytes" in worker.last_error
    worker.healthy = True
    group._on_report("probe_failed", worker.url, "decode", "GET /v1/models timed out")
    assert not worker.healthy and worker.last_error == "GET /v1/models timed out"
    group._on_report("stalled", "http://127.0.0.1:2", "decode", "unknown worker: ignored")
