"""Who owns the worker set: where `/workers` changes, discovery and health verdicts are made.

A router alone owns its workers (`LocalWorkers`). A serving process of a router process group
does not: the group's control process owns them and this process mirrors its state
(`group.member.GroupMember`). `RouterApp` is composed with one of the two and never asks which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from sglang_pd.deploy.common.openai_errors import ApiError

from ..config import RouterConfig
from ..exceptions import WorkerRegistrationError
from ..types import Role
from .discovery import KubernetesDiscovery, ListFunc
from .health import HealthChecker, HealthReport
from .hosts import WorkerHosts
from .registry import WorkerRegistry, add_configured
from .rollout import Rollout

__all__ = ["LocalWorkers", "WorkerOwner"]


class WorkerOwner(Protocol):
    """The router's owner of its workers."""

    # Where this process's health findings go (None: its own HealthChecker books them).
    report: HealthReport | None
    # The index of this serving process in its group, for its log lines (None: a router alone).
    process_index: int | None

    def attach(self, registry: WorkerRegistry, health: HealthChecker, refresh_gauges: Callable[[], None]) -> None:
        """Take the app's registry and health checker (once, before `start`)."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def add(
        self, url: str, role: Role, bootstrap_port: int | None, revision: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Register a worker (`revision` None: unknown, or kept when it is registered): the HTTP status
        and the worker as `GET /workers` shows it."""
        ...

    async def remove(self, url: str, role: Role | None) -> list[dict[str, Any]]:
        """Deregister the workers at `url` (of `role`, or both): each as it was shown; 404 when none."""
        ...

    def follow(self, rollout: Rollout) -> None:
        """Take the app's Rollout (once, before `start`): approvals made through `approve` reach it."""

    async def approve(self, revision: str) -> None:
        """Approve `revision` (workers/rollout.py); ApiError 409 when it has no healthy pair."""
        ...


class LocalWorkers:
    """This process owns its workers: the configured ones, `/workers` changes and discovery."""

    report: HealthReport | None = None
    process_index: int | None = None

    def __init__(self, config: RouterConfig, *, list_pods: ListFunc | None = None) -> None:
        """`list_pods` replaces discovery's Kubernetes API call (tests)."""
        self._config = config
        self._list_pods = list_pods
        self._registry: WorkerRegistry | None = None
        self._health: HealthChecker | None = None
        self.discovery: KubernetesDiscovery | None = None
        self._rollout: Rollout | None = None
        self._hosts: WorkerHosts | None = None

    def attach(self, registry: WorkerRegistry, health: HealthChecker, refresh_gauges: Callable[[], None]) -> None:
        self._registry, self._health = registry, health
        add_configured(registry, self._config)
        self._hosts = WorkerHosts.of(self._config)
        if self._config.kubernetes is not None:
            self.discovery = KubernetesDiscovery(registry, self._config.kubernetes, list_pods=self._list_pods)

    async def start(self) -> None:
        if self.discovery is not None:
            self.discovery.start(asyncio.get_running_loop())

    async def aclose(self) -> None:
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.stop)

    async def add(
        self, url: str, role: Role, bootstrap_port: int | None, revision: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        assert self._registry is not None and self._health is not None and self._hosts is not None, "attach() first"
        try:
            worker = self._registry.add(
                url, role, bootstrap_port=bootstrap_port, source="api", revision=revision, hosts=self._hosts
            )
        except WorkerRegistrationError as exc:
            raise ApiError(400, str(exc), param="url", code="invalid_value") from exc
        # Answered once its first probe ended, or after the liveness timeout with the probe going on
        # (a generation: sglang takes 1 s at best, 20 s at worst).
        await self._health.check(worker, wait_s=self._config.health_timeout_s)
        return 201, worker.to_json()

    def follow(self, rollout: Rollout) -> None:
        self._rollout = rollout

    async def approve(self, revision: str) -> None:
        assert self._rollout is not None, "follow() first"
        if (why := self._rollout.approvable(revision)) is not None:
            raise ApiError(409, why, param="revision", code="not_paired")
        self._rollout.approve(revision)

    async def remove(self, url: str, role: Role | None) -> list[dict[str, Any]]:
        assert self._registry is not None, "attach() first"
        try:
            removed = self._registry.remove(url, role)
        except WorkerRegistrationError as exc:
            raise ApiError(400, str(exc), param="url", code="invalid_value") from exc
        if not removed:
            raise ApiError(404, f"No worker {url} is registered. See GET /workers.", param="url", code="not_found")
        return [w.to_json() for w in removed]
