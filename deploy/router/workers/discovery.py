"""Kubernetes discovery: watch pods by label selector (one selector per role) and keep the registry
in step. A pod counts when it is Running, Ready and has an IP; its HTTP port comes from the
`port_annotation` (or the configured default), a prefill pod's bootstrap port from the
`bootstrap_port_annotation` (or 8998), its revision from the `sglang-pd/revision` label the chart sets
(deploy/spec/revision.py; none: unknown, pairing only with unlabelled pods). The default selectors
pick the leader pods labelled as the chart labels them (`contract.worker_selector`).

The watch uses the `kubernetes` client (synchronous) in a thread per role; events are applied on
the event loop. `apply_event()` is pure registry bookkeeping, so recorded watch events test it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from sglang_pd.deploy.common.contract import DEFAULT_BOOTSTRAP_PORT
from sglang_pd.deploy.spec.revision import REVISION_LABEL

from ..config import KubernetesDiscoveryConfig
from ..exceptions import WorkerRegistrationError
from ..log import logger
from ..types import Role
from .registry import WorkerRegistry

__all__ = ["KubernetesDiscovery", "pod_endpoint", "pod_revision"]

ListFunc = Callable[..., Any]


def _annotation_int(annotations: dict[str, str], key: str, default: int) -> int:
    value = annotations.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        logger.warning("bad port annotation", extra={"annotation": key, "value": value})
        return default


def pod_endpoint(pod: dict[str, Any], role: Role, config: KubernetesDiscoveryConfig) -> tuple[str, int | None] | None:
    """(url, bootstrap_port) of a ready pod, or None when the pod cannot take traffic."""
    status = pod.get("status") or {}
    metadata = pod.get("metadata") or {}
    if metadata.get("deletionTimestamp"):
        return None
    ip = status.get("podIP")
    if status.get("phase") != "Running" or not ip:
        return None
    conditions = status.get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return None
    annotations = metadata.get("annotations") or {}
    port = _annotation_int(annotations, config.port_annotation, config.port)
    host = f"[{ip}]" if ":" in ip else ip
    bootstrap = (
        _annotation_int(annotations, config.bootstrap_port_annotation, DEFAULT_BOOTSTRAP_PORT)
        if role == "prefill"
        else None
    )
    return f"http://{host}:{port}", bootstrap


def pod_revision(pod: dict[str, Any]) -> str:
    """The revision the pod's label names ("" when it has none)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(REVISION_LABEL) or "")


class KubernetesDiscovery:
    def __init__(
        self,
        registry: WorkerRegistry,
        config: KubernetesDiscoveryConfig,
        *,
        list_pods: ListFunc | None = None,
        watch_timeout_s: int = 300,
    ) -> None:
        self.registry = registry
        self.config = config
        self._list_pods = list_pods
        self.watch_timeout_s = watch_timeout_s
        # pod name -> (url, bootstrap port, revision) we registered for it, per role
        self._pods: dict[Role, dict[str, tuple[str, int | None, str]]] = {"prefill": {}, "decode": {}}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watches: list[Any] = []

    def apply_event(self, role: Role, event: dict[str, Any]) -> None:
        """Apply one watch event (`{"type", "object", "raw_object"}`) to the registry."""
        kind = event.get("type")
        pod = event.get("raw_object")
        if not isinstance(pod, dict):
            obj: Any = event.get("object")
            pod = obj.to_dict() if hasattr(obj, "to_dict") else obj
            if not isinstance(pod, dict):
                return
        name = (pod.get("metadata") or {}).get("name")
        if not name or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        known = self._pods[role].get(name)
        found = None if kind == "DELETED" else pod_endpoint(pod, role, self.config)
        endpoint = None if found is None else (*found, pod_revision(pod))
        if known is not None and known != endpoint:
            del self._pods[role][name]
            if not any(ep[0] == known[0] for ep in self._pods[role].values()):
                self.registry.remove(known[0], role)
            logger.info("discovery removed worker", extra={"pod": name, "role": role, "worker": known[0]})
        if endpoint is not None and known != endpoint:
            try:
                self.registry.add(
                    endpoint[0], role, bootstrap_port=endpoint[1], source="kubernetes", revision=endpoint[2]
                )
            except WorkerRegistrationError as exc:
                logger.warning("discovery skipped pod", extra={"pod": name, "error": str(exc)})
                return
            self._pods[role][name] = endpoint
            logger.info(
                "discovery added worker",
                extra={"pod": name, "role": role, "worker": endpoint[0], "revision": endpoint[2]},
            )

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        list_pods = self._list_pods or _default_list_pods()
        for role, selector in (
            ("prefill", self.config.prefill_selector),
            ("decode", self.config.decode_selector),
        ):
            thread = threading.Thread(
                target=self._run,
                args=(loop, list_pods, role, selector),
                name=f"k8s-watch-{role}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for watch in self._watches:
            with contextlib.suppress(Exception):
                watch.stop()
        for thread in self._threads:
            thread.join(timeout=2.0)

    def _run(self, loop: asyncio.AbstractEventLoop, list_pods: ListFunc, role: Role, selector: str) -> None:
        from kubernetes import watch as k8s_watch

        backoff = 1.0
        while not self._stop.is_set():
            w = k8s_watch.Watch(return_type="V1Pod")
            self._watches.append(w)
            try:
                for event in w.stream(
                    list_pods,
                    namespace=self.config.namespace,
                    label_selector=selector,
                    timeout_seconds=self.watch_timeout_s,
                ):
                    if self._stop.is_set():
                        break
                    loop.call_soon_threadsafe(self.apply_event, role, event)
                backoff = 1.0
            except Exception as exc:
                logger.warning("kubernetes watch failed; retrying", extra={"role": role, "error": str(exc)})
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)
            finally:
                self._watches.remove(w)
            # A new watch replays the current pods as ADDED events, which apply idempotently. A pod
            # deleted between two watches stays registered until health checks mark it unhealthy.
            self._stop.wait(0.05)


def _default_list_pods() -> ListFunc:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api().list_namespaced_pod
