"""A LeaderWorkerSet group's pods: their names, resolving them, and waiting for the leader with back-off."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sglang_pd.deploy.ops.group import GroupWaitError, group_hosts, resolve_all, wait_for_leader


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


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_group_hosts_follow_lws_pod_names() -> None:
    assert group_hosts("r1-decode-0.r1-decode.llm", 3) == [
        "r1-decode-0.r1-decode.llm",
        "r1-decode-0-1.r1-decode.llm",
        "r1-decode-0-2.r1-decode.llm",
    ]


def test_a_rank_waits_for_its_leader_to_listen() -> None:
    port = _unused_port()
    server = socket.socket()

    def listen_later() -> None:
        time.sleep(1.5)  # the leader's sglang starts after the worker's
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    started = time.monotonic()
    try:
        wait_for_leader("127.0.0.1", port, timeout_s=30)
    finally:
        thread.join()
        server.close()
    assert 1.5 <= time.monotonic() - started < 10


def test_a_leader_that_never_listens_ends_the_wait_with_a_clear_message() -> None:
    clock = FakeClock()
    port = _unused_port()
    with pytest.raises(GroupWaitError) as info:
        wait_for_leader("127.0.0.1", port, timeout_s=60, sleep=clock.sleep, clock=clock)
    assert clock.sleeps == [1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0]  # back-off, capped, within the 60 s
    assert str(info.value).startswith(f"the group's leader 127.0.0.1:{port} does not accept connections")
    assert "after 60 s: the leader pod has not started sglang" in str(info.value)
    assert "raise SGLANG_PD_GROUP_WAIT_S to wait longer" in str(info.value)


def test_group_addresses_resolve_or_name_the_missing_pod() -> None:
    assert resolve_all(["localhost"], timeout_s=5) in (["127.0.0.1"], ["::1"])
    clock = FakeClock()
    with pytest.raises(GroupWaitError, match=r"^r1-decode-0-1\.invalid does not resolve"):
        resolve_all(["localhost", "r1-decode-0-1.invalid"], timeout_s=10, sleep=clock.sleep, clock=clock)
