"""Write the character tokenizer of the single-h200 model: every id decodes, alone, to a string of its own.

The GPU check compares outputs by token id in every request form, and sglang's streamed chat
returns no ids: sglang 0.5.17 refuses `return_token_ids` with `stream`
(`_convert_to_internal_request` in srt/entrypoints/openai/serving_chat.py, lines 914-925). It does
return each token's text with `logprobs`, decoded id by id (`detokenize_logprob_tokens` in
srt/managers/tokenizer_manager.py, lines 2699-2717). With this vocabulary that text names the id:
`<s>`, `</s>`, `<unk>`, then one character per id (printable ASCII, newline and tab, then CJK
ideographs from U+4E00 up to the config's vocab_size); ASCII input is one token a character, any
other character `<unk>`.

    python scripts/gpu/char_tokenizer.py deploy/spec/presets/models/tiny-deepseek-v3-bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models

SPECIALS = ["<s>", "</s>", "<unk>"]
# A plain chat format: every message on its own tagged block, the assistant's turn left open.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FIRST_EXTRA = 0x4E00  # CJK ideographs: one code point each, printable, untouched by normalization


def characters(vocab_size: int) -> list[str]:
    """The vocabulary, id by id."""
    ascii_ = [chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t"]
    extra = vocab_size - len(SPECIALS) - len(ascii_)
    if extra < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: the tokenizer needs at least {-extra} more ids")
    return SPECIALS + ascii_ + [chr(FIRST_EXTRA + i) for i in range(extra)]


def build(vocab_size: int) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(characters(vocab_size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # the characters side by side, no separator
    tok.add_special_tokens(SPECIALS)
    return tok


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "unk_token": SPECIALS[2],
        "pad_token": SPECIALS[1],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }


def write(model_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json for `model_dir/config.json`'s vocab_size."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    build(vocab_size).save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a model folder whose config.json gives vocab_size")
    write(parser.parse_args().model_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
