"""A fault's log: one JSON line per event, appended by every process of the stack that the check armed."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_lock = threading.Lock()


def append(path: str | None, event: str, **fields: Any) -> None:
    """One line `{"event", "pid", "time", **fields}` in the file `path` (nothing without a path)."""
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **fields}) + "\n"
    with _lock, open(path, "a") as f:
        f.write(line)
