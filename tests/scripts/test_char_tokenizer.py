"""The single-h200 model's tokenizer (scripts/gpu/char_tokenizer.py): every token id decodes, alone,
to a text of its own, so the GPU check reads ids from a streamed chat's logprobs."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from sglang_pd.deploy.spec.topology import PRESETS_DIR

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts/gpu"))
check = importlib.import_module("gpu_pd_check")
char_tokenizer = importlib.import_module("char_tokenizer")

MODEL_DIR = PRESETS_DIR / "models/tiny-deepseek-v3-bf16"
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]


def test_the_committed_tokenizer_is_what_the_script_writes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((MODEL_DIR / "config.json").read_text())
    char_tokenizer.write(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((MODEL_DIR / name).read_text()), name


def test_every_id_the_model_can_output_has_its_own_text() -> None:
    table = check.token_table(MODEL_DIR)  # what the GPU check builds, with transformers' tokenizer
    assert sorted(table.values()) == list(range(VOCAB))
    ids, error = check._ids_from_logprobs([{"token": t} for t in ("Q", "\u4e00", "</s>")], table)
    assert error is None and ids == [table["Q"], 100, 1]
    ids, error = check._ids_from_logprobs([{"token": "\u2603"}], table)  # a text no id has
    assert ids is None and error is not None and "names no id" in error


def test_a_tokenizer_whose_ids_share_a_text_is_refused(tmp_path: Path) -> None:
    # The byte tokenizer the model had before: ids of bytes >= 0x80 decode alone to the same U+FFFD.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((PRESETS_DIR / "models/tiny-deepseek-v3" / name).read_text())
    with pytest.raises(RuntimeError, match="share their text with another"):
        check.token_table(tmp_path)


def test_ascii_prompts_are_one_token_a_character() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    for prompt in (*check.prompts(), *check.control_prompts(), *check.CONTEXT_PAIR):
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) == len(prompt) and 2 not in ids  # one a character, no <unk>
        assert tokenizer.decode(ids) == prompt
    assert char_tokenizer.characters(VOCAB)[2] == "<unk>"
    with pytest.raises(ValueError, match="too small"):
        char_tokenizer.characters(50)
