"""The one log line format of `up`'s components (the router, the reference engines and `up`'s own
log file): one JSON object a line, opening with `ts` (ISO-8601, UTC, microseconds:
`2026-12-06T01:02:03.456789Z`), `level`, `logger` and `msg`, then the record's own fields.

A message that is itself a JSON object (the reference engine logs its events so) is merged into
the line: its keys sit beside `ts` and `level` instead of inside a quoted `msg`. Lines that other
libraries write straight to the stream (Mooncake's glog lines, progress bars) keep their format.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

__all__ = ["JsonFormatter", "configure_json_logging", "iso_ts"]

# The record's own attributes, and uvicorn's `color_message` (the message again, with terminal colours).
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "color_message"}


def iso_ts(created: float) -> str:
    """`created` (seconds since the epoch) as ISO-8601 UTC with microseconds and a `Z`."""
    return datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class JsonFormatter(logging.Formatter):
    def __init__(self, fields: dict[str, Any] | None = None) -> None:
        """`fields`: added to every line (a router serving process's index, say)."""
        super().__init__()
        self.fields = fields or {}

    def entry(self, record: logging.LogRecord) -> dict[str, Any]:
        """The line's object, before any fields a subclass adds."""
        msg = record.getMessage()
        entry: dict[str, Any] = {"ts": iso_ts(record.created), "level": record.levelname.lower(), "logger": record.name}
        merged = None
        if msg.startswith("{") and msg.endswith("}"):
            try:
                merged = orjson.loads(msg)
            except orjson.JSONDecodeError:
                merged = None
        if isinstance(merged, dict):
            entry.update((k, v) for k, v in merged.items() if k not in ("ts", "level", "logger"))
        else:
            entry["msg"] = msg
        entry.update(self.fields)
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return entry

    def format(self, record: logging.LogRecord) -> str:
        return orjson.dumps(self.entry(record), default=str).decode()


def configure_json_logging(
    level: str = "info", *, names: tuple[str, ...] = ("",), stream: TextIO | None = None
) -> logging.Handler:
    """Send the loggers `names` ("": the root, so uvicorn's too) to `stream` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in names:
        target = logging.getLogger(name)
        target.handlers[:] = [handler]
        target.setLevel(level.upper())
    return handler
