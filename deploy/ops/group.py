"""The pods of one LeaderWorkerSet group: their addresses, the leader's port a rank > 0 waits for, and the wait."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "DP_ATTENTION_HANDSHAKE_PORT_DELTA",
    "GroupWaitError",
    "LeaderPort",
    "group_hosts",
    "leader_port",
    "resolve_all",
    "wait_for_leader",
]

# How long a rank > 0 waits for its leader: LeaderWorkerSet's LeaderCreated start policy starts the
# workers while the leader may still pull a multi-GB image, and sglang's own client on a rank > 0 gives
# up after 600 s (srt/managers/data_parallel_controller.py:584-611 in 0.5.23), which then restarts the
# whole group (RecreateGroupOnPodRestart).
DEFAULT_LEADER_WAIT_S = 1800.0
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 15.0

# sglang's option strings (ServerArgs' parser in 0.5.23; 0.5.17 knows all but the attention-DP size).
DIST_INIT_FLAGS = ("--dist-init-addr", "--nccl-init-addr")
ATTN_DP_FLAGS = ("--attn-dp-size", "--attention-data-parallel-size")
DP_FLAGS = ("--dp-size", "--data-parallel-size")
DEPRECATED_DP_ATTENTION_FLAG = "--enable-dp-attention"
# srt/server_args.py:729 (0.5.23), :9384 (0.5.17).
DP_ATTENTION_HANDSHAKE_PORT_DELTA = 13


class GroupWaitError(RuntimeError):
    """A group's pod did not become reachable in time; the message names it and what to check."""


@dataclass(frozen=True)
class LeaderPort:
    """The port of the group's leader that sglang binds first, and what it is."""

    host: str
    port: int
    what: str

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _last_value(argv: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of `names` in `argv` (`--flag value` or `--flag=value`), as argparse reads it."""
    found = None
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return found


def _int_flag(argv: Sequence[str], names: Sequence[str]) -> int:
    value = _last_value(argv, names)
    try:
        return int(value) if value is not None else 1
    except ValueError as exc:
        raise ValueError(f"{names[0]} {value!r} in the sglang command is not an integer") from exc


# Which port sglang's leader opens first, read in sglang 0.5.23 (python/sglang/srt/...):
# - With attention DP the engine starts a data-parallel controller (entrypoints/engine.py:910-918, 970-986:
#   when num_dp_ranks = dp_size x attn_dp_size > 1, runtime_context.py:191-207; arg_groups/parallel_hook.py:39-60
#   turns the deprecated `--dp-size N --enable-dp-attention` into attn_dp_size N). Its constructor
#   (managers/data_parallel_controller.py:244-245) runs launch_dp_attention_schedulers (613-676): node 0 binds its
#   worker sockets, then _broadcast_worker_ports (485-528) binds a ZMQ REP socket on the dist-init port +
#   DP_ATTENTION_HANDSHAKE_PORT_DELTA and _broadcast_ports_as_server (530-564) answers until `nnodes - 1` nodes
#   have asked; only then does launch_tensor_parallel_group start the schedulers. Nodes > 0 ask from
#   _receive_ports_as_client (584-611), a REQ socket that waits 600 s for the answer.
# - Each scheduler (managers/scheduler.py:536-540) opens torch.distributed on tcp://<dist-init-addr>
#   (distributed/bootstrap.py:233-248, 304-327; distributed/parallel_state.py:2517-2524); global rank 0, on
#   node 0, listens there. So with attention DP the dist-init port opens only after every node has joined.
# - Without attention DP every node starts its schedulers directly (entrypoints/engine.py:919-968), and node 0's
#   first rank listens on the dist-init port with no other node present.
# sglang 0.5.17 has the same two orders (data_parallel_controller.py:199-200, 427-592; engine.py:837-839), with
# `--dp-size N --enable-dp-attention` as its only spelling of attention DP.
def leader_port(argv: Sequence[str]) -> LeaderPort:
    """The leader's port that sglang binds first, with no other node present: the one a rank > 0 can wait for
    (the attention-DP handshake, or the dist-init port without attention DP). ValueError when `argv` has no
    --dist-init-addr."""
    addr = _last_value(argv, DIST_INIT_FLAGS)
    if not addr:
        raise ValueError(
            "the sglang command of a multi-node role has no --dist-init-addr, so a rank > 0 cannot tell where its "
            "leader listens; render the command with `sglang-pd plan` (launch passes the leader's address)."
        )
    host, _, port_text = addr.rpartition(":")
    host = host.strip("[]")
    try:
        dist_port = int(port_text)
    except ValueError as exc:
        raise ValueError(f"--dist-init-addr {addr!r} has no port: give it as HOST:PORT, e.g. leader:5000") from exc
    attn_dp = _int_flag(argv, ATTN_DP_FLAGS)
    if attn_dp == 1 and DEPRECATED_DP_ATTENTION_FLAG in argv:
        attn_dp = _int_flag(argv, DP_FLAGS)
    if attn_dp > 1:
        port = dist_port + DP_ATTENTION_HANDSHAKE_PORT_DELTA
        if port > 65535:
            raise ValueError(
                f"--dist-init-addr port {dist_port} + {DP_ATTENTION_HANDSHAKE_PORT_DELTA} (sglang's attention-DP "
                "handshake) is past 65535; choose a dist-init port below 65523."
            )
        what = f"the attention-DP handshake (dist-init port + {DP_ATTENTION_HANDSHAKE_PORT_DELTA})"
        return LeaderPort(host, port, what)
    return LeaderPort(host, dist_port, "torch.distributed's rendezvous (the dist-init port)")


def group_hosts(leader_address: str, size: int) -> list[str]:
    """The DNS names of a group's pods from its leader's: LWS names the leader pod `<set>-<group>` and
    worker `i` `<set>-<group>-<i>`, each resolvable under the set's headless Service
    (https://lws.sigs.k8s.io/docs/reference/labels-annotations-and-environment-variables/)."""
    leader, dot, domain = leader_address.partition(".")
    return [leader_address] + [f"{leader}-{i}{dot}{domain}" for i in range(1, size)]


def _backoff(
    attempt: Callable[[], str | None], end: float, sleep: Callable[[float], None], clock: Callable[[], float]
) -> str | None:
    """Call `attempt` until it returns None (done), with doubling delays; the last problem when `end` comes."""
    delay = FIRST_DELAY_S
    while True:
        problem = attempt()
        if problem is None or clock() + delay > end:
            return problem
        sleep(delay)
        delay = min(delay * 2, MAX_DELAY_S)


def _resolve(host: str) -> str:
    return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])


def resolve_all(
    hosts: list[str],
    timeout_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[str]:
    """Every host's IP address, waiting (with back-off) for pods not yet scheduled; GroupWaitError after
    `timeout_s`."""
    found: dict[str, str] = {}

    def attempt() -> str | None:
        for host in hosts:
            if host in found:
                continue
            try:
                found[host] = _resolve(host)
            except OSError as exc:
                return f"{host} does not resolve ({exc})"
        return None

    problem = _backoff(attempt, clock() + timeout_s, sleep, clock)
    if problem is not None:
        raise GroupWaitError(
            f"{problem} after {timeout_s:.0f} s: a pod of this group has no address yet (unscheduled? "
            "`kubectl get pods -l leaderworkerset.sigs.k8s.io/name=...`); raise SGLANG_PD_GROUP_WAIT_S to wait longer."
        )
    return [found[h] for h in hosts]


def wait_for_leader(
    leader: LeaderPort,
    timeout_s: float = DEFAULT_LEADER_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Wait, with back-off, until the leader's name resolves and then until it accepts TCP on `leader.port`
    (see `leader_port`: a port the leader opens with no other node present); its address. GroupWaitError naming
    the leader and what it lacks after `timeout_s`, both waits together."""
    end = clock() + timeout_s
    address: list[str] = []

    def resolved() -> str | None:
        try:
            address.append(_resolve(leader.host))
        except OSError as exc:
            return f"the group's leader {leader.host} does not resolve ({exc})"
        return None

    problem = _backoff(resolved, end, sleep, clock)
    if problem is not None:
        raise GroupWaitError(
            f"{problem} after {timeout_s:.0f} s: the leader pod has no address yet (unscheduled? `kubectl get pods "
            "-l leaderworkerset.sigs.k8s.io/name=...`); raise SGLANG_PD_GROUP_WAIT_S to wait longer."
        )

    def listening() -> str | None:
        try:
            with socket.create_connection((address[0], leader.port), timeout=5.0):
                return None
        except OSError as exc:
            return f"the group's leader {leader.address} ({leader.what}) does not accept connections ({exc})"

    problem = _backoff(listening, end, sleep, clock)
    if problem is not None:
        raise GroupWaitError(
            f"{problem} after {timeout_s:.0f} s: the leader pod has not started sglang (still pulling its image or "
            "loading? `kubectl describe pod` it); raise SGLANG_PD_GROUP_WAIT_S to wait longer."
        )
    return address[0]
