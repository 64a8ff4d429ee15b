"""`POST /workers` registers workers only at allowed hosts (`--worker-hosts`, and the hosts of the
workers given at start or discovered): the router sends the worker key in every probe, so an
admin must not be able to point it anywhere. Real HTTP throughout: routers on loopback, test
workers on 127.0.0.1, and a recording server on another loopback address (127.0.0.2, 127.0.0.3)
that counts every connection, so a refusal is shown to send nothing at all."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.router.cli import build_config, main
from sglang_pd.deploy.router.config import RouterConfig
from sglang_pd.deploy.router.group.process_group import ProcessGroup, _config_from_json
from sglang_pd.deploy.router.workers.hosts import WorkerHosts
from sglang_pd.deploy.router.workers.registry import WorkerRegistry
from tests.support.polling import free_port, wait_until
from tests.support.router_group import RouterGroup
from tests.support.router_worker_server import WorkerProcess

from ..conftest import FAST, Cluster, serve_router
from ..test_bad_input import assert_openai_error
from ..test_cli import _parse

ADMIN_KEY = "sk-admin-hosts"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
WORKER_KEY = "sk-worker-hosts-0123"


class Recorder:
    """An HTTP server on `host` that records each connection and the Authorization header of each
    request; it answers 404, so a worker here never becomes healthy."""

    def __init__(self, host: str) -> None:
        self.connections = 0
        self.authorizations: list[str | None] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                recorder.connections += 1
                super().setup()

            def do_GET(self) -> None:
                recorder.authorizations.append(self.headers.get("Authorization"))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorders() -> Iterator[dict[str, Recorder]]:
    made = {host: Recorder(host) for host in ("127.0.0.2", "127.0.0.3")}
    yield made
    for recorder in made.values():
        recorder.close()


@pytest.fixture
def workers(worker_processes: tuple[WorkerProcess, WorkerProcess]) -> Cluster:
    """The module's test worker processes, on 127.0.0.1: the hosts the router is started with."""
    prefill, decode = worker_processes
    return Cluster([prefill], [decode])


def _listed(router_url: str) -> list[str]:
    listed = httpx.get(router_url + "/workers", headers=ADMIN).json()
    return [w["url"] for w in listed["prefill"] + listed["decode"]]


def _assert_refused(resp: httpx.Response, host: str) -> None:
    assert_openai_error(resp, 400, param="url", code="invalid_value")
    message = resp.json()["error"]["message"]
    assert host in message and "worker API key" in message and f"--worker-hosts {host}" in message, message


@pytest.mark.parametrize("allowed", [(), ("127.0.0.1",)])
@pytest.mark.parametrize("spelling", ["127.0.0.2", "2130706434"])  # the same address as an integer
def test_a_host_outside_the_allowlist_is_refused_and_sent_nothing(
    workers: Cluster, recorders: dict[str, Recorder], allowed: tuple[str, ...], spelling: str
) -> None:
    recorder = recorders["127.0.0.2"]
    url = recorder.url.replace("127.0.0.2", spelling)
    config = workers.config(admin_key=ADMIN_KEY, worker_hosts=allowed)
    with workers.serve(config, worker_api_key=WORKER_KEY) as running:
        resp = httpx.post(running.url + "/workers", json={"url": url, "role": "decode"}, headers=ADMIN)
        _assert_refused(resp, "127.0.0.2")
        assert url not in _listed(running.url) and len(_listed(running.url)) == 2
        time.sleep(3 * config.health_interval_s)  # a registered worker would have been probed by now
    assert recorder.connections == 0 and recorder.authorizations == []


@pytest.mark.parametrize("allowed", ["127.0.0.2", "127.0.0.0/8"])
def test_an_allowed_host_is_registered_and_probed_with_the_worker_key(
    workers: Cluster, recorders: dict[str, Recorder], allowed: str
) -> None:
    # The control: the test above would see the key here, had the router sent it.
    recorder = recorders["127.0.0.2"]
    config = workers.config(admin_key=ADMIN_KEY, worker_hosts=(allowed,))
    with workers.serve(config, worker_api_key=WORKER_KEY) as running:
        resp = httpx.post(running.url + "/workers", json={"url": recorder.url, "role": "decode"}, headers=ADMIN)
        assert resp.status_code == 201, resp.text
        assert resp.json()["healthy"] is False  # it answers 404
        assert recorder.url in _listed(running.url)
    assert recorder.connections >= 1
    assert f"Bearer {WORKER_KEY}" in recorder.authorizations


def test_hosts_of_the_start_up_workers_are_allowed(workers: Cluster) -> None:
    config = workers.config(admin_key=ADMIN_KEY)
    decode = workers.decodes[0].url
    with workers.serve(config) as running:
        other_port = f"http://127.0.0.1:{free_port()}"
        added = httpx.post(running.url + "/workers", json={"url": other_port, "role": "decode"}, headers=ADMIN)
        assert added.status_code == 201, added.text
        # Removed, a worker given at start can be registered again.
        assert httpx.delete(running.url + "/workers", params={"url": decode}, headers=ADMIN).status_code == 200
        again = httpx.post(running.url + "/workers", json={"url": decode, "role": "decode"}, headers=ADMIN)
        assert again.status_code == 201, again.text
        # Names match as written: localhost is not 127.0.0.1 (no DNS lookup on the admin path).
        named = httpx.post(
            running.url + "/workers", json={"url": "http://localhost:1", "role": "decode"}, headers=ADMIN
        )
        _assert_refused(named, "localhost")


def test_a_router_started_with_no_workers_allows_only_its_worker_hosts(recorders: dict[str, Recorder]) -> None:
    with serve_router(dataclasses.replace(FAST, admin_key=ADMIN_KEY), worker_api_key=WORKER_KEY) as running:
        for recorder in recorders.values():
            resp = httpx.post(running.url + "/workers", json={"url": recorder.url, "role": "decode"}, headers=ADMIN)
            _assert_refused(resp, recorder.url.split("//")[1].split(":")[0])
        local = httpx.post(
            running.url + "/workers", json={"url": "http://127.0.0.1:1", "role": "decode"}, headers=ADMIN
        )
        _assert_refused(local, "127.0.0.1")  # loopback included
        assert _listed(running.url) == []
    assert all(r.connections == 0 for r in recorders.values())


def test_discovered_hosts_are_allowed_while_discovery_holds_them() -> None:
    hosts = WorkerHosts(["Decode-0.Engines", "10.1.0.0/16", "fd00::/64"], ["http://prefill-0:30000"])
    registry = WorkerRegistry()
    pod = registry.add("http://10.2.0.7:30000", "decode", source="kubernetes")
    assert hosts.refusal("http://10.2.0.7:30001", registry.all()) is None
    registry.remove(pod.url)
    assert hosts.refusal("http://10.2.0.7:30001", registry.all()) is not None
    # A host only the admin API registered does not widen the allowlist.
    registry.add("http://10.1.0.9:1", "decode", source="api")
    assert hosts.refusal("http://10.1.0.9:2", []) is None  # in 10.1.0.0/16
    assert hosts.refusal("http://10.3.0.9:2", registry.all()) is not None
    for url in ("http://decode-0.engines.:1", "http://[fd00::5]:1", "http://prefill-0:1"):
        assert hosts.refusal(url, []) is None, url
    assert "--worker-hosts decode-1.engines to allow it" in (hosts.refusal("http://decode-1.engines:1", []) or "")


@pytest.mark.parametrize(
    ("entry", "fix"),
    [("300.1.1.1/40", "10.0.0.0/16"), ("300.1.1.1", "10.0.0.7"), ("10.0.0.1/8", "10.0.0.0/8"), ("a b", "host name")],
)
def test_a_malformed_entry_is_refused_at_start(entry: str, fix: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="Config 'worker_hosts' has entry") as caught:
        RouterConfig(worker_hosts=(entry,))
    assert repr(entry) in str(caught.value) and fix in str(caught.value)
    assert main(["--port", "0", "--worker-hosts", entry]) == 2
    err = capsys.readouterr().err
    assert repr(entry) in err and "worker_hosts" in err, err


def test_the_flag_is_repeatable_and_takes_commas() -> None:
    config, _ = build_config(_parse("--worker-hosts", "a,10.0.0.0/8", "b", "--worker-hosts", "fd00::/64"), {})
    assert config.worker_hosts == ("a", "10.0.0.0/8", "b", "fd00::/64")
    assert build_config(_parse(), {})[0].worker_hosts == ()
    assert _config_from_json(json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_the_control_process_refuses_as_a_single_router_does() -> None:
    group = ProcessGroup(RouterConfig(decode_workers=("http://127.0.0.1:1",)), worker_api_key="", processes=2)
    status, body = asyncio.run(group._handle("add", {"url": "http://127.0.0.2:1", "role": "decode"}))
    assert status == 400 and "--worker-hosts 127.0.0.2" in body["message"] and body["param"] == "url"
    assert [w.url for w in group.registry.all()] == ["http://127.0.0.1:1"]


@pytest.mark.slow
def test_a_process_group_registers_only_allowed_hosts(recorders: dict[str, Recorder], tmp_path: Path) -> None:
    allowed, refused = recorders["127.0.0.2"], recorders["127.0.0.3"]
    flags = ["--admin-key", ADMIN_KEY, "--worker-api-key", WORKER_KEY, "--health-interval", "0.5"]
    flags += ["--decode", f"http://127.0.0.1:{free_port()}", "--worker-hosts", "127.0.0.2"]
    group = RouterGroup(tmp_path / "router.log", free_port(), *flags)
    try:
        wait_until(lambda: group.started() == 2, 30)
        resp = group.fresh("POST", "/workers", json={"url": refused.url, "role": "decode"}, headers=ADMIN)
        _assert_refused(resp, "127.0.0.3")
        resp = group.fresh("POST", "/workers", json={"url": allowed.url, "role": "decode"}, headers=ADMIN)
        assert resp.status_code == 201, resp.text
        decodes = group.fresh("GET", "/workers", headers=ADMIN).json()["decode"]
        assert refused.url not in [w["url"] for w in decodes] and allowed.url in [w["url"] for w in decodes]
        time.sleep(1.5)  # three probe rounds
    finally:
        group.stop(grace_s=10)
    assert f"Bearer {WORKER_KEY}" in allowed.authorizations
    assert refused.connections == 0
