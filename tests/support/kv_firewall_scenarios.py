"""The KV ports' rules against real sockets, real Mooncake engines and a real `sglang-pd up`, each
scenario run in its own network namespace by tests/deploy/kv/test_firewall.py (`netns.run_in_netns`).

Every function returns what it saw as a JSON-able dict; the test makes the assertions, so that a
failure shows the whole picture. The attacker is `scripts/kv_read_probe.py`: a root process with
gid 0 that opens its own Mooncake engine and reads the target's first registered buffer.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sglang_pd.deploy.common.procs import spawn
from sglang_pd.deploy.kv.firewall import (
    ENV_POD_NAME,
    ENV_RELEASE,
    KV_ENGINE_GID,
    FirewallError,
    LocalFirewall,
    PeerFirewall,
    remove_stale_local_chains,
)
from sglang_pd.deploy.kv.listeners import listening_sockets, mooncake_port_range
from sglang_pd.deploy.kv.peer import start_peer
from tests.support.netns import REPO, PeerNamespace, peer_namespace, sh

PROBE = str(REPO / "scripts" / "kv_read_probe.py")
SECRET = "A" * 64  # what the victim's KV region holds (the peer's /fill writes one byte value)

# A TCP connect with a chosen source address; prints ok, refused or timeout.
CONNECT = """
import socket, sys
src, dst, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = socket.socket(socket.AF_INET6 if ":" in dst else socket.AF_INET)
s.settimeout(1.5)
if src:
    s.bind((src, 0))
try:
    s.connect((dst, port))
    print("ok")
except socket.timeout:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
"""


def _connect_here(dst: str, port: int, gid: int | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CONNECT, "", dst, str(port)], capture_output=True, text=True, group=gid, timeout=30
    )
    return done.stdout.strip() or done.stderr.strip()[-200:]


def _connect_from(peer: PeerNamespace, src: str, dst: str, port: int) -> str:
    done = peer.run(sys.executable, "-c", CONNECT, src, dst, str(port))
    return done.stdout.strip() or done.stderr.strip()[-200:]


def _probe(target: str, *, gid: int | None = None, peer: PeerNamespace | None = None, hostname: str = "") -> Any:
    argv = [sys.executable, PROBE, target, "--bytes", "4096", "--secret", SECRET]
    if hostname:
        argv += ["--hostname", hostname]
    t0 = time.monotonic()
    if peer is not None:
        done = peer.run(*argv, timeout_s=120)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, group=gid, timeout=120, cwd=REPO)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
    result["exit_status"] = done.returncode
    result["wall_seconds"] = round(time.monotonic() - t0, 3)
    return result


def _chains() -> dict[str, list[str]]:
    """Our chains in each family's filter table, and every rule that jumps to one."""
    out: dict[str, list[str]] = {}
    for tool in ("iptables-save", "ip6tables-save"):
        text = subprocess.run([tool, "-t", "filter"], capture_output=True, text=True, check=True).stdout
        out[tool] = [ln for ln in text.splitlines() if "SGLPD-" in ln]
    return out


def _listener(port: int) -> socket.socket:
    """A dual-stack listener on every interface, as Mooncake's data port; accepts and closes."""
    srv = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("::", port))
    srv.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv


def pod_form() -> dict[str, Any]:
    """A pod's rules: sources in another namespace (another host) reach the range only when their
    address is among the peers' (resolved by a stand-in DNS that the scenario changes)."""
    low, high = mooncake_port_range()
    inside, outside = low + 123, low - 1
    servers = [_listener(inside), _listener(outside)]
    answers = {"decode-peers": {"10.77.0.2", "fd77::2"}}
    notes: list[str] = []
    fw = PeerFirewall(
        role="decode",
        ports=(low, high),
        peers=["decode-peers"],
        resolve=lambda name: set(answers.get(name, set())),
        refresh_s=0.2,
        note=notes.append,
    )
    sources = [("10.77.0.2", "10.77.0.1"), ("10.77.0.3", "10.77.0.1"), ("fd77::2", "fd77::1"), ("fd77::3", "fd77::1")]
    with peer_namespace() as peer:

        def attempts(port: int) -> dict[str, str]:
            seen = {src: _connect_from(peer, src, dst, port) for src, dst in sources}
            seen["loopback"] = _connect_here("127.0.0.1", port)
            return seen

        open_before = attempts(inside)
        fw.install()
        first = attempts(inside)
        first_outside = attempts(outside)
        rules_first = _chains()
        answers["decode-peers"] = {"10.77.0.3", "fd77::3"}  # the peer pod was replaced: a new address
        fw.start()
        deadline = time.monotonic() + 10
        while fw.allowed != {ipaddress.ip_network("10.77.0.3"), ipaddress.ip_network("fd77::3")}:
            assert time.monotonic() < deadline, notes
            time.sleep(0.05)
        second = attempts(inside)
        rules_second = _chains()
        fw.remove()
        removed = attempts(inside)
    for s in servers:
        s.close()
    return {
        "ports": [low, high],
        "open_before": open_before,
        "first": first,
        "first_outside_range": first_outside,
        "second": second,
        "after_remove": removed,
        "rules_first": rules_first,
        "rules_second": rules_second,
        "rules_after_remove": _chains(),
        "notes": notes,
        "chain": fw.chain,
    }


def two_releases() -> dict[str, Any]:
    """Two releases' pods on one node's network (hostNetwork), each fencing its own Mooncake range:
    both chains stay in force side by side, a second pod of a release adds its own, a release with
    an overlapping range is refused, and removing one pod's rules leaves the others'."""
    ranges = {"a": (15000, 15999), "b": (16000, 16999)}
    servers = [_listener(low + 7) for low, _ in ranges.values()]
    answers = {"a-prefill.ns": {"10.77.0.2"}, "a-decode.ns": set(), "b-prefill.ns": {"10.77.0.3"}, "b-decode.ns": set()}

    def pod(release: str, role: str, ports: tuple[int, int]) -> PeerFirewall:
        return PeerFirewall(
            role=role,
            ports=ports,
            peers=[f"{release}-prefill.ns", f"{release}-decode.ns"],
            resolve=lambda name: set(answers.get(name, set())),
            note=lambda _line: None,
            pod=f"{release}-{role}-0",
            release=f"ns/{release}",
        )

    a, a_decode, b = pod("a", "prefill", ranges["a"]), pod("a", "decode", ranges["a"]), pod("b", "prefill", ranges["b"])
    overlapping = pod("c", "prefill", (15500, 16500))
    with peer_namespace() as peer:

        def attempts() -> dict[str, str]:
            return {
                f"{src}->{release}": _connect_from(peer, src, "10.77.0.1", ranges[release][0] + 7)
                for src in ("10.77.0.2", "10.77.0.3")
                for release in ("a", "b")
            }

        a.install()
        b.install()
        both = attempts()
        rules_both = _chains()
        a_decode.install()  # the same release, the same range: its own chain beside a's
        rules_three = _chains()
        try:
            overlapping.install()
            refused = ""
        except FirewallError as exc:
            refused = str(exc)
        rules_after_refusal = _chains()
        b.remove()
        after_b_removed = attempts()
        rules_after_b_removed = _chains()
        a.remove()
        a_decode.remove()
    for srv in servers:
        srv.close()
    return {
        "chains": {"a": a.chain, "a_decode": a_decode.chain, "b": b.chain, "c": overlapping.chain},
        "both": both,
        "rules_both": rules_both,
        "rules_three": rules_three,
        "refused": refused,
        "rules_after_refusal": rules_after_refusal,
        "after_b_removed": after_b_removed,
        "rules_after_b_removed": rules_after_b_removed,
        "final": _chains(),
    }


def pod_form_mooncake() -> dict[str, Any]:
    """A real Mooncake engine behind a pod's rules, read by a real engine in another namespace:
    readable while that namespace's address is a peer's, not once it is not."""
    low, high = mooncake_port_range()
    answers = {"prefill-peers": {"10.77.0.2"}}
    fw = PeerFirewall(
        role="decode",
        ports=(low, high),
        peers=["prefill-peers"],
        resolve=lambda name: set(answers.get(name, set())),
        note=lambda _line: None,
    )
    env = {"SGLANG_PD_KV_HOSTNAME": "10.77.0.1"}
    with peer_namespace() as peer, start_peer(1 << 16, env=env) as target:
        target.get(f"/fill?offset=0&length={len(SECRET)}&byte={ord(SECRET[0])}")
        fw.install()
        try:
            allowed = _probe(target.info.session_id, peer=peer, hostname="10.77.0.2")
            answers["prefill-peers"] = {"10.77.0.3"}
            fw.refresh()
            refused = _probe(target.info.session_id, peer=peer, hostname="10.77.0.2")
        finally:
            fw.remove()
    return {"address": target.info.session_id, "allowed": allowed, "not_a_peer": refused}


def local_form() -> dict[str, Any]:
    """`up`'s rules around a real Mooncake engine in the engines' group: the attacker (gid 0) reads
    its KV memory before the rules and recovers nothing with them; a reader in the group still reads."""
    low, high = mooncake_port_range()
    # An address of this host besides loopback: connections to it from here go through `lo` too.
    sh("ip", "link", "add", "kvl0", "type", "veth", "peer", "name", "kvl1")
    sh("ip", "addr", "add", "10.88.0.1/24", "dev", "kvl0")
    sh("ip", "link", "set", "kvl0", "up")
    with start_peer(1 << 16, group=KV_ENGINE_GID) as target:
        target.get(f"/fill?offset=0&length={len(SECRET)}&byte={ord(SECRET[0])}")
        address = target.info.session_id
        found = listening_sockets(target.proc.pid) or set()
        ports = sorted({x.port for x in found if low <= x.port <= high})
        before = _probe(address, gid=0)
        fw = LocalFirewall((low, high))
        fw.install()
        try:
            rules = _chains()
            engine_group = _probe(address, gid=KV_ENGINE_GID)
            attacker = _probe(address, gid=0)
            raw = {
                f"{addr}:{port}": {str(gid): _connect_here(addr, port, gid) for gid in (0, KV_ENGINE_GID)}
                for port in ports
                for addr in ("127.0.0.1", "::1", "10.88.0.1")
            }
        finally:
            fw.remove()
        after = _probe(address, gid=0)
    return {
        "address": address,
        "listeners": sorted(str(x) for x in found),
        "mooncake_ports": ports,
        "range": [low, high],
        "before_rules": before,
        "engine_group": engine_group,
        "attacker": attacker,
        "raw_connects": raw,
        "rules": rules,
        "after_remove": after,
    }


def chains() -> dict[str, Any]:
    """Chains come and go: `remove` leaves nothing, a dead run's chains are cleaned, a live run's kept,
    and a pod's restart replaces its jump instead of adding one."""
    ports = mooncake_port_range()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = LocalFirewall(ports, pid=dead.pid)
    stale.install()
    live = LocalFirewall(ports)
    live.install()
    both = _chains()
    removed = remove_stale_local_chains()
    after_clean = _chains()
    live.remove()
    after_stop = _chains()
    # The chart names the release; a value change (allowFrom) keeps it.
    pod = PeerFirewall(
        role="prefill", ports=ports, allow_from=[ipaddress.ip_network("10.0.0.0/8")], note=print, release="ns/rel"
    )
    pod.install()
    again = PeerFirewall(
        role="prefill", ports=ports, allow_from=[ipaddress.ip_network("10.1.0.0/16")], note=print, release="ns/rel"
    )
    again.install()  # the pod's launcher restarted on the host's network: same chain, one jump
    restarted = _chains()
    again.remove()
    return {
        "stale_chains": [stale.out_chain, stale.in_chain],
        "live_chains": [live.out_chain, live.in_chain],
        "both": both,
        "removed": removed,
        "after_clean": after_clean,
        "after_stop": after_stop,
        "pod_restarted": restarted,
        "pod_chain": again.chain,
        "final": _chains(),
        "final_rules": subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout.splitlines(),
    }


def _descendants(pid: int) -> dict[int, str]:
    """Every process below `pid`, with its command line."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out: dict[int, str] = {}
    for p in parents:
        q = p
        while q in parents and q != pid:
            q = parents[q]
        if q == pid and p != pid:
            try:
                out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
    return out


def _gid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Gid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Gid line for {pid}")


def up_stack(log_dir: str, fence: str = "on") -> dict[str, Any]:
    """A real `sglang-pd up` (reference engines, router): it cleans a killed run's chains, fences
    its engines' KV ports while it runs, and leaves no rule behind when stopped. `fence` "off":
    the same stack with --no-kv-firewall, to measure what the attacker reads without the rules."""
    low, high = mooncake_port_range()
    if fence == "on":
        dead = subprocess.Popen(["true"])
        dead.wait()
        LocalFirewall((low, high), pid=dead.pid).install()  # what a SIGKILLed run leaves
    stale_before = _chains()
    # With its smoke request: a chat completion through the router, whose KV the prefill engine
    # writes into the decode engine over the fenced ports.
    argv = [sys.executable, "-m", "sglang_pd.deploy.cli", "up", "local-cpu", "--log-dir", log_dir]
    if fence == "off":
        argv.append("--no-kv-firewall")
    up = spawn("up", argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout = up.proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 150
    while not any(ln.startswith(("smoke: ", "error: ")) for ln in lines):
        assert time.monotonic() < deadline and up.alive(), "".join(lines[-40:])
        time.sleep(0.2)
    running = _chains()
    procs = _descendants(up.pid)
    engines = {pid: cmd for pid, cmd in procs.items() if " engine --role " in cmd and "sglang_pd" in cmd}
    routers = {pid: cmd for pid, cmd in procs.items() if " router " in cmd and "sglang_pd" in cmd}
    decode = next(pid for pid, cmd in engines.items() if "--role decode" in cmd)
    handshake = next(
        x.port for x in (listening_sockets(decode) or set()) if x.address == "0.0.0.0" and low <= x.port <= high
    )
    address = f"127.0.0.1:{handshake}"
    engine_gids = {cmd.split(" --role ")[1].split()[0]: _gid(pid) for pid, cmd in engines.items()}
    router_gids = sorted({_gid(pid) for pid in routers})
    attacker = _probe(address, gid=0)
    engine_group = _probe(address, gid=KV_ENGINE_GID)
    up.proc.send_signal(signal.SIGTERM)
    code = up.proc.wait(timeout=90)
    reader.join(timeout=10)
    return {
        "stale_before": stale_before,
        "running": running,
        "engine_gids": engine_gids,
        "router_gids": router_gids,
        "address": address,
        "attacker": attacker,
        "engine_group": engine_group,
        "exit_status": code,
        "after_stop": _chains(),
        "output": [ln.rstrip() for ln in lines],
    }


def launch_pod() -> dict[str, Any]:
    """`sglang-pd launch --role prefill --kv-peers ...`: the rules are in place while sglang runs
    (a stand-in records them) and gone once it has exited."""
    from sglang_pd.deploy.cli import main
    from sglang_pd.deploy.ops import launch

    seen: dict[str, Any] = {}

    def supervise(argv: list[str], env: dict[str, str], secrets: tuple[str, ...]) -> int:
        seen["argv_head"] = list(argv[1:3])
        seen["rules_while_running"] = _chains()
        return 0

    launch.pod_checks = lambda *a, **k: []  # no GPUs here; not what is tested
    launch.supervise = supervise
    os.environ[ENV_POD_NAME] = seen["pod"] = "rel-prefill-0"  # the chart's downward API values
    os.environ[ENV_RELEASE] = seen["release"] = "ns/rel"
    topology = str(REPO / "deploy" / "spec" / "presets" / "single-h200.yaml")
    argv = ["launch", "--role", "prefill", "--topology", topology, "--kv-peers", "localhost", "--kv-allow-from"]
    code = main([*argv, "10.9.0.0/16"])
    seen["exit_status"] = code
    seen["rules_after_exit"] = _chains()
    seen["pid"] = os.getpid()
    return seen
