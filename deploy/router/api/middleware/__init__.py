"""Pure ASGI middleware, one concern a file: `__init__(app, **opts)` plus `async __call__`."""

from __future__ import annotations

from .admission import AdmissionMiddleware
from .auth import ADMIN_SCOPE_KEY, AuthMiddleware
from .body_limit import BodyLimitMiddleware

__all__ = ["ADMIN_SCOPE_KEY", "AdmissionMiddleware", "AuthMiddleware", "BodyLimitMiddleware"]
