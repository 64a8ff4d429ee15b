"""The PD router: OpenAI-compatible, speaks SGLang's prefill/decode protocol (FastAPI + uvicorn)."""

from __future__ import annotations

from .app import RouterApp, create_app
from .config import KubernetesDiscoveryConfig, RouterConfig
from .exceptions import (
    ClientGone,
    NoHealthyWorker,
    RouterError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
    WorkerRegistrationError,
)
from .transport.client import HttpWorkerClient, Timeouts, WorkerClient

__all__ = [
    "ClientGone",
    "HttpWorkerClient",
    "KubernetesDiscoveryConfig",
    "NoHealthyWorker",
    "RouterApp",
    "RouterConfig",
    "RouterError",
    "Timeouts",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "WorkerClient",
    "WorkerRegistrationError",
    "create_app",
]
