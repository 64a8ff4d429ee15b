"""The router takes smg 1.13's flag spellings where they mean what ours mean, and `--prefill URL`
without a port means what it means in smg: no bootstrap port. The request then carries
`bootstrap_port: null` and each engine uses its own `--disaggregation-bootstrap-port` (sglang's
scheduler, `handle_generate_request`); real reference engines show it end to end, and a decode
whose own port is not the prefill's fails the handshake (the control)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sglang_pd.deploy.router.cli import SMG_SPELLINGS, add_arguments, build_config
from tests.support.polling import free_port

from .conftest import Launcher, Proc, launcher

# Each smg spelling with a value, and the same setting in our spelling.
SAME = [
    (["--request-timeout-secs", "31"], ["--request-timeout", "31"]),
    (["--queue-size", "7"], ["--max-queued-requests", "7"]),
    (["--queue-timeout-secs", "4"], ["--queue-timeout", "4"]),
    (["--max-payload-size", "65536"], ["--max-body-bytes", "65536"]),
    (["--header-read-timeout-secs", "9"], ["--header-timeout", "9"]),
    (["--idle-connection-timeout-secs", "11"], ["--keep-alive-timeout", "11"]),
    (["--shutdown-grace-period-secs", "12"], ["--drain-timeout", "12"]),
    (["--disable-retries"], ["--max-retries", "0"]),
    (["--health-check-interval-secs", "3"], ["--health-interval", "3"]),
    (["--health-check-timeout-secs", "2"], ["--health-timeout", "2"]),
    (["--cb-failure-threshold", "6"], ["--breaker-failure-threshold", "6"]),
    (["--cb-timeout-duration-secs", "13"], ["--breaker-cooldown", "13"]),
    (["--service-discovery"], ["--kubernetes"]),
    (["--service-discovery", "--service-discovery-namespace", "ns"], ["--kubernetes", "--k8s-namespace", "ns"]),
    (["--service-discovery", "--service-discovery-port", "31000"], ["--kubernetes", "--k8s-port", "31000"]),
    (["--service-discovery", "--prefill-selector", "app=p", "tier=x"],
     ["--kubernetes", "--k8s-prefill-selector", "app=p,tier=x"]),
    (["--service-discovery", "--decode-selector", "app=d"], ["--kubernetes", "--k8s-decode-selector", "app=d"]),
    (["--log-level", "warn"], ["--log-level", "warning"]),
    (["--pd-disaggregation"], []),
]  # fmt: skip


def _config(argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(argv), environ={})[0]


def test_every_listed_smg_spelling_means_ours() -> None:
    listed = {flag.split()[0] for flag in SMG_SPELLINGS}
    assert listed == {arg for smg, _ in SAME for arg in smg if arg.startswith("--")}
    default = _config([])
    for smg, ours in SAME:
        assert _config(smg) == _config(ours), smg
        if ours:  # each pair changes something: equal to the defaults would prove nothing
            assert _config(ours) != default, ours


def test_spellings_whose_meaning_differs_are_refused() -> None:
    # smg's --retry-max-retries counts attempts, ours retries: not taken, so not silently off by one.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--retry-max-retries", "3"])
    with pytest.raises(ValueError, match="--disable-retries and --max-retries 2 disagree"):
        _config(["--disable-retries", "--max-retries", "2"])


def test_help_says_what_a_prefill_without_port_means() -> None:
    done = subprocess.run([sys.executable, "-m", "sglang_pd.deploy.router.cli", "--help"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "Without a port (or 'none'), as in smg, the worker has no bootstrap port" in text
    for smg in SMG_SPELLINGS:
        assert smg in text, smg


def _router(lx: Launcher, prefill: Proc, decode: Proc) -> Proc:
    """A router given the prefill as smg would be: `--prefill URL`, no port."""
    port = free_port()
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "router", "--host", "127.0.0.1", "--port", str(port),
            "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url, "--disable-retries",
            "--log-level", "warn"]  # fmt: skip
    name = f"router-{port}"
    log = lx.tmp / f"{name}.log"
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    router = Proc(name, proc, f"http://127.0.0.1:{port}", log)
    lx.procs.append(router)
    return router


def test_prefill_without_port_reaches_the_engines_own_bootstrap_port(tmp_path: Path) -> None:
    with launcher(tmp_path) as lx:
        kv = {"MC_MIN_RPC_PORT": "17100", "MC_MAX_RPC_PORT": "17600"}  # clear of another stack's KV fence
        prefill = lx.engine("prefill", env=kv)
        assert prefill.bootstrap_port is not None
        # The decode's own --bootstrap-port is the prefill's (as sglang's servers share the default 8998).
        decode = lx.engine("decode", env=kv, args=["--bootstrap-port", str(prefill.bootstrap_port)])
        elsewhere = free_port()
        wrong = lx.engine("decode", env=kv, args=["--bootstrap-port", str(elsewhere)])
        router, control = _router(lx, prefill, decode), _router(lx, prefill, wrong)
        lx.wait()
        workers = httpx.get(router.url + "/workers", timeout=5).json()
        assert [w["bootstrap_port"] for w in workers["prefill"]] == [None]
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        answer = httpx.post(router.url + "/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["output_ids"]) == 4
        # The control: the same router flags, but the decode's own port is not the prefill's.
        failed = httpx.post(control.url + "/generate", json=body, timeout=60)
        assert failed.status_code == 502, failed.text
        assert f"The prefill bootstrap server 127.0.0.1:{elsewhere} did not answer" in control.log.read_text()
