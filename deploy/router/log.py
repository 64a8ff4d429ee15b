"""Structured logs: one JSON object a line, with the ids of the request being served: the router's
own (`request_id`, the id the engines know it by) and the client's X-Request-ID, when it sent one
(`client_request_id`). The line is the one format of `up`'s components (deploy/common/logs.py:
`ts` in ISO-8601 UTC)."""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import Any

import orjson

from sglang_pd.deploy.common.logs import JsonFormatter as _CommonFormatter

__all__ = ["JsonFormatter", "client_request_id_var", "configure_logging", "logger", "request_id_var"]

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
client_request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("client_request_id", default="")
logger = logging.getLogger("sglang_pd.router")


class JsonFormatter(_CommonFormatter):
    """The common line (deploy/common/logs.py) with the request's ids."""

    def format(self, record: logging.LogRecord) -> str:
        entry = self.entry(record)
        rid = request_id_var.get()
        if rid:
            entry.setdefault("request_id", rid)
        if client_rid := client_request_id_var.get():
            entry.setdefault("client_request_id", client_rid)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str = "info", fields: dict[str, Any] | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(fields))
    root = logging.getLogger("sglang_pd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.Formatter.converter = time.gmtime
