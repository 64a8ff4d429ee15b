"""The gate's side of a rollout through the sglang-pd router (router/workers/rollout.py).

`--revision REV` scores one revision only: every question carries `x-sglpd-revision: REV`, which the router
honours with its admin key alone (the gate gives it as --api-key). Before the first question the gate reads
`GET /admin/revisions` and waits, within --wait-ready, until REV has a healthy pair there. `--approve` then
approves REV after a clean pass (`POST /admin/revisions/approve`), and on any other outcome holds it: client
requests stay on the revision approved before.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from .errors import EndpointError, UsageError

__all__ = ["PIN_HEADER", "approve", "router_root", "wait_paired"]

PIN_HEADER = "x-sglpd-revision"
_TIMEOUT_S = 10.0


def router_root(base_url: str) -> str:
    """The router's own URL: the OpenAI base URL without its /v1."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _call(url: str, key: str | None, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            answer = json.loads(exc.read() or b"{}")
        except ValueError:
            answer = {}
        return exc.code, answer


def _message(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    return str(error.get("message", "")) if isinstance(error, dict) else ""


def _refused(status: int, url: str, answer: dict[str, Any]) -> UsageError:
    return UsageError(
        f"--revision needs the router's admin key as --api-key: {url} answered {status} "
        f"({_message(answer) or 'no message'})."
    )


def wait_paired(base_url: str, key: str | None, revision: str, wait_s: float, *, poll_s: float = 2.0) -> None:
    """Return once the router lists `revision` with a healthy pair; UsageError when it refuses the key,
    EndpointError when the revision has no pair after `wait_s`."""
    url = router_root(base_url) + "/admin/revisions"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status, answer = _call(url, key)
        except (OSError, ValueError) as exc:
            status, answer, problem = 0, {}, f"{url} did not answer ({type(exc).__name__}: {exc})"
        else:
            if status in (401, 403):
                raise _refused(status, url, answer)
            listed = {r.get("revision"): r for r in answer.get("revisions", [])} if status == 200 else {}
            if listed.get(revision, {}).get("paired"):
                return
            shown = ", ".join(f"{r} ({v.get('state')})" for r, v in listed.items()) or "none"
            problem = (
                f"revision {revision} has no healthy prefill and decode pair in the router (its revisions: {shown})"
                if status == 200
                else f"{url} answered {status} ({_message(answer) or 'no message'})"
            )
        if time.monotonic() >= deadline:
            raise EndpointError(f"{problem}; no question was asked (--wait-ready {wait_s:g} s).")
        time.sleep(poll_s)


def approve(base_url: str, key: str | None, revision: str) -> dict[str, Any]:
    """Approve `revision` in the router: client requests go to it from now on. EndpointError naming the router's
    answer when it refuses."""
    url = router_root(base_url) + "/admin/revisions/approve"
    try:
        status, answer = _call(url, key, {"revision": revision})
    except (OSError, ValueError) as exc:
        raise EndpointError(f"approving revision {revision} failed: {url}: {type(exc).__name__}: {exc}") from exc
    if status != 200:
        raise EndpointError(
            f"the router refused to approve revision {revision}: {status} {_message(answer) or 'no message'}"
        )
    return answer
