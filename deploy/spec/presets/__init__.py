"""Topology presets shipped with sglang-pd, and the model configs they point at."""

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent
