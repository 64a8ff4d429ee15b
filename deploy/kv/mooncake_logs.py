"""Mooncake's log lines that look like failures but are expected, and the note that explains each.

Mooncake logs through glog (`E1201 12:29:22.025556  4764 transfer_metadata.cpp:1098] ...`).
A healthy engine start on TCP prints a few WARNING and ERROR lines that mean nothing is wrong
(docs/mooncake.md says why, with Mooncake's source). `sglang-pd up` keeps every line in the
engine's log and writes one note after the first occurrence of each, so a reader can tell them
from real errors; a later repeat, or any other line, is left as it is.

    annotator = LogAnnotator()
    for line in engine_output:
        write(line)
        note = annotator.note_for(line)
        if note:
            write(note + "\\n")
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["KNOWN_LINES", "NOTE_PREFIX", "KnownLine", "LogAnnotator"]

NOTE_PREFIX = "sglang-pd: the line above is expected"
# glog's prefix: severity and date, time, thread id, then source file and line.
_GLOG = re.compile(r"^[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+ (?P<file>[\w.+-]+):\d+\] (?P<message>.*)$")


@dataclass(frozen=True)
class KnownLine:
    """A Mooncake line that is expected in a healthy run: where it comes from and why it appears."""

    source_file: str  # glog's file name ("" for glog's own notice, which has no prefix)
    message: str  # the start of the message
    why: str

    def matches(self, line: str) -> bool:
        if not self.source_file:
            return line.startswith(self.message)
        m = _GLOG.match(line)
        return m is not None and m["file"] == self.source_file and m["message"].startswith(self.message)


KNOWN_LINES = (
    KnownLine(
        "",
        "WARNING: Logging before InitGoogleLogging() is written to STDERR",
        "glog says once that Mooncake's Python module logs without initialising glog; Mooncake's lines go to stderr",
    ),
    KnownLine(
        "transfer_engine_py.cpp",
        "Using default malloc/free for protocol: tcp",
        "Mooncake's Python binding names the allocator for buffers it would allocate itself; sglang-pd registers "
        "its own KV memory and never uses it",
    ),
    KnownLine(
        "topology.cpp",
        "No RDMA devices found",
        "Mooncake looks for RDMA devices whatever the protocol; with tcp (the local stack's) none is needed; "
        "with rdma it means this host has none",
    ),
    KnownLine(
        "transfer_metadata.cpp",
        "Local segment descriptor not found",
        "once at start with tcp: Mooncake's TCP transport asks for this engine's segment before creating it "
        "and creates it next; a repeat later, during transfers, is a real handshake error",
    ),
)


class LogAnnotator:
    """Notes for one output stream: one per known line, after its first occurrence only."""

    def __init__(self, known: tuple[KnownLine, ...] = KNOWN_LINES) -> None:
        self._pending = list(known)

    def note_for(self, line: str) -> str | None:
        """The note to write after `line`, or None (an unknown line, or a known one seen before)."""
        line = line.rstrip("\r\n")
        for known in self._pending:
            if known.matches(line):
                self._pending.remove(known)
                return f"{NOTE_PREFIX}: {known.why} (docs/mooncake.md)."
        return None
