"""Workers on link-local and cloud metadata addresses are refused from every source (the admin API,
flags, Kubernetes discovery) unless the router is started with --allow-link-local-workers: a worker
URL makes the router send requests there, probes with the worker API key included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.router import RouterConfig, WorkerRegistrationError, create_app
from sglang_pd.deploy.router.cli import main
from sglang_pd.deploy.router.config import KubernetesDiscoveryConfig
from sglang_pd.deploy.router.workers.discovery import KubernetesDiscovery
from sglang_pd.deploy.router.workers.registry import WorkerRegistry, refused_address

from ..conftest import Cluster
from ..test_bad_input import assert_openai_error

ADMIN_KEY = "sk-admin-addresses"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
METADATA = "http://169.254.169.254:80"

# (URL, the address its refusal names)
REFUSED = [
    (METADATA, "169.254.169.254"),
    ("http://[fd00:ec2::254]:80", "fd00:ec2::254"),
    ("http://metadata.google.internal:80", "metadata.google.internal"),
    ("http://169.254.10.1:30000", "169.254.10.1"),
    ("http://[fe80::1]:30000", "fe80::1"),
    # Other spellings of the metadata address that connect() reaches all the same.
    ("http://2852039166:80", "169.254.169.254"),
    ("http://0xa9.0xfe.0xa9.0xfe:80", "169.254.169.254"),
    ("http://[::ffff:169.254.169.254]:80", "169.254.169.254"),
]


@pytest.mark.parametrize(("url", "address"), REFUSED)
def test_post_workers_refuses_link_local_and_metadata_addresses(
    cluster_factory: Callable[..., Cluster], url: str, address: str
) -> None:
    cluster = cluster_factory(1, 1)
    with cluster.serve(cluster.config(admin_key=ADMIN_KEY)) as running:
        resp = httpx.post(running.url + "/workers", json={"url": url, "role": "decode"}, headers=ADMIN)
        assert_openai_error(resp, 400, param="url", code="invalid_value")
        message = resp.json()["error"]["message"]
        assert address in message and "--allow-link-local-workers" in message, message
        listed = httpx.get(running.url + "/workers", headers=ADMIN).json()
        assert [w["url"] for w in listed["decode"]] == [cluster.decodes[0].url], "nothing was registered"


def test_post_workers_accepts_them_with_the_flag(cluster_factory: Callable[..., Cluster]) -> None:
    # The in-process transport reaches only the test's own workers: the probe of the new worker
    # fails as unreachable and sends nothing to this machine's metadata service.
    cluster = cluster_factory(1, 1)
    hosts = ("169.254.0.0/16", "fd00:ec2::254", "metadata.google.internal", "fe80::/10")
    config = cluster.config(admin_key=ADMIN_KEY, allow_link_local_workers=True, worker_hosts=hosts)
    with cluster.serve(config) as running:
        for url, _ in REFUSED[:5]:
            resp = httpx.post(running.url + "/workers", json={"url": url, "role": "decode"}, headers=ADMIN)
            assert resp.status_code == 201, resp.text
            assert resp.json()["healthy"] is False
        listed = httpx.get(running.url + "/workers", headers=ADMIN).json()
        assert len(listed["decode"]) == 6


def test_ordinary_addresses_are_not_refused() -> None:
    for url in ("http://10.0.0.1:30000", "http://decode-0:30001", "http://[fd00::1]:1", "http://127.0.0.1:1"):
        assert refused_address(url) is None, url


def test_static_workers_follow_the_same_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(WorkerRegistrationError, match=r"169\.254\.169\.254"):
        create_app(RouterConfig(decode_workers=(METADATA,)))
    with pytest.raises(WorkerRegistrationError, match="fe80::1"):
        create_app(RouterConfig(prefill_workers=(("http://[fe80::1]:30000", None),)))
    app = create_app(RouterConfig(decode_workers=(METADATA,), allow_link_local_workers=True))
    assert [w.url for w in app.registry.decode] == [METADATA]
    # From the command line: refused before anything starts, naming the address and the flag.
    assert main(["--port", "0", "--decode", METADATA]) == 2
    err = capsys.readouterr().err
    assert "169.254.169.254" in err and "--allow-link-local-workers" in err


def _ready_pod(name: str, ip: str) -> dict[str, Any]:
    status = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": {"name": name}, "status": status}


@pytest.mark.parametrize("allowed", [False, True])
def test_discovery_skips_link_local_pods_unless_allowed(allowed: bool) -> None:
    registry = WorkerRegistry(allow_link_local=allowed)
    discovery = KubernetesDiscovery(registry, KubernetesDiscoveryConfig(port=30000))
    for name, ip in (("decode-0", "10.2.0.7"), ("decode-1", "169.254.3.4")):
        discovery.apply_event("decode", {"type": "ADDED", "raw_object": _ready_pod(name, ip)})
    expected = ["http://10.2.0.7:30000"] + (["http://169.254.3.4:30000"] if allowed else [])
    assert [w.url for w in registry.decode] == expected
