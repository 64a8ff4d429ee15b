"""The KV ports' netfilter rules (deploy/kv/firewall.py), with real sockets, real Mooncake engines,
a real `sglang-pd up` and `sglang-pd launch`.

Every test that writes rules runs its scenario (tests/support/kv_firewall_scenarios.py) in a fresh
network namespace, so this machine's own rules are never touched; they are skipped, with the
reason, where that is impossible (not root, no iptables or unshare). The refusals without
iptables run here directly: with no iptables on PATH nothing can be written. Run with `-s` to see
the measured figures (bytes an attacker recovers, time to its failure).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sglang_pd.deploy.common.contract import ENV_WORKER_API_KEY
from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.kv import firewall
from sglang_pd.deploy.kv.firewall import (
    KV_ENGINE_GID,
    FirewallError,
    LocalFirewall,
    PeerFirewall,
    gid_holders,
    parse_networks,
    pod_chain,
    resolve_host,
)
from sglang_pd.deploy.ops.launch import LaunchError
from sglang_pd.deploy.ops.up import ChildSpec, fence_kv_ports
from sglang_pd.deploy.spec.topology import TopologyError
from tests.deploy.ops.test_up import _topology as local_topology
from tests.support.netns import REPO, netns_unavailable, run_in_netns

pytestmark = pytest.mark.slow  # over 8 s in all on 2 cores: `make quick` leaves it out

SCENARIOS = "tests.support.kv_firewall_scenarios"
UNAVAILABLE = netns_unavailable()
in_netns = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"network namespace scenarios: {UNAVAILABLE}")


def _figure(what: str, r: dict[str, Any]) -> None:
    print(
        f"\n{what}: gid {r['gid']}, handshake {'ok' if r['handshake'] else 'refused'}, "
        f"{r['bytes_recovered']} of {r['bytes_requested']} bytes recovered, secret found: {r['secret_found']}, "
        f"{r['seconds'] * 1e3:.1f} ms from the first connection to the answer"
    )


def _attacker_got_nothing(r: dict[str, Any]) -> None:
    assert r["handshake"] is False and r["read_rc"] is None, r
    assert r["bytes_recovered"] == 0 and r["secret_found"] is False and r["exit_status"] == 1, r


def _reader_got_everything(r: dict[str, Any]) -> None:
    assert r["handshake"] is True and r["read_rc"] == 0 and r["bytes_recovered"] == r["bytes_requested"], r


# --- the pod form: sources from other hosts, by address -------------------------------------------


@in_netns
def test_pod_rules_admit_the_peers_addresses_and_a_refresh_replaces_them() -> None:
    r = run_in_netns(f"{SCENARIOS}:pod_form")
    everyone = {"10.77.0.2": "ok", "10.77.0.3": "ok", "fd77::2": "ok", "fd77::3": "ok", "loopback": "ok"}
    assert r["open_before"] == everyone  # without rules any host connects
    # The peer's name resolves to .2 / fd77::2: those connect, their neighbours' SYNs are dropped.
    assert r["first"] == {**everyone, "10.77.0.3": "timeout", "fd77::3": "timeout"}
    assert r["first_outside_range"] == everyone  # a port outside the range is not touched
    # The name now resolves to .3 / fd77::3; the refresh thread replaced the chain's rules.
    assert r["second"] == {**everyone, "10.77.0.2": "timeout", "fd77::2": "timeout"}
    chain = r["chain"]
    assert f"-A {chain} -s 10.77.0.3/32 -j ACCEPT" in r["rules_second"]["iptables-save"]
    assert f"-A {chain} -s fd77::3/128 -j ACCEPT" in r["rules_second"]["ip6tables-save"]
    assert not any("10.77.0.2" in ln for ln in r["rules_second"]["iptables-save"])
    assert r["after_remove"] == everyone
    assert r["rules_after_remove"] == {"iptables-save": [], "ip6tables-save": []}
    assert len(r["notes"]) == 2 and "accepts loopback and 10.77.0.3/32, fd77::3/128" in r["notes"][1]


@in_netns
def test_two_releases_on_one_nodes_network_keep_their_own_chains() -> None:
    r = run_in_netns(f"{SCENARIOS}:two_releases")
    chains = r["chains"]
    # Release and pod in the name, within iptables' 28 characters; a release's two pods share the release part.
    assert len(set(chains.values())) == 4 and all(len(c) <= 28 for c in chains.values()), chains
    assert chains["a"].split("-")[2] == chains["a_decode"].split("-")[2] != chains["b"].split("-")[2]
    # Both fences in force at once: each release's peer reaches its own range only.
    assert r["both"] == {
        "10.77.0.2->a": "ok",
        "10.77.0.2->b": "timeout",
        "10.77.0.3->a": "timeout",
        "10.77.0.3->b": "ok",
    }
    for family in ("iptables-save", "ip6tables-save"):
        jumps = [ln for ln in r["rules_both"][family] if ln.startswith("-A INPUT ")]
        assert sorted(ln.split()[-1] for ln in jumps) == sorted([chains["a"], chains["b"]]), jumps
        three = [ln.split()[-1] for ln in r["rules_three"][family] if ln.startswith("-A INPUT ")]
        assert sorted(three) == sorted([chains["a"], chains["a_decode"], chains["b"]])
        assert r["rules_after_refusal"][family] == r["rules_three"][family]  # the refusal wrote nothing
        # b's removal took b's chain and jump only.
        left = r["rules_after_b_removed"][family]
        assert not any(chains["b"] in ln for ln in left)
        kept = sorted(ln.split()[-1] for ln in left if ln.startswith("-A INPUT "))
        assert kept == sorted([chains["a"], chains["a_decode"]])
        assert r["final"][family] == []
    assert "another release's KV rules cover an overlapping port range" in r["refused"]
    assert f"{chains['a']} (TCP 15000-15999)" in r["refused"] and "own Mooncake port range" in r["refused"]
    assert r["after_b_removed"]["10.77.0.3->a"] == "timeout"  # a's fence still drops b's peer


@in_netns
def test_pod_rules_let_a_peer_read_a_real_engine_and_no_one_else() -> None:
    r = run_in_netns(f"{SCENARIOS}:pod_form_mooncake")
    _figure("pod form, reader at a peer's address", r["allowed"])
    _figure("pod form, reader at an address no peer has", r["not_a_peer"])
    _reader_got_everything(r["allowed"])
    assert r["allowed"]["secret_found"] is True
    _attacker_got_nothing(r["not_a_peer"])  # the SYNs are dropped: Mooncake's handshake times out


# --- the local form: loopback, by the socket's group ---------------------------------------------


@in_netns
def test_local_rules_let_the_engines_group_read_and_an_attacker_recover_nothing() -> None:
    r = run_in_netns(f"{SCENARIOS}:local_form")
    low, high = r["range"]
    # Both Mooncake listeners (handshake and data) lie in the range the rules cover.
    assert len(r["mooncake_ports"]) == 2 and all(low <= p <= high for p in r["mooncake_ports"]), r["listeners"]
    _figure("local form, attacker before the rules", r["before_rules"])
    _figure("local form, reader in the engines' group", r["engine_group"])
    _figure("local form, attacker (root, gid 0) with the rules", r["attacker"])
    _reader_got_everything(r["before_rules"])  # what the rules close: the read works without them
    assert r["before_rules"]["secret_found"] is True
    _reader_got_everything(r["engine_group"])
    assert r["engine_group"]["gid"] == KV_ENGINE_GID and r["engine_group"]["secret_found"] is True
    _attacker_got_nothing(r["attacker"])
    assert r["attacker"]["gid"] == 0
    # Raw connections over IPv4 and IPv6 loopback and to the host's own other address: every one
    # from gid 0 is reset; the engines' group gets through wherever a listener takes that family
    # (the handshake port is IPv4 only).
    assert {w.rsplit(":", 1)[0] for w in r["raw_connects"]} == {"127.0.0.1", "::1", "10.88.0.1"}
    ipv4_only = {int(x.rsplit(":", 1)[1]) for x in r["listeners"] if x.startswith("0.0.0.0:")}
    for where, by_gid in r["raw_connects"].items():
        assert by_gid["0"] == "refused", (where, by_gid)
        port = int(where.rsplit(":", 1)[1])
        if not (where.startswith("::1") and port in ipv4_only):
            assert by_gid[str(KV_ENGINE_GID)] == "ok", (where, by_gid)
    _reader_got_everything(r["after_remove"])  # removed: nothing of them is left in force


@in_netns
def test_chains_go_at_remove_and_a_killed_runs_are_cleaned_at_the_next_start() -> None:
    r = run_in_netns(f"{SCENARIOS}:chains")
    stale, live = r["stale_chains"], r["live_chains"]
    for family in ("iptables-save", "ip6tables-save"):
        assert all(any(f"-j {c}" in ln for ln in r["both"][family]) for c in stale + live)
        assert not any(c in ln for ln in r["after_clean"][family] for c in stale)  # the dead pid's: gone
        assert all(any(f"-j {c}" in ln for ln in r["after_clean"][family]) for c in live)  # a live run's: kept
        assert r["after_stop"][family] == [] and r["final"][family] == []
        # A restarted pod launcher replaced its chain and jump instead of adding a second.
        assert sum("-A INPUT " in ln for ln in r["pod_restarted"][family]) == 1
    assert f"-A {r['pod_chain']} -s 10.1.0.0/16 -j ACCEPT" in r["pod_restarted"]["iptables-save"]
    assert not any("10.0.0.0/8" in ln for ln in r["pod_restarted"]["iptables-save"])
    assert sorted(r["removed"]) == sorted(f"{t}:{c}" for t in ("iptables", "ip6tables") for c in stale)
    assert r["final_rules"] == ["-P INPUT ACCEPT", "-P FORWARD ACCEPT", "-P OUTPUT ACCEPT"]


@in_netns
@pytest.mark.slow
def test_up_fences_its_engines_serves_through_the_fence_and_leaves_no_rule(tmp_path: Path) -> None:
    r = run_in_netns(f"{SCENARIOS}:up_stack", str(tmp_path / "logs"), timeout_s=300)
    out = "\n".join(r["output"])
    assert r["exit_status"] == 0, out
    assert any(ln.startswith("removed the KV rules of an earlier run that was killed: ") for ln in r["output"]), out
    assert any(ln.startswith("KV ports fenced: TCP ") for ln in r["output"]), out
    # Prefill wrote the smoke request's KV into decode over the fenced ports: PD still works.
    assert any(ln.startswith("smoke: chat completion ok") for ln in r["output"]), out
    assert r["engine_gids"] == {"prefill": KV_ENGINE_GID, "decode": KV_ENGINE_GID}
    assert r["router_gids"] == [0]
    assert r["running"]["iptables-save"] and r["running"]["ip6tables-save"]
    stale = {ln.split()[0][1:] for ln in r["stale_before"]["iptables-save"] if ln.startswith(":")}
    assert not any(c in ln for c in stale for ln in r["running"]["iptables-save"])
    _figure("up, attacker (root, gid 0) against the decode engine's KV pool", r["attacker"])
    _attacker_got_nothing(r["attacker"])
    _reader_got_everything(r["engine_group"])
    assert r["after_stop"] == {"iptables-save": [], "ip6tables-save": []}


@in_netns
def test_launch_installs_the_rules_before_sglang_and_removes_them_after() -> None:
    r = run_in_netns(f"{SCENARIOS}:launch_pod")
    assert r["exit_status"] == 0 and r["argv_head"] == ["-m", "sglang.launch_server"]
    rules = r["rules_while_running"]["iptables-save"]
    chain = pod_chain("prefill", r["pod"], r["release"])
    assert f"-A {chain} -s 10.9.0.0/16 -j ACCEPT" in rules  # --kv-allow-from
    assert f"-A {chain} -s 127.0.0.1/32 -j ACCEPT" in rules  # --kv-peers localhost, resolved
    assert rules[-1] == f"-A {chain} -j DROP"
    assert r["rules_after_exit"] == {"iptables-save": [], "ip6tables-save": []}


# --- without iptables: refuse with a worker key, warn without --------------------------------------


def _topology(tmp: Path) -> Path:
    return local_topology(tmp)[0]


def _no_iptables_env(tmp: Path, **extra: str) -> dict[str, str]:
    empty = tmp / "bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != ENV_WORKER_API_KEY}
    return {**env, "PATH": str(empty), **extra}


def test_up_refuses_with_a_worker_key_when_the_rules_cannot_be_installed(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(_topology(tmp_path)), "--log-dir", str(tmp_path)]
    env = _no_iptables_env(tmp_path, **{ENV_WORKER_API_KEY: "wk-5f0c1e9a7d3b"})
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "cannot fence the KV ports (TCP 15000-17000)" in done.stderr
    assert "iptables-restore and iptables-save are not on PATH; install iptables" in done.stderr
    assert "pass --allow-open-kv-ports to start with them open" in done.stderr
    assert "starting" not in done.stdout  # nothing was started


def test_up_without_a_worker_key_warns_once_and_starts(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", str(_topology(tmp_path)), "--log-dir", str(tmp_path)]
    up = spawn("up", argv, env=_no_iptables_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert up.proc.stdout is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any("starting" in ln for ln in seen):
            assert time.monotonic() < deadline and up.alive(), "".join(seen)
            seen.append(up.proc.stdout.readline())
    finally:
        up.proc.send_signal(signal.SIGTERM)
        up.proc.wait(timeout=60)
        up.reap()
    warnings = [ln for ln in seen if "KV ports" in ln]
    assert len(warnings) == 1, seen
    assert warnings[0].startswith(
        "warning: the KV ports (TCP 15000-17000, Mooncake) are open to every local process: iptables-restore"
    )


def test_launch_without_iptables_names_the_fix_and_the_opt_out(tmp_path: Path) -> None:
    topology = str(REPO / "deploy" / "spec" / "presets" / "single-h200.yaml")
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "launch", "--role", "prefill", "--topology", topology]
    argv += ["--kv-peers", "localhost", "--skip-checks"]
    done = subprocess.run(argv, env=_no_iptables_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "error: cannot fence the Mooncake ports (TCP 15000-17000): iptables-restore" in err
    assert "install iptables (Debian/Ubuntu: apt-get install iptables)" in err
    assert "Or pass --no-kv-firewall to start with them open to every source (unsafe)." in err


def test_a_stack_port_inside_the_range_is_refused_when_the_rules_are_on(tmp_path: Path) -> None:
    spec = ChildSpec("decode-0", ["engine"], "http://127.0.0.1:15500/health", ports=(15500,))
    empty = str(tmp_path)  # no iptables there: nothing could be written, whatever the order of checks
    with pytest.raises(
        TopologyError, match=re.escape("port 15500 (decode-0) lies in Mooncake's port range 15000-17000")
    ):
        fence_kv_ports([spec], {}, path=empty, echo=lambda _: None)
    seen: list[str] = []
    assert fence_kv_ports([spec], {}, off=True, path=empty, echo=seen.append) == ([spec], None)  # no rules: no conflict
    assert len(seen) == 1 and "(--no-kv-firewall)" in seen[0]


def test_not_root_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(firewall.os, "geteuid", lambda: 1000)
    with pytest.raises(FirewallError, match="this process is not root, and fencing the KV ports needs root"):
        LocalFirewall((15000, 17000)).install()


def test_up_as_a_user_refuses_with_a_worker_key_and_warns_without(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(firewall.os, "geteuid", lambda: 1000)
    spec = ChildSpec("decode-0", ["engine"], "http://127.0.0.1:30001/health", ports=(30001,), kv=True)
    with pytest.raises(LaunchError, match=r"cannot fence the KV ports \(TCP 15000-17000\): this process is not root"):
        fence_kv_ports([spec], {ENV_WORKER_API_KEY: "wk-5f0c1e9a7d3b"}, path=str(tmp_path), echo=lambda _: None)
    seen: list[str] = []
    key = {ENV_WORKER_API_KEY: "wk-5f0c1e9a7d3b"}
    assert fence_kv_ports([spec], key, allow_open=True, path=str(tmp_path), echo=seen.append) == ([spec], None)
    assert fence_kv_ports([spec], {}, path=str(tmp_path), echo=seen.append) == ([spec], None)
    assert len(seen) == 2 and all("open to every local process: this process is not root" in ln for ln in seen)


def test_a_group_that_others_can_hold_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A user whose subordinate range covers the gid could map it into a user namespace and pass the rules.
    subgid = tmp_path / "subgid"
    subgid.write_text(f"alice:100000:65536\nbob:{KV_ENGINE_GID - 17}:1000\n")
    assert gid_holders(KV_ENGINE_GID, subgid) == [f"bob's subordinate range {KV_ENGINE_GID - 17}:1000 ({subgid})"]
    monkeypatch.setattr(firewall.os, "geteuid", lambda: 0)
    with pytest.raises(FirewallError, match=rf"the engines' group \(gid {KV_ENGINE_GID}\) is not theirs alone"):
        LocalFirewall((15000, 17000), subgid=subgid, path=str(tmp_path)).install()  # before any tool runs


_INSTALL_WITH_PASSWD = """
import json
from pathlib import Path
from sglang_pd.deploy.kv.firewall import FirewallError, KV_ENGINE_GID, LocalFirewall, gid_holders
holders = gid_holders(KV_ENGINE_GID, Path("/nonexistent"))
try:
    LocalFirewall((15000, 17000), subgid=Path("/nonexistent")).install()
    installed, error = True, ""
except FirewallError as exc:
    installed, error = False, str(exc)
print(json.dumps({"holders": holders, "installed": installed, "error": error}))
"""


def _install_with_passwd(tmp_path: Path, passwd: str) -> dict[str, Any]:
    """gid_holders and LocalFirewall.install, as root in a private mount and network namespace whose
    /etc/passwd is `passwd` (the host's files and rules stay untouched)."""
    (tmp_path / "passwd").write_text(passwd)
    script = tmp_path / "install.py"
    script.write_text(_INSTALL_WITH_PASSWD)
    shell = f"mount --bind {tmp_path / 'passwd'} /etc/passwd && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "--mount", "--net", "--", "sh", "-c", shell], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@in_netns
def test_a_user_whose_primary_group_is_the_engines_is_refused(tmp_path: Path) -> None:
    # Every process of such a user runs in the engines' group and would pass the rules, though no
    # /etc/group entry names the group.
    base = "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
    held = _install_with_passwd(tmp_path, base + f"carol:x:1001:{KV_ENGINE_GID}::/home/carol:/bin/sh\n")
    assert held["holders"] == ["the user 'carol', whose primary group it is (/etc/passwd)"], held
    assert held["installed"] is False, held
    assert f"the engines' group (gid {KV_ENGINE_GID}) is not theirs alone here: the user 'carol'" in held["error"]
    # Control: the same files without her, and the rules install.
    free = _install_with_passwd(tmp_path, base)
    assert free == {"holders": [], "installed": True, "error": ""}, free


def test_a_refused_write_names_net_admin(tmp_path: Path) -> None:
    tool = tmp_path / "iptables-restore"
    tool.write_text("#!/bin/sh\necho 'Permission denied (you must be root)' >&2\nexit 4\n")
    tool.chmod(0o755)
    nf = firewall.Netfilter(4, str(tool), str(tool))
    with pytest.raises(FirewallError, match=r"Permission denied .* needs CAP_NET_ADMIN: run as root") as info:
        nf.apply("*filter\nCOMMIT\n")
    assert "NET_ADMIN capability or run it privileged" in str(info.value)


# --- parsing and resolution ----------------------------------------------------------------------


def test_networks_parse_and_a_bad_one_is_named() -> None:
    assert parse_networks(" 10.0.0.0/8, fd00::/8,192.0.2.7 ,") == [
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd00::/8"),
        ipaddress.ip_network("192.0.2.7/32"),
    ]
    with pytest.raises(ValueError, match=re.escape("'10.0.0.300/8' is not an address or CIDR")):
        parse_networks("10.0.0.300/8")


def test_resolution_answers_empty_for_an_unknown_name_and_addresses_for_a_known_one() -> None:
    assert "127.0.0.1" in resolve_host("localhost")
    assert resolve_host("no-such-peer.invalid") == set()


def test_a_failed_lookup_keeps_the_names_last_addresses() -> None:
    answers: dict[str, Any] = {"decode": {"10.0.0.5"}}

    def resolve(name: str) -> set[str]:
        answer = answers[name]
        if isinstance(answer, OSError):
            raise answer
        return set(answer)

    fw = PeerFirewall(role="prefill", ports=(15000, 17000), peers=["decode"], resolve=resolve, note=lambda _: None)
    assert fw._lookup() == {ipaddress.ip_network("10.0.0.5/32")}
    answers["decode"] = OSError("temporary failure in name resolution")
    assert fw._lookup() == {ipaddress.ip_network("10.0.0.5/32")}  # DNS down: the peer stays allowed
    answers["decode"] = set()
    assert fw._lookup() == frozenset()  # the Service has no pod now: nothing of it is allowed
