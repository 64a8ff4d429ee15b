"""Topology presets shipped with sglang-pd, and the model configs they point at."""

from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parent

# The reference engine's DeepSeek-V3-shaped model (MLA + MoE) with seeded random weights: its text is noise.
TINY_MODEL = "tiny-deepseek-v3"


def has_random_weights(model: str | None) -> bool:
    """Whether a reference engine's `--model` builds a model with random weights, whose text is noise:
    `tiny-deepseek-v3` or a DeepSeek-V3 config `.json` (deploy/refengine/sources.py)."""
    return model == TINY_MODEL or (model is not None and Path(model).suffix == ".json")
