"""A serving process's part in its router process group: the control process owns the workers.

This process mirrors the workers' state the control process sends (`ControlLink`), hands it
its health findings and runs `/workers` changes there (`WorkerOwner`, `workers/owner.py`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from sglang_pd.deploy.common.openai_errors import ApiError

from ..exceptions import ControlLost
from ..types import Role
from ..workers.health import HealthChecker, HealthReport
from ..workers.registry import WorkerRegistry
from ..workers.rollout import Rollout
from .control import ControlLink

__all__ = ["GroupMember"]

# Other processes of the group render this one's per-worker gauges from the shared files: keep
# them this fresh (a scrape of this process refreshes them at once too).
_GAUGE_REFRESH_S = 1.0


class GroupMember:
    """Serving process `index` of a group, over its end of the control channel."""

    def __init__(self, control_socket: socket.socket, index: int) -> None:
        self.process_index: int | None = index
        self._registry: WorkerRegistry | None = None
        self._rollout: Rollout | None = None
        self.link = ControlLink(control_socket, index, self._apply, on_rollout=self._apply_rollout)
        self.report: HealthReport | None = self.link.report
        self._refresh_gauges: Callable[[], None] = lambda: None
        self._gauges: asyncio.Task[None] | None = None

    def _apply(self, states: list[dict[str, Any]]) -> None:
        assert self._registry is not None, "attach() first"
        self._registry.sync(states)

    def _apply_rollout(self, state: dict[str, Any]) -> None:
        if self._rollout is not None:
            self._rollout.apply(state)

    def follow(self, rollout: Rollout) -> None:
        self._rollout = rollout

    async def approve(self, revision: str) -> None:
        await self._ask("approve", revision=revision)  # its state arrives before the reply

    def attach(self, registry: WorkerRegistry, health: HealthChecker, refresh_gauges: Callable[[], None]) -> None:
        self._registry, self._refresh_gauges = registry, refresh_gauges

    async def start(self) -> None:
        await self.link.connect()
        self._gauges = asyncio.create_task(self._refresh_every(_GAUGE_REFRESH_S))

    async def aclose(self) -> None:
        if self._gauges is not None:
            self._gauges.cancel()
        await self.link.aclose()

    async def _refresh_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self._refresh_gauges()

    async def add(
        self, url: str, role: Role, bootstrap_port: int | None, revision: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        assert self._registry is not None, "attach() first"
        status, body = await self._ask("add", url=url, role=role, bootstrap_port=bootstrap_port, revision=revision)
        added = self._registry.get(body["url"], role)  # the change arrived before the reply
        return status, added.to_json() if added is not None else body

    async def remove(self, url: str, role: Role | None) -> list[dict[str, Any]]:
        assert self._registry is not None, "attach() first"
        shown = {(w.role, w.url): w.to_json() for w in self._registry.all()}  # with this process's counts
        _, body = await self._ask("remove", url=url, role=role)
        return [shown.get((w["role"], w["url"]), w) for w in body["removed"]]

    async def _ask(self, op: str, **args: Any) -> tuple[int, dict[str, Any]]:
        """Run a /workers change in the control process; its refusal as our ApiError."""
        try:
            status, body = await self.link.request(op, **args)
        except ControlLost as exc:
            raise ApiError(503, f"{exc} Retry shortly.", code="control_unavailable") from exc
        if status >= 400:
            raise ApiError(status, body["message"], param=body.get("param"), code=body.get("code", "invalid_value"))
        return status, body
