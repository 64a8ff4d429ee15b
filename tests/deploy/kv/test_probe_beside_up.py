"""`up`'s own fence does not break our own probe: beside a running, fenced `sglang-pd up`, `kv-probe` on
loopback run as root joins the engines' group and passes, and run as another user it is refused naming
`up`'s fence (not "a firewall"). Real processes in a network namespace of their own (tests.support.netns)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_pd.deploy.kv.firewall import KV_ENGINE_GID
from tests.support.netns import netns_unavailable, run_in_netns

pytestmark = pytest.mark.slow

UNAVAILABLE = netns_unavailable()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespace scenarios: {UNAVAILABLE}")
def test_kv_probe_passes_up_s_fence_as_root_and_names_it_otherwise(tmp_path: Path) -> None:
    r = run_in_netns("tests.support.kv_probe_fence_scenarios:probe_beside_up", str(tmp_path / "logs"), timeout_s=420)
    out = "\n".join(r["output"])
    # The fence is in force while the probes run: up's chains are installed, its engines hold the group,
    # and a root socket outside that group is refused at the decode engine's KV port.
    assert any("SGLPD-UP-" in ln for ln in r["running"]["iptables-save"]), (r["running"], out)
    assert {int(p) for p in r["fenced_engines"]} == set(r["engine_pids"]) and len(r["engine_pids"]) == 2, r
    assert set(r["fenced_engines"].values()) == {r["up_pid"]}, r
    assert r["outsider"] == "refused", r["outsider"]

    root = r["as_root"]
    assert root["exit_status"] == 0 and root["report"]["ok"], root
    assert {c["check"] for c in root["report"]["checks"]} >= {"probe", "integrity"}
    note = f"note: `sglang-pd up` (pid {r['up_pid']}) fences the KV ports (TCP 15000-17000) on this machine"
    assert note in root["stderr"] and f"runs in its engines' group (gid {KV_ENGINE_GID})" in root["stderr"], root

    user = r["as_user"]
    assert user["exit_status"] == 1 and not user["report"]["ok"], user
    error, diagnosis = user["report"]["error"], user["report"]["diagnosis"]
    assert error.startswith(f"`sglang-pd up` (pid {r['up_pid']}) fences the KV ports (TCP 15000-17000)"), error
    assert f"unless they come from its engines' group (gid {KV_ENGINE_GID}), and this probe runs as uid 65534" in error
    assert "run the probe as root" in diagnosis and "or stop `up` first" in diagnosis
    assert "no firewall blocks" not in diagnosis

    assert r["up_exit_status"] == 0 and r["fenced_after_stop"] == {}, r
