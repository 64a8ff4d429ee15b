"""A LeaderWorkerSet group's pods: their names, the leader port a rank > 0 waits for, and the wait with back-off."""

from __future__ import annotations

import argparse
import re
import socket
import threading
import time

import pytest

from sglang_pd.deploy.ops import group
from sglang_pd.deploy.ops.group import (
    GroupWaitError,
    LeaderPort,
    group_hosts,
    leader_port,
    resolve_all,
    wait_for_leader,
)
from sglang_pd.deploy.sglang.render import render_node
from sglang_pd.deploy.spec.topology import PRESETS_DIR, load_topology
from tests.support.polling import free_port


class FakeClock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s

    def __call__(self) -> float:
        return self.now


def test_group_hosts_follow_lws_pod_names() -> None:
    assert group_hosts("r1-decode-0.r1-decode.llm", 3) == [
        "r1-decode-0.r1-decode.llm",
        "r1-decode-0-1.r1-decode.llm",
        "r1-decode-0-2.r1-decode.llm",
    ]


# --- which port: the one sglang's leader binds first ---------------------------------------------------------

BASE = ["-m", "sglang.launch_server", "--model-path", "m", "--tp-size", "16", "--nnodes", "2", "--node-rank", "1"]
HANDSHAKE = "the attention-DP handshake (dist-init port + 13)"
RENDEZVOUS = "torch.distributed's rendezvous (the dist-init port)"
LAYOUTS = {
    # sglang 0.5.23's spelling of attention DP, and its long form.
    "attn-dp-size": (["--dist-init-addr", "d-0.d.llm:5000", "--attn-dp-size", "16"], ("d-0.d.llm", 5013, HANDSHAKE)),
    "attention-data-parallel-size=": (
        ["--dist-init-addr=d-0.d.llm:5000", "--attention-data-parallel-size=16"],
        ("d-0.d.llm", 5013, HANDSHAKE),
    ),
    # The deprecated spelling, sglang 0.5.17's only one: attention DP of dp-size.
    "enable-dp-attention": (
        ["--nccl-init-addr", "d-0.d.llm:6000", "--dp-size", "16", "--enable-dp-attention"],
        ("d-0.d.llm", 6013, HANDSHAKE),
    ),
    # Plain tensor parallelism over the nodes; DP replicas without attention DP; an attention-DP size of 1.
    "plain-tp": (["--dist-init-addr", "d-0.d.llm:5000"], ("d-0.d.llm", 5000, RENDEZVOUS)),
    "dp-replicas": (["--dist-init-addr", "d-0.d.llm:5000", "--dp-size", "2"], ("d-0.d.llm", 5000, RENDEZVOUS)),
    "attn-dp-size-1": (["--dist-init-addr", "d-0.d.llm:5000", "--attn-dp-size", "1"], ("d-0.d.llm", 5000, RENDEZVOUS)),
    # argparse's rule: the last occurrence wins.
    "repeated": (
        ["--dist-init-addr", "a:1", "--attn-dp-size", "16", "--dist-init-addr", "[fd00::5]:7000"],
        ("fd00::5", 7013, HANDSHAKE),
    ),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_leader_port_follows_the_layout(layout) -> None:
    flags, (host, port, what) = LAYOUTS[layout]
    assert leader_port([*BASE, *flags]) == LeaderPort(host, port, what)


def test_the_presets_decode_ranks_wait_for_the_handshake() -> None:
    for preset in ("deepseek-r1-h200-1p1d", "deepseek-v3-h20-3p2d"):
        argv = render_node(
            load_topology(PRESETS_DIR / f"{preset}.yaml"), "decode", node_rank=1, leader_host="decode-0.decode.llm"
        ).argv
        assert leader_port(argv).address == "decode-0.decode.llm:5013", preset


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "the sglang command of a multi-node role has no --dist-init-addr"),
        (["--dist-init-addr", "leader"], "--dist-init-addr 'leader' has no port: give it as HOST:PORT"),
        (["--dist-init-addr", "l:65530", "--attn-dp-size", "16"], "port 65530 + 13 (sglang's attention-DP handshake)"),
        (["--dist-init-addr", "l:5000", "--attn-dp-size", "x"], "--attn-dp-size 'x' in the sglang command is not"),
    ],
    ids=["no-dist-init", "no-port", "past-65535", "not-an-integer"],
)
def test_a_command_without_a_usable_leader_port_is_refused(flags, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        leader_port([*BASE, *flags])


@pytest.mark.sglang
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_leader_port_reads_argv_as_sglangs_parser_does(layout) -> None:
    # The oracle: sglang 0.5.23's own parser, and its parallel hook's reading of the deprecated flag
    # (srt/arg_groups/parallel_hook.py:39-60): attention DP when attn_dp_size > 1 (runtime_context.py:191-199).
    server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed (the `validate` extra)")
    flags, _ = LAYOUTS[layout]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    parsed = parser.parse_args([*BASE, *flags][2:])
    attn_dp = parsed.attn_dp_size if parsed.attn_dp_size > 1 else (parsed.dp_size if parsed.enable_dp_attention else 1)
    host, _, port = parsed.dist_init_addr.rpartition(":")
    delta = server_args.DP_ATTENTION_HANDSHAKE_PORT_DELTA if attn_dp > 1 else 0
    got = leader_port([*BASE, *flags])
    assert (got.host, got.port) == (host.strip("[]"), int(port) + delta)


# --- the wait: the leader's name, then its port, with back-off, under one deadline ------------------------------


def test_a_rank_waits_for_its_leader_to_listen() -> None:
    port = free_port()
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(1.5)  # the leader's sglang starts after the worker's
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    started = time.monotonic()
    try:
        assert wait_for_leader(LeaderPort("localhost", port, "a test port"), timeout_s=30) in ("127.0.0.1", "::1")
    finally:
        thread.join()
        server.close()
    assert 1.5 <= time.monotonic() - started < 10


def test_a_leader_that_never_listens_ends_the_wait_with_a_clear_message() -> None:
    clock = FakeClock()
    port = free_port()
    with pytest.raises(GroupWaitError) as info:
        wait_for_leader(LeaderPort("127.0.0.1", port, HANDSHAKE), timeout_s=60, sleep=clock.sleep, clock=clock)
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]  # back-off, capped, within the 60 s
    assert str(info.value).startswith(
        f"the group's leader 127.0.0.1:{port} (the attention-DP handshake (dist-init port + 13)) does not accept "
        "connections"
    )
    assert "after 60 s: the leader pod has not started sglang" in str(info.value)
    assert "raise SGLANG_PD_GROUP_WAIT_S to wait longer" in str(info.value)


def test_a_leader_whose_name_never_resolves_is_named() -> None:
    clock = FakeClock()
    with pytest.raises(GroupWaitError) as info:
        wait_for_leader(LeaderPort("r1-decode-0.invalid", 5013, HANDSHAKE), 10, sleep=clock.sleep, clock=clock)
    assert str(info.value).startswith("the group's leader r1-decode-0.invalid does not resolve")
    assert "after 10 s: the leader pod has no address yet (unscheduled?" in str(info.value)
    assert sum(clock.sleeps) <= 10


def test_the_port_is_tried_only_once_the_name_resolves_within_the_same_deadline(monkeypatch) -> None:
    # A pod's DNS record appears once LWS has created it: here the first two look-ups fail as they would.
    real, calls = socket.getaddrinfo, []

    def getaddrinfo(host, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(host)
        if len(calls) <= 2:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *a, **k)

    monkeypatch.setattr(group.socket, "getaddrinfo", getaddrinfo)
    clock = FakeClock()
    port = free_port()
    with pytest.raises(GroupWaitError, match=r"^the group's leader localhost:\d+ \(p\) does not accept connections"):
        wait_for_leader(LeaderPort("localhost", port, "p"), timeout_s=20, sleep=clock.sleep, clock=clock)
    # 1 + 2 s for the name, then the port's own back-off from 1 s, all inside the 20 s.
    assert clock.sleeps == [1.0, 2.0, 1.0, 2.0, 4.0, 8.0]
    # The name is looked up until it resolves, then its address is what the connects use.
    assert calls[:3] == ["localhost"] * 3 and set(calls[3:]) <= {"127.0.0.1", "::1"}


def test_group_addresses_resolve_or_name_the_missing_pod() -> None:
    assert resolve_all(["localhost"], timeout_s=5) in (["127.0.0.1"], ["::1"])
    clock = FakeClock()
    with pytest.raises(GroupWaitError, match=r"^r1-decode-0-1\.invalid does not resolve"):
        resolve_all(["localhost", "r1-decode-0-1.invalid"], timeout_s=10, sleep=clock.sleep, clock=clock)
