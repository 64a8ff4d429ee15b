"""The control channel of a router process group over real socket pairs, in one process: state
reaches every serving end, a request's change arrives before its reply, reports reach the control
end, and a serving end that loses the control process fails what it waits on and says so."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from sglang_pd.deploy.router.exceptions import ControlLost
from sglang_pd.deploy.router.group.control import ControlLink, ControlServer
from sglang_pd.deploy.router.workers.registry import WorkerRegistry


def _state(url: str, healthy: bool = True) -> dict[str, Any]:
    return {"url": url, "role": "decode", "bootstrap_port": None, "source": "api", "healthy": healthy,
            "dp_size": 1, "models": ["m"], "last_error": "", "checked": True}  # fmt: skip


class Control:
    """A control end holding a list of worker states, answering "add" after `delay_s`."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.states: list[dict[str, Any]] = []
        self.reports: list[tuple[str, str, str, str]] = []
        self.alive: list[tuple[int, int]] = []
        self.delay_s = delay_s
        self.server = ControlServer(
            state=lambda: self.states, handle=self.handle, on_report=self.on_report,
            on_alive=lambda index, pid: self.alive.append((index, pid)),
        )  # fmt: skip

    async def handle(self, op: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        await asyncio.sleep(self.delay_s)
        if op == "add":
            self.states.append(_state(args["url"], healthy=False))
            return 201, {"url": args["url"]}
        return 400, {"message": f"unknown {op}"}

    async def link(self, index: int, registry: WorkerRegistry, on_lost: Any = lambda: None) -> ControlLink:
        """A serving end on a new socket pair, as group.py hands one to each serving process."""
        ours, theirs = socket.socketpair()
        await self.server.attach(ours)
        return ControlLink(theirs, index, registry.sync, on_lost=on_lost)

    def on_report(self, kind: str, url: str, role: str, detail: str) -> None:
        self.reports.append((kind, url, role, detail))
        self.states = [{**s, "healthy": False} if s["url"] == url else s for s in self.states]


def test_state_requests_and_reports() -> None:
    async def main() -> None:
        control = Control()
        control.states = [_state("http://127.0.0.1:7001")]
        registries = [WorkerRegistry(), WorkerRegistry()]
        links = [await control.link(i, registries[i]) for i in range(2)]
        for link in links:
            await link.connect(timeout_s=5)
        # Both ends hold the state from the moment connect() returns.
        assert [[w.url for w in r.decode] for r in registries] == [["http://127.0.0.1:7001"]] * 2
        assert registries[0].decode[0].healthy and registries[0].decode[0].models == ["m"]

        status, body = await links[0].request("add", url="http://127.0.0.1:7002")
        assert (status, body) == (201, {"url": "http://127.0.0.1:7002"})
        # The caller has the change before its reply; the other end gets it as well.
        assert registries[0].get("http://127.0.0.1:7002", "decode") is not None
        await asyncio.sleep(0.1)
        assert registries[1].get("http://127.0.0.1:7002", "decode") is not None
        assert (await links[1].request("nonsense"))[0] == 400

        links[1].report("stalled", registries[1].decode[0], "no bytes for 5 s")
        await asyncio.sleep(0.1)
        assert control.reports == [("stalled", "http://127.0.0.1:7001", "decode", "no bytes for 5 s")]
        assert not registries[0].decode[0].healthy  # the report's effect reached every end
        assert {i for i, _ in control.alive} == {0, 1}

        control.states = []  # a removal reaches every end at the next publish
        control.server.publish()
        await asyncio.sleep(0.1)
        assert [r.decode for r in registries] == [[], []]
        for link in links:
            await link.aclose()
        await control.server.aclose()

    asyncio.run(main())


def test_a_slow_control_process_is_a_clear_error() -> None:
    async def main() -> None:
        control = Control(delay_s=2.0)
        link = await control.link(0, WorkerRegistry())
        await link.connect(timeout_s=5)
        with pytest.raises(ControlLost, match=r"did not answer within 0\.2 s"):
            await link.request("add", timeout_s=0.2, url="http://127.0.0.1:7003")
        await link.aclose()
        await control.server.aclose()

    asyncio.run(main())


def test_losing_the_control_process_fails_waiters_and_signals() -> None:
    async def main() -> None:
        control = Control(delay_s=5.0)
        lost = asyncio.Event()
        link = await control.link(0, WorkerRegistry(), on_lost=lost.set)
        await link.connect(timeout_s=5)
        waiting = asyncio.ensure_future(link.request("add", url="http://127.0.0.1:7004"))
        await asyncio.sleep(0.1)
        await control.server.aclose()  # the control process goes away mid-request
        with pytest.raises(ControlLost):
            await asyncio.wait_for(waiting, 5)
        await asyncio.wait_for(lost.wait(), 5)
        with pytest.raises(ControlLost):
            await link.request("add", url="http://127.0.0.1:7005")
        await link.aclose()

    asyncio.run(main())


def test_a_change_not_yet_published_reaches_everyone_when_a_process_attaches() -> None:
    async def main() -> None:
        control = Control()
        control.states = [_state("http://127.0.0.1:7001")]
        first = WorkerRegistry()
        first_link = await control.link(0, first)
        await first_link.connect(timeout_s=5)
        control.states = [_state("http://127.0.0.1:7001", healthy=False)]  # not published yet
        second = WorkerRegistry()
        second_link = await control.link(1, second)
        await second_link.connect(timeout_s=5)
        await asyncio.sleep(0.1)
        assert not first.decode[0].healthy and not second.decode[0].healthy
        for link in (first_link, second_link):
            await link.aclose()
        await control.server.aclose()

    asyncio.run(main())
