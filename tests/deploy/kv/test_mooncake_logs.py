"""The notes after Mooncake's expected lines, on lines a real engine printed (Mooncake 0.3.13.post1, TCP)."""

from __future__ import annotations

import pytest

from sglang_pd.deploy.kv.mooncake_logs import KNOWN_LINES, NOTE_PREFIX, LogAnnotator

# A reference engine's start on loopback, as written to its log by `sglang-pd up local-cpu`.
HEALTHY_START = """\
WARNING: Logging before InitGoogleLogging() is written to STDERR
W1201 12:31:28.266018  6418 transfer_engine_py.cpp:120] Using default malloc/free for protocol: tcp
I1201 12:31:28.266321  6418 transfer_engine_impl.cpp:1046] Metrics reporting is disabled (set MC_TE_METRIC=1 to enable)
I1201 12:31:28.266383  6418 transfer_engine_impl.cpp:116] Transfer Engine parseHostNameWithPort. server_name: 127.0.0.1 port: 12001
I1201 12:31:28.266541  6418 transfer_engine_impl.cpp:183] Transfer Engine RPC using P2P handshake, listening on 127.0.0.1:16260
I1201 12:31:28.266695  6418 transfer_engine_impl.cpp:259] Auto-discovering topology...
W1201 12:31:28.266817  6418 topology.cpp:201] No RDMA devices found, check your device installation
I1201 12:31:28.266897  6418 transfer_engine_impl.cpp:274] Topology discovery complete. Found 0 HCAs.
E1201 12:31:28.266955  6418 transfer_metadata.cpp:1098] Local segment descriptor not found
I1201 12:31:28.267009  6418 tcp_transport.cpp:391] TcpTransport: listen on port 16979
kv engine opened
""".splitlines()  # noqa: E501 (real lines, verbatim)

# Real failures: a write to a peer that is down (this machine), and a rejected address (a
# user's report on Mooncake's tracker, kvcache-ai/Mooncake#602). They must stay unexplained.
REAL_ERRORS = [
    "E1201 12:31:58.629055  6846 transfer_metadata_plugin.cpp:1030] SocketHandShakePlugin: "
    "connect()127.0.0.1:23999: Connection refused [111]",
    "E0708 09:26:26.525108   368 tcp_transport.cpp:136] Session::writeBody failed. Error: Bad address "
    "(value: 14), total_transferred_bytes_: 0, current transferred_bytes: 0",
]


def _annotate(lines: list[str], annotator: LogAnnotator | None = None) -> list[str]:
    annotator = annotator or LogAnnotator()
    out = []
    for line in lines:
        out.append(line)
        note = annotator.note_for(line + "\n")
        if note:
            out.append(note)
    return out


def test_each_expected_line_of_a_healthy_start_gets_one_note_right_after_it() -> None:
    out = _annotate(HEALTHY_START)

    notes = [i for i, line in enumerate(out) if line.startswith(NOTE_PREFIX)]
    explained = [out[i - 1] for i in notes]
    assert len(notes) == len(KNOWN_LINES) == 4
    assert explained == [
        HEALTHY_START[0],  # glog's notice
        HEALTHY_START[1],  # malloc/free
        HEALTHY_START[6],  # no RDMA devices
        HEALTHY_START[8],  # E... Local segment descriptor not found
    ]
    assert [line for line in out if not line.startswith(NOTE_PREFIX)] == HEALTHY_START  # nothing lost or changed
    assert all(out[i].endswith("(docs/mooncake.md).") for i in notes)
    assert "real handshake error" in out[notes[-1]]  # the note says when the same text is not benign


def test_a_repeat_is_left_unexplained() -> None:
    annotator = LogAnnotator()
    once = _annotate(HEALTHY_START, annotator)
    again = _annotate(HEALTHY_START, annotator)
    assert len(once) == len(HEALTHY_START) + len(KNOWN_LINES)
    assert again == HEALTHY_START  # a second "Local segment descriptor not found" stays bare


@pytest.mark.parametrize("line", REAL_ERRORS)
def test_real_errors_get_no_note(line: str) -> None:
    assert LogAnnotator().note_for(line) is None


@pytest.mark.parametrize(
    "line",
    [
        # The known text from another source file, or without glog's prefix, is not the known line.
        "E1201 12:31:28.266955  6418 tcp_transport.cpp:77] Local segment descriptor not found",
        "Local segment descriptor not found",
        "W1201 12:31:28.266018  6418 transfer_engine_py.cpp:120] Using default malloc/free for protocol: rdma",
    ],
)
def test_lookalikes_get_no_note(line: str) -> None:
    assert LogAnnotator().note_for(line) is None


def test_each_stream_notes_on_its_own() -> None:
    line = HEALTHY_START[8]
    first, second = LogAnnotator(), LogAnnotator()
    assert first.note_for(line) is not None
    assert second.note_for(line) is not None  # a restarted engine's log gets its own notes
