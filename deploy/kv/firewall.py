"""Netfilter rules that let only the deployment's own PD engines reach Mooncake's ports.

Mooncake's transfer engine (0.3.13) authenticates no one: whoever opens a TCP connection to an
engine's handshake port gets the list of its registered buffers, and through its data port reads
or overwrites them (docs/mooncake.md). It has no auth option and no bind address, so the only
place to decide who may connect is the host's packet filter. Both ports are drawn from one range,
MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (`listeners.mooncake_port_range`), and the rules cover it whole.

- `PeerFirewall` (a pod, `sglang-pd launch`): an INPUT chain for the range accepts loopback and the
  addresses the PD peers' host names resolve to, and drops every other source. The names are
  resolved again every few seconds (`start`), and the chain is replaced when the answer changes.
  Its name carries short hashes of the release ($SGLANG_PD_RELEASE, which the chart sets to
  `<namespace>/<release>`; else the peers it admits) and of the pod (release, role, pod name):
  pods on the host's network share one filter table, and two releases' pods on one node must not
  take each other's chain for a stale one of their own, nor remove it with theirs. A pod refuses to
  install when another release's chain on the same table covers an overlapping port range: that
  chain would drop this release's peers (give each release on a node its own range).
- `LocalFirewall` (one machine, `sglang-pd up`): the engines run with the primary group
  `KV_ENGINE_GID`; an OUTPUT chain resets loopback connections to the range from sockets of any
  other group, and an INPUT chain drops connections to it from other hosts.

Each change is one `iptables-restore --noflush` transaction per table (and the same with
ip6tables where IPv6 is on: the data port listens on `::`), so a chain is never seen half
written, and rules of others in the same tables are left alone. Only connection openings (SYN)
are matched: replies to this host's own outgoing connections pass whatever their port.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import ipaddress
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_POD_NAME",
    "ENV_RELEASE",
    "INSTALL_HINT",
    "KV_ENGINE_GID",
    "LOCAL_CHAIN_PREFIX",
    "POD_CHAIN_PREFIX",
    "REFRESH_S",
    "FirewallError",
    "LocalFirewall",
    "Netfilter",
    "Network",
    "PeerFirewall",
    "fenced_engines",
    "gid_holders",
    "netfilters",
    "parse_networks",
    "pod_chain",
    "release_of",
    "remove_stale_local_chains",
    "resolve_host",
]

# The primary group `sglang-pd up` gives its engines. Only sockets of this group may open loopback
# connections to the Mooncake ports. It lies above the 16-bit ids (65534 is nogroup) and below
# 100000, where useradd starts the subordinate ranges it gives users for rootless containers
# (SUB_GID_MIN, login.defs): a user holding a range with it could map it into a user namespace of
# its own and pass the rules, so `LocalFirewall.install` also checks /etc/subgid, /etc/group and the
# users whose primary group it is (/etc/passwd).
# systemd leaves 65536-524287 unused; root can setgid to it without a group entry.
KV_ENGINE_GID = 65617
# Chain names (at most 28 characters): `up`'s carry its pid, so stale ones can be told apart.
LOCAL_CHAIN_PREFIX = "SGLPD-UP-"
POD_CHAIN_PREFIX = "SGLPD-KV-"
# The pod's name, from the downward API (the chart sets it); without it the host name, which on the
# host's network is the node's. The release, `<namespace>/<release>` (the chart sets it too).
ENV_POD_NAME = "SGLANG_PD_POD_NAME"
ENV_RELEASE = "SGLANG_PD_RELEASE"
_POD_CHAIN = re.compile(rf"^{re.escape(POD_CHAIN_PREFIX)}([0-9a-f]{{8}})-([0-9a-f]{{6}})$")
_JUMP_PORTS = re.compile(r"--dport (\d+)(?::(\d+))?")
REFRESH_S = 5.0  # how often a pod resolves its peers' names again
INSTALL_HINT = "install iptables (Debian/Ubuntu: apt-get install iptables)"
_IPV6_ON = Path("/proc/net/if_inet6")  # present when this network namespace has IPv6
_SUBGID = Path("/etc/subgid")  # user:first:count, the subordinate group ranges newgidmap grants
_LOCAL_CHAIN = re.compile(rf"^{re.escape(LOCAL_CHAIN_PREFIX)}(\d+)-(IN|OUT)$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class FirewallError(RuntimeError):
    """The KV ports' rules could not be read or written; the message names the cause and the fix."""


@dataclass(frozen=True)
class Netfilter:
    """The iptables tools of one address family (4 or 6): write with restore, read with save."""

    family: int
    restore: str
    save: str

    @property
    def name(self) -> str:
        return "iptables" if self.family == 4 else "ip6tables"

    @classmethod
    def find(cls, family: int, path: str | None = None) -> Netfilter:
        prefix = "iptables" if family == 4 else "ip6tables"
        restore, save = shutil.which(f"{prefix}-restore", path=path), shutil.which(f"{prefix}-save", path=path)
        if restore is None or save is None:
            why = "" if family == 4 else " (IPv6 is on here, and Mooncake's data port listens on `::`)"
            raise FirewallError(f"{prefix}-restore and {prefix}-save are not on PATH{why}; {INSTALL_HINT}.")
        return cls(family, restore, save)

    def _run(self, argv: list[str], text: str | None = None) -> str:
        try:
            done = subprocess.run(argv, input=text, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FirewallError(f"{argv[0]} did not run ({exc}); {INSTALL_HINT}.") from exc
        if done.returncode != 0:
            said = " ".join(done.stderr.split()) or f"exit status {done.returncode}"
            raise FirewallError(
                f"{os.path.basename(argv[0])} failed: {said}. Writing netfilter rules needs CAP_NET_ADMIN: run "
                "as root (`sglang-pd up`), or give the pod the NET_ADMIN capability or run it privileged (the "
                "chart does with kvFirewall.enabled)."
            )
        return done.stdout

    def apply(self, text: str) -> None:
        """Apply `text` (an iptables-restore file) as one transaction, keeping every other rule."""
        self._run([self.restore, "--noflush"], text)

    def filter_rules(self) -> list[str]:
        """The filter table as iptables-save prints it: chain lines (`:NAME ...`) and rule lines (`-A ...`)."""
        return [ln for ln in self._run([self.save, "-t", "filter"]).splitlines() if ln.startswith((":", "-A "))]


def netfilters(path: str | None = None) -> list[Netfilter]:
    """The tools for every address family this network namespace has (`path`: where to look, else PATH)."""
    return [Netfilter.find(f, path) for f in (4, 6) if f == 4 or _IPV6_ON.exists()]


def _chains(rules: Iterable[str]) -> set[str]:
    return {ln[1:].split()[0] for ln in rules if ln.startswith(":")}


def _removal(chains: set[str], rules: list[str]) -> list[str]:
    """restore lines that delete every jump to `chains`, then the chains themselves."""
    lines = []
    for ln in rules:
        fields = ln.split()
        if ln.startswith("-A ") and fields[-2:-1] == ["-j"] and fields[-1] in chains and fields[1] not in chains:
            lines.append("-D" + ln[2:])  # iptables-save prints each rule exactly as -D needs it
    for chain in sorted(chains):
        lines += [f"-F {chain}", f"-X {chain}"]
    return lines


def _transaction(lines: Iterable[str]) -> str:
    return "\n".join(["*filter", *lines, "COMMIT", ""])


def _port_match(ports: tuple[int, int]) -> str:
    return f"-p tcp -m tcp --dport {ports[0]}:{ports[1]} --syn"


def _remove_chains(nf: Netfilter, wanted: Callable[[str], bool]) -> list[str]:
    rules = nf.filter_rules()
    chains = {c for c in _chains(rules) if wanted(c)}
    if chains:
        nf.apply(_transaction(_removal(chains, rules)))
    return sorted(chains)


def parse_networks(text: str) -> list[Network]:
    """`10.0.0.0/8,fd00::/8,192.0.2.7` → networks (a bare address is one host); ValueError names a bad item."""
    out: list[Network] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            out.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an address or CIDR (e.g. 10.20.0.0/16, fd00::/8, 192.0.2.7)") from None
    return out


def resolve_host(name: str) -> set[str]:
    """The addresses `name` resolves to now; empty when it has none (a headless Service with no pods
    yet). Raises OSError when the lookup itself failed (DNS unreachable), so callers keep what they had."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return set()
        raise
    return {str(info[4][0]).split("%", 1)[0] for info in infos}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _short_hash(*parts: str, size: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:size]


def pod_chain(role: str, pod: str, release: str) -> str:
    """A pod's chain name, `SGLPD-KV-<release>-<pod>` (24 characters; iptables allows 28), of
    short hashes: the release's, and the pod's (release, role, pod name)."""
    return f"{POD_CHAIN_PREFIX}{_short_hash(release, size=8)}-{_short_hash(release, role, pod, size=6)}"


def release_of(peers: Sequence[str], allow_from: Sequence[Network], env: Mapping[str, str] | None = None) -> str:
    """The release a pod belongs to: $SGLANG_PD_RELEASE, else what it admits (the chart's peer names
    carry the release and namespace; the same in every pod of a release)."""
    given = (os.environ if env is None else env).get(ENV_RELEASE, "")
    return given or ",".join(sorted(peers)) or ",".join(sorted(str(n) for n in allow_from))


def _other_releases(chain: str, ports: tuple[int, int], rules: list[str]) -> list[str]:
    """Jumps from INPUT to another release's pod chain whose port range overlaps `ports`."""
    mine = _POD_CHAIN.match(chain)
    found = []
    for ln in rules:
        fields = ln.split()
        if not ln.startswith("-A INPUT ") or fields[-2:-1] != ["-j"]:
            continue
        other = _POD_CHAIN.match(fields[-1])
        dport = _JUMP_PORTS.search(ln)
        if other is None or mine is None or other.group(1) == mine.group(1) or dport is None:
            continue
        low, high = int(dport.group(1)), int(dport.group(2) or dport.group(1))
        if low <= ports[1] and ports[0] <= high:
            found.append(f"{fields[-1]} (TCP {low}-{high})")
    return found


class PeerFirewall:
    """A pod's rules: TCP `ports` accepts loopback, the addresses of `peers` (host names, resolved
    at `install` and every `refresh_s` after `start`) and `allow_from`; drops every other source.

    Host names that resolve to nothing yet are retried at each refresh; a lookup that fails keeps the
    addresses the name had. `note` gets one line each time the allowed set changes.
    """

    def __init__(
        self,
        *,
        role: str,
        ports: tuple[int, int],
        peers: Sequence[str] = (),
        allow_from: Sequence[Network] = (),
        path: str | None = None,
        resolve: Callable[[str], set[str]] = resolve_host,
        refresh_s: float = REFRESH_S,
        note: Callable[[str], None] = _stderr,
        pod: str | None = None,
        release: str | None = None,
    ) -> None:
        """`pod`: this pod's name (default: $SGLANG_PD_POD_NAME, else the host name); `release`:
        its release (default: `release_of`)."""
        self.pod = pod if pod is not None else os.environ.get(ENV_POD_NAME) or socket.gethostname()
        self.release = release if release is not None else release_of(peers, allow_from)
        self.chain = pod_chain(role, self.pod, self.release)
        self.ports = ports
        self.peers = tuple(peers)
        self.allow_from = tuple(allow_from)
        self.refresh_s = refresh_s
        self._path = path
        self._resolve = resolve
        self._note = note
        self._known: dict[str, set[str]] = {}
        self._tools: list[Netfilter] = []
        self.allowed: frozenset[Network] = frozenset()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        shown = f"chain={self.chain!r}, ports={self.ports}, peers={self.peers}, allow_from={self.allow_from}"
        return f"PeerFirewall({shown})"

    def _lookup(self) -> frozenset[Network]:
        for name in self.peers:
            try:
                self._known[name] = self._resolve(name)
            except OSError as exc:
                if name not in self._known:
                    self._note(f"kv firewall: cannot resolve {name} now ({exc}); trying again in {self.refresh_s:g} s")
                    self._known[name] = set()
        hosts = {ipaddress.ip_network(a) for addrs in self._known.values() for a in addrs}
        return frozenset(hosts | set(self.allow_from))

    def _chain_lines(self, nf: Netfilter, allowed: frozenset[Network]) -> list[str]:
        mine = sorted((n for n in allowed if n.version == nf.family), key=lambda n: (n.network_address, n.prefixlen))
        return [
            f":{self.chain} - [0:0]",  # declared under --noflush: created, or emptied when it exists
            f"-A {self.chain} -i lo -j ACCEPT",
            *(f"-A {self.chain} -s {n} -j ACCEPT" for n in mine),
            f"-A {self.chain} -j DROP",
        ]

    def install(self) -> frozenset[Network]:
        """Resolve the peers and install the chain and its jump from INPUT (replacing the jumps of
        an earlier run of this pod: a restarted pod on the host's network); returns the allowed set.
        FirewallError when another release's chain covers an overlapping port range here."""
        self._tools = netfilters(self._path)
        allowed = self._lookup()
        for nf in self._tools:
            rules = nf.filter_rules()
            others = _other_releases(self.chain, self.ports, rules)
            if others:
                raise FirewallError(
                    f"{nf.name}: another release's KV rules cover an overlapping port range on this host's network "
                    f"({', '.join(others)}), and each release's chain would drop the other's peers. Give each "
                    "release on a node its own Mooncake port range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, the "
                    f"topology's listeners.mooncake_port_range); this pod's is TCP {self.ports[0]}-{self.ports[1]}."
                )
            stale = [ln for ln in _removal({self.chain}, rules) if ln.startswith("-D ")]
            jump = f"-I INPUT 1 {_port_match(self.ports)} -j {self.chain}"
            nf.apply(_transaction([*self._chain_lines(nf, allowed), *stale, jump]))
        self.allowed = allowed
        self._say()
        return allowed

    def refresh(self) -> bool:
        """Resolve the peers again; replace the chain's rules when the allowed set changed."""
        allowed = self._lookup()
        if allowed == self.allowed:
            return False
        for nf in self._tools:
            nf.apply(_transaction(self._chain_lines(nf, allowed)))
        self.allowed = allowed
        self._say()
        return True

    def _say(self) -> None:
        ordered = sorted(self.allowed, key=lambda n: (n.version, n.network_address))
        shown = ", ".join(str(n) for n in ordered) or "no peer"
        self._note(
            f"kv firewall: TCP {self.ports[0]}-{self.ports[1]} (Mooncake) accepts loopback and {shown}; "
            "other sources are dropped"
        )

    def start(self) -> None:
        """Refresh every `refresh_s` in a daemon thread until `stop`; a failed refresh keeps the rules in force."""

        def loop() -> None:
            while not self._stop.wait(self.refresh_s):
                try:
                    self.refresh()
                except FirewallError as exc:
                    self._note(f"kv firewall: refresh failed, the previous rules stay: {exc}")

        self._thread = threading.Thread(target=loop, name="kv-firewall", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.refresh_s + 30)

    def remove(self) -> None:
        """Stop refreshing and delete the chain and its jumps (on the host's network they would outlive the pod)."""
        self.stop()
        for nf in self._tools:
            _remove_chains(nf, lambda c: c == self.chain)


class LocalFirewall:
    """`sglang-pd up`'s rules: loopback connections to TCP `ports` only from sockets of group `gid`,
    and none from other hosts. The chains are named after `pid` (this process) and removed by
    `remove`; `remove_stale_local_chains` deletes those of runs that died without it."""

    def __init__(
        self,
        ports: tuple[int, int],
        *,
        gid: int = KV_ENGINE_GID,
        pid: int | None = None,
        path: str | None = None,
        subgid: Path = _SUBGID,
    ) -> None:
        self.ports = ports
        self.gid = gid
        pid = os.getpid() if pid is None else pid
        self.out_chain = f"{LOCAL_CHAIN_PREFIX}{pid}-OUT"
        self.in_chain = f"{LOCAL_CHAIN_PREFIX}{pid}-IN"
        self._path = path
        self._subgid = subgid
        self._tools: list[Netfilter] = []

    def __repr__(self) -> str:
        return f"LocalFirewall(ports={self.ports}, gid={self.gid}, chains=({self.out_chain!r}, {self.in_chain!r}))"

    def lines(self) -> list[str]:
        """The restore lines that create both chains and their jumps."""
        match = _port_match(self.ports)
        return [
            f":{self.out_chain} - [0:0]",
            f"-A {self.out_chain} -m owner --gid-owner {self.gid} -j RETURN",
            # A reset, not a drop: a local client learns at once (connection refused) instead of
            # retrying its SYN for minutes.
            f"-A {self.out_chain} -p tcp -j REJECT --reject-with tcp-reset",
            f":{self.in_chain} - [0:0]",
            f"-A {self.in_chain} -j DROP",
            f"-I OUTPUT 1 -o lo {match} -j {self.out_chain}",
            f"-I INPUT 1 ! -i lo {match} -j {self.in_chain}",
        ]

    def install(self) -> None:
        """Install the rules for every address family; FirewallError (nothing left installed) when
        this process is not root, the group is not free (`gid_holders`), or a tool is missing or refused."""
        if os.geteuid() != 0:
            raise FirewallError(
                "this process is not root, and fencing the KV ports needs root: the engines run in their own "
                f"group (gid {self.gid}) and netfilter rules admit only that group; run it as root (sudo)."
            )
        holders = gid_holders(self.gid, self._subgid)
        if holders:
            raise FirewallError(
                f"the engines' group (gid {self.gid}) is not theirs alone here: {'; '.join(holders)} can run "
                "processes in it, which the rules would let through; remove that group entry or move that range."
            )
        tools = netfilters(self._path)
        done: list[Netfilter] = []
        try:
            for nf in tools:
                nf.apply(_transaction(self.lines()))
                done.append(nf)
        except FirewallError:
            self._tools = done
            with contextlib.suppress(FirewallError):
                self.remove()
            raise
        self._tools = tools

    def remove(self) -> None:
        """Delete both chains and their jumps (nothing when they are gone already)."""
        for nf in self._tools:
            _remove_chains(nf, lambda c: c in (self.out_chain, self.in_chain))
        self._tools = []

    def __enter__(self) -> LocalFirewall:
        self.install()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def gid_holders(gid: int, subgid: Path = _SUBGID) -> list[str]:
    """Who besides root can run a process with group `gid`: a group entry with it (its members), a
    user whose primary group it is (every process of that user runs with it, whether or not any
    group entry names it), or a user whose subordinate range in `subgid` covers it (newgidmap maps
    it into their namespace)."""
    found = []
    with contextlib.suppress(KeyError):
        found.append(f"the group {grp.getgrgid(gid).gr_name!r} (/etc/group)")
    found += [
        f"the user {u.pw_name!r}, whose primary group it is (/etc/passwd)" for u in pwd.getpwall() if u.pw_gid == gid
    ]
    with contextlib.suppress(OSError):
        for line in subgid.read_text().splitlines():
            user, _, rest = line.strip().partition(":")
            first, _, count = rest.partition(":")
            if first.isdigit() and count.isdigit() and int(first) <= gid < int(first) + int(count):
                found.append(f"{user}'s subordinate range {first}:{count} ({subgid})")
    return found


def fenced_engines(gid: int = KV_ENGINE_GID, proc: Path = Path("/proc")) -> dict[int, int]:
    """The processes of this network namespace running with the engines' group `gid`, each with its
    parent: while `sglang-pd up` fences the KV ports, its engines (only they hold the group, which
    `LocalFirewall.install` checks) and the `up` that started them. Read from /proc, so any user can ask;
    a process whose namespace this user may not read counts as this namespace's."""
    try:
        here = os.readlink(proc / "self" / "ns" / "net")
    except OSError:
        here = None
    found: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        gids = fields.get("Gid", "").split()
        if len(gids) < 2 or int(gids[1]) != gid:  # real, effective, saved, filesystem: the rules match the effective
            continue
        with contextlib.suppress(OSError):
            if here is not None and os.readlink(entry / "ns" / "net") != here:
                continue  # another namespace's (its own rules, not ours)
        found[int(entry.name)] = int(fields.get("PPid", "0").strip() or 0)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def remove_stale_local_chains(path: str | None = None, alive: Callable[[int], bool] = _pid_alive) -> list[str]:
    """Delete the chains (and jumps) of `sglang-pd up` runs whose process is gone (killed before
    it could remove them); returns their names."""
    removed: list[str] = []

    def stale(chain: str) -> bool:
        m = _LOCAL_CHAIN.match(chain)
        return m is not None and not alive(int(m.group(1)))

    for nf in netfilters(path):
        removed += [f"{nf.name}:{c}" for c in _remove_chains(nf, stale)]
    return removed
