"""Paths of the repository that tests read: the recorded sglang answers and the shared data."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What real sglang answered and accepted, recorded on the GPU machine (scripts/gpu/record_sglang_http.py).
SGLANG_RECORDINGS = Path(__file__).resolve().parent / "sglang_recordings"
