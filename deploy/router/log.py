"""Structured logs: one JSON object a line, with the ids of the request being served: the router's
own (`request_id`, the id the engines know it by) and the client's X-Request-ID, when it sent one
(`client_request_id`)."""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["JsonFormatter", "client_request_id_var", "configure_logging", "logger", "request_id_var"]

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
client_request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("client_request_id", default="")
logger = logging.getLogger("sglang_pd.router")

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        """`fields`: added to every line (a serving process's index in a router process group)."""
        super().__init__()
        self.fields = fields or {}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.fields,
        }
        rid = request_id_var.get()
        if rid:
            entry["request_id"] = rid
        if client_rid := client_request_id_var.get():
            entry["client_request_id"] = client_rid
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str = "info", fields: dict[str, Any] | None = None) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(fields))
    root = logging.getLogger("sglang_pd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.Formatter.converter = time.gmtime
