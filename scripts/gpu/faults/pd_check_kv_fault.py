"""The GPU check's must-fail control: while a flag file exists, the prefill writes one KV page wrongly.

sglang's Mooncake prefill sends a request's KV pages chunk by chunk from its transfer threads,
each chunk through one call of `MooncakeKVManager.send_kvcache(session, prefill_kv_indices,
dst_kv_ptrs, dst_kv_indices, executor, ...)`: position k of `prefill_kv_indices` is the prefill
pool's page that becomes the decode's page `dst_kv_indices[k]` (sglang 0.5.17,
srt/disaggregation/mooncake/conn.py: `transfer_worker` calls it at lines 1675-1683, and
`_send_kvcache_generic`, lines 618-769, turns the two index lists into the Mooncake
`batch_transfer_sync` writes of every layer). `install()` wraps that method. While the file named
by PD_CHECK_KV_FAULT_FLAG exists, a call with two pages or more sends the chunk's first page as its
second (`corrupt`): the decode's second page of the chunk then holds the KV of tokens 0-15 of the
chunk instead of 16-31, in every layer, which is what a misaddressed or stale page looks like.
Every fault, and the wrapping itself, is one JSON line in the file named by PD_CHECK_KV_FAULT_LOG.

The check's control prompts fit one prefill chunk, so each gets exactly one wrong page.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import fault_events  # beside this file
import on_import

FLAG_ENV = "PD_CHECK_KV_FAULT_FLAG"
LOG_ENV = "PD_CHECK_KV_FAULT_LOG"
MODULE = "sglang.srt.disaggregation.mooncake.conn"
CLASS, METHOD = "MooncakeKVManager", "send_kvcache"
ARGUMENT = "prefill_kv_indices"
#: The page of a chunk that is written wrongly, and the page whose KV it gets instead.
DST_PAGE, SRC_PAGE = 1, 0


def log(event: str, **fields: Any) -> None:
    """One JSON line in the fault log (appended; every process of the stack may write)."""
    fault_events.append(os.environ.get(LOG_ENV), event, **fields)


def corrupt(indices: Any) -> Any | None:
    """`indices` with page DST_PAGE sent from page SRC_PAGE's source, or None when the chunk has
    fewer than two pages (then there is nothing to misplace). A copy: sglang's array is untouched."""
    if len(indices) <= DST_PAGE:
        return None
    wrong = indices.copy() if hasattr(indices, "copy") else list(indices)
    wrong[DST_PAGE] = indices[SRC_PAGE]
    return wrong


def faulty(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (send_kvcache) that, while the flag file exists, sends corrupt(prefill_kv_indices)."""
    signature = inspect.signature(method)
    if ARGUMENT not in signature.parameters:
        raise RuntimeError(f"{MODULE}.{CLASS}.{METHOD} has no argument {ARGUMENT!r}: this sglang moved the KV send")

    @functools.wraps(method)
    def send(*args: Any, **kwargs: Any) -> Any:
        flag = os.environ.get(FLAG_ENV)
        if flag and os.path.exists(flag):
            bound = signature.bind(*args, **kwargs)
            pages: Sequence[int] = bound.arguments[ARGUMENT]
            wrong = corrupt(pages)
            if wrong is not None:
                bound.arguments[ARGUMENT] = wrong
                log(
                    "fault",
                    pages=len(pages),
                    dst_page=DST_PAGE,
                    src_page=SRC_PAGE,
                    prefill_pages=[int(p) for p in pages],
                    sent_pages=[int(p) for p in wrong],
                )
                return method(*bound.args, **bound.kwargs)
        return method(*args, **kwargs)

    send.pd_check_fault = True  # type: ignore[attr-defined]
    return send


def patch(module: ModuleType) -> None:
    cls = getattr(module, CLASS)
    original = getattr(cls, METHOD)
    if getattr(original, "pd_check_fault", False):
        return
    setattr(cls, METHOD, faulty(original))
    log("armed", module=module.__name__, target=f"{CLASS}.{METHOD}", argv=sys.argv[:3])


def install() -> None:
    """Patch MODULE now if it is loaded, else as soon as sglang imports it (before any transfer
    thread starts)."""
    on_import.when_imported(MODULE, patch)
