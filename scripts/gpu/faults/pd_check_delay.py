"""The GPU check's injected delays: while a flag file exists, the prefill's forward pass or its KV send
waits that file's number of seconds first.

The TTFT breakdown stage (`scripts/gpu/breakdown_stage.py`) turns each on in turn and asks whether
the router's breakdown blames the part that was slowed. Two places in sglang 0.5.17:

- `prefill`: `Scheduler.run_batch(self, batch, ...)` (srt/managers/scheduler.py), in a server whose
  `disaggregation_mode` is PREFILL. The wait comes before the batch is launched, so it falls
  before the scheduler's `set_prefill_finished_time` (srt/disaggregation/prefill.py, in
  `process_batch_result_disagg_prefill`), inside the router's `prefill` part. sglang's own
  `--forward-sleep-time` does the same in every batch of a server; this one can be switched.
- `transfer`: `MooncakeKVManager.send_kvcache` (srt/disaggregation/mooncake/conn.py), which the
  prefill's transfer threads call per chunk of a request's KV pages, after the forward pass; the
  prefill answers once the pages are sent, so the wait falls in the router's `transfer` part.

The folder named by PD_CHECK_DELAY_DIR holds the flags: `prefill.on` and `transfer.on`, each
holding the seconds to wait. Each wait is one JSON line in `delays.log` there.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import fault_events  # beside this file
import on_import

DIR_ENV = "PD_CHECK_DELAY_DIR"
#: part -> (module, class, method): where each part's wait goes.
TARGETS = {
    "prefill": ("sglang.srt.managers.scheduler", "Scheduler", "run_batch"),
    "transfer": ("sglang.srt.disaggregation.mooncake.conn", "MooncakeKVManager", "send_kvcache"),
}
_MARK = "pd_check_delay"


def seconds(part: str) -> float:
    """The wait the flag of `part` asks for now: 0 without a flag (or an unreadable one)."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return 0.0
    try:
        return max(0.0, float((Path(folder) / f"{part}.on").read_text().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def _is_prefill(scheduler: Any) -> bool:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "prefill"


def delayed(method: Callable[..., Any], part: str) -> Callable[..., Any]:
    """`method` that first waits `seconds(part)`; the forward pass waits only in a prefill server."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait = seconds(part)
        if wait and (part != "prefill" or _is_prefill(self)):
            fault_events.append(str(Path(os.environ[DIR_ENV]) / "delays.log"), "delay", part=part, seconds=wait)
            time.sleep(wait)
        return method(self, *args, **kwargs)

    setattr(wrapper, _MARK, part)
    return wrapper


def _patcher(part: str) -> Callable[[ModuleType], None]:
    _, cls_name, method_name = TARGETS[part]

    def patch(module: ModuleType) -> None:
        cls = getattr(module, cls_name)
        original = getattr(cls, method_name)
        if getattr(original, _MARK, None):
            return
        setattr(cls, method_name, delayed(original, part))
        folder = os.environ.get(DIR_ENV)
        if folder:
            log = str(Path(folder) / "delays.log")
            fault_events.append(log, "armed", part=part, target=f"{cls_name}.{method_name}", argv=sys.argv[:3])

    return patch


def install() -> None:
    """Wrap both targets now where loaded, else as soon as sglang imports them."""
    for part, (module, _, _) in TARGETS.items():
        on_import.when_imported(module, _patcher(part))
