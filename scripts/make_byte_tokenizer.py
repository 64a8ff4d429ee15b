"""Write the byte-level tokenizer that the GPU smoke model ships with (no download needed).

Ids 0 and 1 are `<s>` and `</s>`, 2..257 are the 256 byte-level symbols of GPT-2's byte-to-unicode
map, so any UTF-8 text round-trips. It is what `deploy/spec/presets/models/tiny-deepseek-v3/` holds;
run it again only to change it:

    python scripts/make_byte_tokenizer.py deploy/spec/presets/models/tiny-deepseek-v3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

SPECIALS = ["<s>", "</s>"]
# A plain chat format: every message on its own tagged block, the assistant's turn left open.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build() -> Tokenizer:
    alphabet = ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for sym in sorted(alphabet):
        vocab[sym] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="model directory to write tokenizer.json and tokenizer_config.json into")
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    build().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[1],
        "add_bos_token": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
