"""The PD router: OpenAI-compatible, speaks SGLang's prefill/decode protocol (FastAPI + uvicorn)."""

from __future__ import annotations

from .app import RouterApp, create_app
from .config import KubernetesDiscoveryConfig, RouterConfig
from .exceptions import (
    NoHealthyWorker,
    RouterError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnreachable,
    WorkerRegistrationError,
)

__all__ = [
    "KubernetesDiscoveryConfig",
    "NoHealthyWorker",
    "RouterApp",
    "RouterConfig",
    "RouterError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnreachable",
    "WorkerRegistrationError",
    "create_app",
]
