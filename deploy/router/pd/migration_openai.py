"""Request migration on the OpenAI routes: streamed `/v1/completions` and `/v1/chat/completions`.

The streamed `/generate` is migration.py's. The OpenAI routes stream text deltas, so the router
asks the decode leg (only) for what a continuation needs, and strips it from what the client sees
unless the client asked for it:

- `/v1/completions`: `return_token_ids` (sglang's `CompletionRequest` field: each chunk's choice
  carries its new token ids, the first one the prompt's too; `serving_completions.py`). The
  continuation is the same request with `prompt` = the prompt's ids + the ids delivered, and
  `max_tokens` less what was generated. Greedy answers are token-identical to an uninterrupted run.
- `/v1/chat/completions`: sglang refuses token ids on a streamed chat (`serving_chat.py`,
  "return_token_ids is not supported with streaming"), so the continuation is made of text: the
  messages plus an assistant message holding the text delivered, with `continue_final_message`
  (sglang's field: the template ends inside that message, which the model goes on writing). The
  tokens the decode generated are counted with `stream_options.continuous_usage_stats` (every
  chunk carries the usage so far). The continuation's prompt is the delivered text tokenized
  again, which equals the generated ids where the tokenizer gives back the ids it decoded.

After a move the new decode's chunks are rewritten: the stream's first `id` and `created`, usage
with the client's prompt tokens and every completion token counted once, no second `role` delta,
and the prompt ids (when the client asked for them) only in the first chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..exceptions import UpstreamStatusError
from ..workers.registry import Worker
from .migration import Migration, migratable

__all__ = ["ChatMigration", "CompletionMigration", "migration_for"]

# sglang's `CompletionRequest.max_tokens` default (`entrypoints/openai/protocol.py`).
DEFAULT_COMPLETION_MAX_TOKENS = 16
_CHAT_BUDGET_KEYS = ("max_completion_tokens", "max_tokens")


def migration_for(endpoint: str, payload: Mapping[str, Any]) -> Migration | None:
    """The migration state of a streamed request that can move mid-stream, None for one that cannot."""
    if not payload.get("stream") or payload.get("n") not in (None, 1):
        return None
    if endpoint == "/generate":
        return Migration(payload) if migratable(endpoint, payload) else None
    if endpoint == "/v1/completions":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = isinstance(prompt, list) and bool(prompt) and all(type(i) is int for i in prompt)
        if not (isinstance(prompt, str) or ids) or payload.get("echo") or payload.get("suffix"):
            return None
        if payload.get("best_of") not in (None, 1):
            return None
        return CompletionMigration(payload)
    if endpoint == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return None
        if payload.get("tools") or (payload.get("response_format") or {}).get("type") not in (None, "text"):
            return None  # a tool call or a grammar cannot go on from text
        if payload.get("continue_final_message") and not isinstance(messages[-1].get("content"), str):
            return None
        return ChatMigration(payload)
    return None


def _error(obj: dict[str, Any], worker: Worker, data: bytes) -> None:
    if "error" in obj or obj.get("object") == "error":
        detail = obj.get("error", obj)
        raise UpstreamStatusError(f"decode worker {worker.url} sent an error event: {detail}", worker, 500, data)


class _OpenAIMigration(Migration):
    """What the two OpenAI routes share: the stream's id and created time, and its usage."""

    __slots__ = ("created", "extra", "offset_tokens", "tokens")

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        self.prompt_ids = None
        self.added_prompt_ids = False
        self.created: Any = None
        self.tokens = 0  # completion tokens the client has received
        self.offset_tokens = 0  # those it had when the current decode took over
        self.extra: dict[str, Any] = {}

    def decode_extra(self) -> dict[str, Any]:
        return self.extra

    def moved(self) -> None:
        super().moved()
        self.offset_tokens = self.tokens
        if self.prompt_tokens is None and self.prompt_ids is not None:
            self.prompt_tokens = len(self.prompt_ids)  # the client's prompt, not the continuation's

    def _event(self, event: bytes, worker: Worker) -> bytes:
        data = event.strip()
        if not data.startswith(b"data:") or data == b"data: [DONE]":
            return event + b"\n\n"
        obj = orjson.loads(data[5:])
        if not isinstance(obj, dict):
            return event + b"\n\n"
        _error(obj, worker, data)
        usage = obj.get("usage")
        if not self.moves:
            self.response_id = obj.get("id", self.response_id)
            self.created = obj.get("created", self.created)
            if isinstance(usage, dict) and self.prompt_tokens is None:
                self.prompt_tokens = usage.get("prompt_tokens")
        keep = self._choices(obj)
        usage = obj.get("usage")  # the client's usage: the new decode's counted from the stream's start
        if self.moves and isinstance(usage, dict):
            done = self.offset_tokens + int(usage.get("completion_tokens") or 0)
            prompt = self.prompt_tokens if self.prompt_tokens is not None else usage.get("prompt_tokens", 0)
            usage.update(prompt_tokens=prompt, completion_tokens=done, total_tokens=int(prompt or 0) + done)
        if not keep:
            return b""
        if not self.moves and not self.extra:
            return event + b"\n\n"  # unchanged: pass the worker's own bytes on
        if self.moves:
            obj["id"], obj["created"] = self.response_id, self.created
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _choices(self, obj: dict[str, Any]) -> bool:
        """Record and rewrite the chunk's choices; False drops the chunk."""
        raise NotImplementedError("The '_choices' method must be implemented.")


class CompletionMigration(_OpenAIMigration):
    """A streamed `/v1/completions` request: continued from the prompt's ids and the ids delivered."""

    __slots__ = ()

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
            self.prompt_ids = list(prompt)
        self.added_prompt_ids = not payload.get("return_token_ids")
        self.extra = {"return_token_ids": True} if self.added_prompt_ids else {}

    def _choices(self, obj: dict[str, Any]) -> bool:
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if self.added_prompt_ids:
                ids, prompt_ids = choice.pop("token_ids", None), choice.pop("prompt_token_ids", None)
            else:
                ids, prompt_ids = choice.get("token_ids"), choice.get("prompt_token_ids")
                if self.moves:
                    choice.pop("prompt_token_ids", None)  # the continuation's: the client has its own
            if self.prompt_ids is None and isinstance(prompt_ids, list):
                self.prompt_ids = prompt_ids
            if isinstance(ids, list):
                self.ids.extend(ids)
                self.tokens = len(self.ids)
            if self.moves:
                _shift_offsets(choice.get("logprobs"), len(self.offset_text))
            self.text += str(choice.get("text") or "")
            if choice.get("finish_reason") is not None:
                self.finished = True
        return True

    def resume_payload(self) -> dict[str, Any] | None:
        if self.prompt_ids is None:
            return None
        body = {k: v for k, v in self.payload.items() if k not in ("prompt", "rid")}
        budget = self.payload.get("max_tokens")
        left = (DEFAULT_COMPLETION_MAX_TOKENS if budget is None else int(budget)) - len(self.ids)
        if left <= 0:
            return None
        body["max_tokens"] = left
        if self.payload.get("min_tokens"):
            body["min_tokens"] = max(0, int(self.payload["min_tokens"]) - len(self.ids))
        body["prompt"] = self.prompt_ids + self.ids
        return body


class ChatMigration(_OpenAIMigration):
    """A streamed `/v1/chat/completions` request: continued from the text delivered, as the
    assistant message's start (`continue_final_message`)."""

    __slots__ = ("client_usage", "counted", "resumable")

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        options = payload.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        # (include_usage, continuous_usage_stats) as the client asked
        self.client_usage = (bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))
        if not all(self.client_usage):
            self.extra = {"stream_options": {**options, "include_usage": True, "continuous_usage_stats": True}}
        self.counted = True  # every chunk with content carried the usage so far
        self.resumable = True  # no reasoning or tool call delta, which text cannot continue

    def _choices(self, obj: dict[str, Any]) -> bool:
        choices = obj.get("choices")
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.tokens = self.offset_tokens + int(usage.get("completion_tokens") or 0)
        elif choices:
            self.counted = False
        kept = []
        for choice in choices or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            if delta.get("tool_calls") or delta.get("reasoning_content"):
                self.resumable = False
            if self.moves:
                delta.pop("role", None)  # the client had the role in the first decode's first chunk
                if not delta.get("content") and choice.get("finish_reason") is None and not choice.get("logprobs"):
                    continue
            self.text += str(delta.get("content") or "")
            if choice.get("finish_reason") is not None:
                self.finished = True
            kept.append(choice)
        include, continuous = self.client_usage
        if isinstance(choices, list):
            if self.moves:
                obj["choices"] = kept
            if choices and not kept:
                return False  # only the new decode's role delta
            if usage is not None and choices and not continuous:
                obj.pop("usage")
            elif usage is not None and not choices and not include:
                return False  # the usage chunk the client did not ask for
        return True

    def resume_payload(self) -> dict[str, Any] | None:
        if not (self.resumable and self.counted):
            return None
        messages = list(self.payload.get("messages") or ())
        if self.payload.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
            messages[-1] = {**messages[-1], "content": str(messages[-1].get("content") or "") + self.text}
        else:
            messages.append({"role": "assistant", "content": self.text})
        body = {k: v for k, v in self.payload.items() if k not in ("messages", "rid")}
        body["messages"], body["continue_final_message"] = messages, True
        for key in _CHAT_BUDGET_KEYS:
            if self.payload.get(key) is not None:
                left = int(self.payload[key]) - self.tokens
                if left <= 0:
                    return None
                body[key] = left
        if self.payload.get("min_tokens"):
            body["min_tokens"] = max(0, int(self.payload["min_tokens"]) - self.tokens)
        return body


def _shift_offsets(logprobs: Any, by: int) -> None:
    """A continuation's `text_offset`s (legacy completions logprobs) counted from the answer's start;
    sglang sends -1 (unknown), which stays."""
    offsets = logprobs.get("text_offset") if isinstance(logprobs, dict) else None
    if isinstance(offsets, list):
        logprobs["text_offset"] = [o + by if isinstance(o, int) and o >= 0 else o for o in offsets]
