"""Tokenizers that need no download: byte-level for the tiny model, or the one in a model dir."""

from __future__ import annotations

import codecs
from typing import Any, Protocol

__all__ = ["ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "Tokenizer"]


class Tokenizer(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode_bytes(self, ids: list[int]) -> bytes: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], *, continue_final: bool = False) -> str:
        """The prompt of `messages` (string content); ValueError if the template cannot render them.
        `continue_final`: the prompt ends inside the last (assistant) message, which the model goes on
        writing (sglang's `continue_final_message`), instead of opening a new one."""
        ...


class ByteTokenizer:
    """UTF-8 bytes shifted by two: 0 is BOS, 1 is EOS, 2..257 are bytes; other ids decode to nothing."""

    OFFSET = 2
    bos_token_id = 0
    eos_token_id: int | None = 1

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, continue_final: bool = False) -> str:
        """Messages with string content (`chat.template_messages`) as one prompt."""
        if continue_final:
            *head, last = messages
            return self.apply_chat_template(head)[: -len("<|assistant|>\n")] + f"<|{last['role']}|>\n{last['content']}"
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"


class HFTokenizer:
    """The tokenizer saved in a local model directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode_bytes(self, ids: list[int]) -> bytes:
        return str(self._tok.decode(ids, skip_special_tokens=True)).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, continue_final: bool = False) -> str:
        if not getattr(self._tok, "chat_template", None):
            return ByteTokenizer().apply_chat_template(messages, continue_final=continue_final)
        import jinja2  # transformers renders chat templates with it

        try:
            return str(
                self._tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=not continue_final,
                    continue_final_message=continue_final,
                )
            )
        except (jinja2.TemplateError, TypeError) as exc:  # sglang's `_CHAT_TEMPLATE_CLIENT_ERRORS`
            raise ValueError(f"The chat template cannot render these messages: {exc}") from exc


class IncrementalDetokenizer:
    """Text deltas for streaming: never splits a multi-byte character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._byte_level = isinstance(tokenizer, ByteTokenizer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        if self._byte_level:
            delta = self._decoder.decode(self._tok.decode_bytes([token_id]))
        else:
            self._ids.append(token_id)
            full = self._tok.decode_bytes(self._ids).decode("utf-8", errors="replace").rstrip("\ufffd")
            delta = full[len(self.text) :]
        self.text += delta
        return delta
