"""A rollout end to end with real processes under closed-loop client load: reference engines (SmolLM2-135M,
1 prefill + 1 decode a revision), our router, and the gate (`sglang-pd eval gsm8k --revision --approve`).

1. Revision a serves. Revision b comes up beside it; the gate scores b alone (pinned), passes and approves it;
   a drains and is removed. No client request fails, the router counts no cross-revision pair, no client
   request reached b before its approval, and the report the gate wrote is b's.
   The gate publishes b's report as the next baseline (to a loopback stand-in of the Kubernetes API).
2. Revision c, whose prefill overwrites its KV with noise (--fault-kv-noise), comes up beside b; the gate fails
   it and holds it: c gets no client request (the router's metric), its report is not published, and b keeps
   serving without a failure.

The questions are gsm8k-shaped and easy enough for the 135M model to answer right at greedy decoding (one
gsm8k shot), so that a revision that garbles its KV is seen by the accuracy floor; what is under test is the
rollout, not the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sglang_pd.deploy.cli import main
from sglang_pd.deploy.evals import PACKAGED_GSM8K
from sglang_pd.deploy.evals import cli as eval_cli_module
from tests.support.polling import free_port

from .test_publish import _KubeApi

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # three revisions under client load: needs both cores

CLI = [sys.executable, "-m", "sglang_pd.deploy.cli"]
ADMIN_KEY = "sk-admin-rollout-e2e"
CLIENT_KEY = "sk-client-rollout-e2e"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CLIENT = {"Authorization": f"Bearer {CLIENT_KEY}"}
EASY = [
    ("Sam has 3 apples. He buys 2 more apples. How many apples does Sam have now?", 5),
    ("Anna has 10 pencils. She gives 4 pencils to Ben. How many pencils does Anna have left?", 6),
    ("Tom reads 5 pages every day. How many pages does he read in 3 days?", 15),
    ("A pen costs 2 dollars. How much do 4 pens cost?", 8),
]
STARTUP_S = 240.0


def _questions(path: Path) -> Path:
    """The first line of the packaged gsm8k test set (the one shot), then the easy questions."""
    shot = PACKAGED_GSM8K.read_text().splitlines()[0]
    lines = [shot] + [json.dumps({"question": q, "answer": f"The answer is {a}.\n#### {a}"}) for q, a in EASY]
    path.write_text("\n".join(lines) + "\n")
    return path


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> None:
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def engine(self, name: str, role: str, *extra: str) -> tuple[str, int | None]:
        port = free_port()
        argv = [*CLI, "engine", "--role", role, "--port", str(port), "--threads", "1", "--log-level", "warning"]
        bootstrap = None
        if role == "prefill":
            bootstrap = free_port()
            argv += ["--bootstrap-port", str(bootstrap)]
        self.start(name, [*argv, *extra])
        return f"http://127.0.0.1:{port}", bootstrap

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: start_new_session
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)


def _wait_healthy(procs: Procs, names_urls: dict[str, str]) -> None:
    deadline = time.monotonic() + STARTUP_S
    pending = dict(names_urls)
    while pending:
        for name, url in list(pending.items()):
            if procs.procs[name].poll() is not None:
                pytest.fail(f"{name} exited:\n{procs.log(name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=30).status_code == 200:
                    del pending[name]
        if time.monotonic() > deadline:
            pytest.fail(f"not healthy after {STARTUP_S:g} s: {sorted(pending)}")
        time.sleep(1.0)


class Load:
    """Closed-loop clients with the client key: each sends its next request when the last one is answered."""

    def __init__(self, url: str, model: str, clients: int = 2) -> None:
        self.url, self.model = url, model
        self.statuses: list[int] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url + "/v1/completions", json=body, headers=CLIENT)
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text[:300]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                time.sleep(0.2)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" ([0-9.e+]+)"
    match = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _traffic(url: str, revision: str, route: str) -> float:
    return _metric(url, "sglang_pd_router_revision_traffic_total", f'revision="{revision}",route="{route}"')


def _revisions(url: str) -> dict[str, Any]:
    listed = httpx.get(url + "/admin/revisions", headers=ADMIN, timeout=10).json()
    return {"approved": listed["approved"], **{r["revision"]: r for r in listed["revisions"]}}


def _register(url: str, revision: str, prefill: tuple[str, int | None], decode: str) -> None:
    for body in (
        {"url": prefill[0], "role": "prefill", "bootstrap_port": prefill[1], "revision": revision},
        {"url": decode, "role": "decode", "revision": revision},
    ):
        r = httpx.post(url + "/workers", json=body, headers=ADMIN, timeout=60)
        assert r.status_code == 201, r.text


class Watch:
    """Samples, while a gate runs, the client requests the router sent to `revision` while it was not approved."""

    def __init__(self, url: str, revision: str) -> None:
        self.url, self.revision = url, revision
        self.before_approval: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(httpx.HTTPError):
                first = _revisions(self.url)["approved"]
                count = _traffic(self.url, self.revision, "client") + _traffic(self.url, self.revision, "canary")
                if first != self.revision and _revisions(self.url)["approved"] != self.revision:
                    self.before_approval.append(count)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@dataclass
class GateRun:
    returncode: int
    stdout: str
    stderr: str


def _gate(url: str, data: Path, revision: str, report: Path) -> GateRun:
    """`sglang-pd eval gsm8k` in this process (so that its Kubernetes API is the loopback stand-in), publishing a
    clean pass to the ConfigMap `baseline`."""
    argv = ["eval", "gsm8k", "--base-url", url + "/v1", "--api-key", ADMIN_KEY, "--revision", revision, "--approve"]
    argv += ["--data", str(data), "--num-shots", "1", "--max-tokens", "32", "--parallel", "2"]
    argv += ["--min-accuracy", "0.5", "--max-truncation-rate", "1", "--wait-ready", "120", "--timeout", "400"]
    argv += ["--quiet", "--output", str(report), "--publish-baseline", "baseline"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return GateRun(code, out.getvalue(), err.getvalue())


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    running = Procs(tmp_path)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch) -> Iterator[_KubeApi]:
    """The Kubernetes API the gate publishes its baseline to: a loopback stand-in recording each PATCH."""
    api = _KubeApi(200)
    api.thread.start()
    monkeypatch.setattr(eval_cli_module, "in_cluster", lambda: api.cluster)
    yield api
    api.server.shutdown()
    api.server.server_close()
    api.thread.join(timeout=10)


def test_rollout_approves_a_good_revision_and_holds_a_bad_one(procs: Procs, kube: _KubeApi, tmp_path: Path) -> None:
    data = _questions(tmp_path / "easy.jsonl")
    pa, da = procs.engine("prefill-a", "prefill"), procs.engine("decode-a", "decode")[0]
    router_port = free_port()
    url = f"http://127.0.0.1:{router_port}"
    procs.start(
        "router",
        [*CLI, "router", "--host", "127.0.0.1", "--port", str(router_port), "--prefill", f"{pa[0]}@rev-a",
         str(pa[1]), "--decode", f"{da}@rev-a", "--admin-key", ADMIN_KEY, "--api-key", CLIENT_KEY,
         "--log-level", "warning"],
    )  # fmt: skip
    _wait_healthy(procs, {"prefill-a": pa[0], "decode-a": da})
    deadline = time.monotonic() + 60
    while not _revisions(url).get("rev-a", {}).get("paired"):
        assert time.monotonic() < deadline, procs.log("router")
        time.sleep(0.5)
    model = httpx.get(url + "/v1/models", headers=CLIENT).json()["data"][0]["id"]

    with Load(url, model) as load:
        time.sleep(3)
        # 1. b comes up beside a, is scored alone and approved; a drains and is removed.
        pb, db = procs.engine("prefill-b", "prefill"), procs.engine("decode-b", "decode")[0]
        _wait_healthy(procs, {"prefill-b": pb[0], "decode-b": db})
        _register(url, "rev-b", pb, db)
        assert _revisions(url)["approved"] == "rev-a"
        with Watch(url, "rev-b") as watch_b:
            gate_b = _gate(url, data, "rev-b", tmp_path / "report-b.json")
        assert gate_b.returncode == 0, gate_b.stdout + gate_b.stderr
        assert "approved revision rev-b" in gate_b.stderr
        assert watch_b.before_approval and max(watch_b.before_approval) == 0, watch_b.before_approval
        report_b = json.loads((tmp_path / "report-b.json").read_text())
        assert report_b["status"] == "pass" and report_b["config"]["revision"] == "rev-b"
        assert _traffic(url, "rev-b", "pinned") == len(EASY)
        assert len(kube.requests) == 1  # the next baseline: b's report
        assert json.loads(kube.stored())["config"]["revision"] == "rev-b" and "stored this report" in gate_b.stderr
        deadline = time.monotonic() + 120
        while _revisions(url)["rev-a"]["state"] != "drained":
            assert time.monotonic() < deadline, _revisions(url)
            time.sleep(0.2)
        for worker, role in ((pa[0], "prefill"), (da, "decode")):
            r = httpx.delete(url + "/workers", params={"url": worker, "role": role}, headers=ADMIN, timeout=10)
            assert r.status_code == 200, r.text
        procs.stop("prefill-a")
        procs.stop("decode-a")
        served_a = _traffic(url, "rev-a", "client")
        time.sleep(3)
        assert _traffic(url, "rev-b", "client") > 0

        # 2. c, whose prefill garbles its KV, comes up beside b: the gate fails it and holds it.
        pc = procs.engine("prefill-c", "prefill", "--fault-kv-noise")
        dc = procs.engine("decode-c", "decode")[0]
        _wait_healthy(procs, {"prefill-c": pc[0], "decode-c": dc})
        _register(url, "rev-c", pc, dc)
        gate_c = _gate(url, data, "rev-c", tmp_path / "report-c.json")
        time.sleep(3)  # client requests go on after the verdict: still none to c
    assert gate_c.returncode == 1, gate_c.stdout + gate_c.stderr
    assert "gate failed (min_accuracy)" in gate_c.stderr and "held: revision rev-c is not approved" in gate_c.stderr
    report_c = json.loads((tmp_path / "report-c.json").read_text())
    assert report_c["config"]["revision"] == "rev-c"
    assert report_c["metrics"]["accuracy"] < report_b["metrics"]["accuracy"]
    assert _traffic(url, "rev-c", "pinned") == len(EASY)
    assert len(kube.requests) == 1  # c's report was not published: the baseline is still b's
    assert _traffic(url, "rev-c", "client") == 0 and _traffic(url, "rev-c", "canary") == 0
    assert _revisions(url)["approved"] == "rev-b"

    assert load.failures == [], load.failures[:5]
    assert len(load.statuses) > 20 and served_a > 0
    assert _metric(url, "sglang_pd_router_cross_revision_pairs_total") == 0
    print(
        f"client requests {len(load.statuses)} (0 failed); rev-a client {served_a:g}, rev-b client "
        f"{_traffic(url, 'rev-b', 'client'):g}; accuracy b {report_b['metrics']['accuracy']}, "
        f"c {report_c['metrics']['accuracy']}"
    )
