"""Keep a passing report in a ConfigMap (`--publish-baseline NAME`), the baseline of the next rollout.

Runs inside a pod: the Kubernetes API is reached with the pod's service-account token, as every
in-cluster client does (`KUBERNETES_SERVICE_HOST`, the token, CA and namespace files under
/var/run/secrets/kubernetes.io/serviceaccount). The report is stored without the model outputs (a
ConfigMap holds at most 1 MiB) under the key `report.json`, by a JSON merge patch of `data` only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .errors import EvalError

__all__ = ["BASELINE_KEY", "MAX_CONFIGMAP_BYTES", "InCluster", "PublishError", "in_cluster", "publish_baseline"]

BASELINE_KEY = "report.json"
# The API server refuses a ConfigMap whose data exceeds 1 MiB; keep room for metadata.
MAX_CONFIGMAP_BYTES = 1_000_000
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class PublishError(EvalError):
    """The report could not be stored in the ConfigMap."""


@dataclass(frozen=True, slots=True)
class InCluster:
    """Where the API server is and how this pod authenticates to it."""

    api_url: str
    namespace: str
    token: str = field(repr=False)
    # The CA bundle that signs the API server's certificate (None: plain http, for tests).
    ca_path: Path | None = None


def in_cluster(service_account: Path = SERVICE_ACCOUNT) -> InCluster:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise PublishError("--publish-baseline works only inside a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset).")
    try:
        token = (service_account / "token").read_text().strip()
        namespace = (service_account / "namespace").read_text().strip()
    except OSError as exc:
        raise PublishError(
            f"Cannot read the pod's service-account token under {service_account} ({exc.strerror or exc}); "
            "set automountServiceAccountToken: true on the gate's pod."
        ) from exc
    host = f"[{host}]" if ":" in host else host
    return InCluster(f"https://{host}:{port}", namespace, token, service_account / "ca.crt")


def publish_baseline(configmap: str, report_json: str, cluster: InCluster, *, timeout_s: float = 30.0) -> None:
    """Store `report_json` in `configmap` (which must exist: the chart creates it) under BASELINE_KEY."""
    size = len(report_json.encode())
    if size > MAX_CONFIGMAP_BYTES:
        raise PublishError(
            f"The report is {size} bytes, more than a ConfigMap holds ({MAX_CONFIGMAP_BYTES}); ask fewer questions."
        )
    url = f"{cluster.api_url}/api/v1/namespaces/{cluster.namespace}/configmaps/{configmap}"
    headers = {"Authorization": f"Bearer {cluster.token}", "Content-Type": "application/merge-patch+json"}
    verify: bool | str = str(cluster.ca_path) if cluster.ca_path is not None else True
    try:
        response = httpx.patch(
            url, json={"data": {BASELINE_KEY: report_json}}, headers=headers, timeout=timeout_s, verify=verify
        )
    except httpx.HTTPError as exc:
        raise PublishError(f"Cannot reach the Kubernetes API at {url} ({type(exc).__name__}: {exc}).") from exc
    if response.status_code in (401, 403):
        raise PublishError(
            f"The Kubernetes API refused to patch ConfigMap {cluster.namespace}/{configmap} "
            f"(HTTP {response.status_code}); the gate's ServiceAccount needs get/patch on it "
            "(the chart's gate.baseline Role grants it)."
        )
    if response.status_code == 404:
        raise PublishError(
            f"ConfigMap {cluster.namespace}/{configmap} does not exist; "
            "the chart creates it when gate.baseline.enabled is true."
        )
    if response.status_code >= 300:
        raise PublishError(
            f"Patching ConfigMap {cluster.namespace}/{configmap} failed: "
            f"HTTP {response.status_code} {response.text[:300]}"
        )
