"""Request migration: a decode that fails mid-stream hands the stream to another pair.

A streamed `/generate` answer carries, in each event, every token id generated so far
(`output_ids`) and the text so far: sglang's default, non-incremental streaming
(`srt/managers/tokenizer_manager.py`, `incremental_streaming_output` off). The relay feeds the
decode's bytes through a `Migration`, which passes on whole events only and keeps the last
delivered one's ids. When the decode leg fails before the answer finished (connection reset, an
error event, or the worker ejected while the relay waits on it), the proxy re-dispatches the
request to another pair with `input_ids` = the prompt's token ids plus the ids delivered, and the
token budget less what was generated (`resume_payload`). The new decode's events are rewritten
to continue the old ones: ids and text prefixed with what the client has, `completion_tokens`
counted once, `prompt_tokens` and the id as the client first saw them.

The prompt's ids: the client's `input_ids`, or, for a `text` prompt, the decode's own
tokenization, which the router asks for on the decode leg only (`return_prompt_token_ids`,
sglang's `GenerateReqInput` field, answered as the event's `prompt_token_ids`) and strips from
what the client sees unless the client asked for it.

What does not migrate (`migratable`): batches and `n` > 1, requests that return logprobs, unary
requests (nothing reached the client; they are retried from the start as before), and a stream
whose prompt ids are unknown. The OpenAI routes' streams are migration_openai.py's.
docs/migration.md has the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..exceptions import UpstreamStatusError
from ..workers.registry import Worker

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "Migration", "migratable"]

# sglang's SamplingParams default (`srt/sampling/sampling_params.py`): the budget of a request
# that names none.
DEFAULT_MAX_NEW_TOKENS = 128
_DONE = b"data: [DONE]"


def migratable(endpoint: str, payload: Mapping[str, Any]) -> bool:
    """Whether a streamed request can move to another decode mid-stream."""
    if endpoint != "/generate" or not payload.get("stream"):
        return False
    ids, text = payload.get("input_ids"), payload.get("text")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
            return False  # a batch (a list of lists), or no prompt
    elif not isinstance(text, str):
        return False  # a batch of texts, or embeddings / multimodal input
    if any(payload.get(k) for k in ("return_logprob", "input_embeds", "image_data", "audio_data", "video_data")):
        return False
    sampling = payload.get("sampling_params") or {}
    return isinstance(sampling, dict) and sampling.get("n") in (None, 1)


class Migration:
    """One streamed `/generate` request's tokens as relayed, and its moves to other decodes."""

    __slots__ = (
        "added_prompt_ids",
        "buffer",
        "finished",
        "ids",
        "moves",
        "offset_ids",
        "offset_text",
        "payload",
        "prompt_ids",
        "prompt_tokens",
        "response_id",
        "text",
    )

    def __init__(self, payload: Mapping[str, Any]) -> None:
        self.payload = payload
        given = payload.get("input_ids")
        self.prompt_ids: list[int] | None = list(given) if given is not None else None
        # For a text prompt the decode leg is asked for its tokenization (decode_extra).
        self.added_prompt_ids = given is None and not payload.get("return_prompt_token_ids")
        self.buffer = b""
        self.ids: list[int] = []  # every token id the client has received
        self.text = ""
        self.offset_ids: list[int] = []  # what the client had when the current decode took over
        self.offset_text = ""
        self.prompt_tokens: int | None = None
        self.response_id: Any = None
        self.finished = False  # an event with a finish reason was relayed
        self.moves = 0

    def decode_extra(self) -> dict[str, Any]:
        """Fields the decode leg (only) gets so that the stream can move."""
        return {"return_prompt_token_ids": True} if self.added_prompt_ids else {}

    def feed(self, chunk: bytes, worker: Worker) -> bytes:
        """The whole events of the decode's bytes so far (the rest waits for the next chunk),
        rewritten after a move. An error event raises UpstreamStatusError: the stream broke."""
        self.buffer += chunk
        end = self.buffer.rfind(b"\n\n")
        if end < 0:
            return b""
        events, self.buffer = self.buffer[: end + 2], self.buffer[end + 2 :]
        out = []
        for event in events.split(b"\n\n")[:-1]:
            out.append(self._event(event, worker))
        return b"".join(out)

    def _event(self, event: bytes, worker: Worker) -> bytes:
        data = event.strip()
        if not data.startswith(b"data:") or data == _DONE:
            return event + b"\n\n"
        obj = orjson.loads(data[5:])
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj:
            raise UpstreamStatusError(
                f"decode worker {worker.url} sent an error event: {obj['error']}", worker, 500, data
            )
        meta_info = obj.get("meta_info")
        meta: dict[str, Any] = meta_info if isinstance(meta_info, dict) else {}
        prompt_ids = obj.pop("prompt_token_ids", None) if self.added_prompt_ids else obj.get("prompt_token_ids")
        if self.prompt_ids is None and isinstance(prompt_ids, list):
            self.prompt_ids = prompt_ids
        if self.moves:
            obj["output_ids"] = self.offset_ids + list(obj.get("output_ids") or [])
            obj["text"] = self.offset_text + str(obj.get("text") or "")
            if "completion_tokens" in meta:
                meta["completion_tokens"] = len(obj["output_ids"])
            if self.prompt_tokens is not None and "prompt_tokens" in meta:
                meta["prompt_tokens"] = self.prompt_tokens
            if "id" in meta:
                meta["id"] = self.response_id
            if "prompt_token_ids" in obj and self.prompt_ids is not None and not self.added_prompt_ids:
                obj["prompt_token_ids"] = self.prompt_ids[: self.prompt_tokens or len(self.prompt_ids)]
        else:
            self.prompt_tokens = meta.get("prompt_tokens", self.prompt_tokens)
            self.response_id = meta.get("id", self.response_id)
        self.ids = list(obj.get("output_ids") or [])
        self.text = str(obj.get("text") or "")
        if meta.get("finish_reason") is not None:
            self.finished = True
        if not self.moves and not self.added_prompt_ids:
            return event + b"\n\n"  # unchanged: pass the worker's own bytes on
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def resume_payload(self) -> dict[str, Any] | None:
        """The body that continues the stream on another pair; None when it cannot (prompt ids
        unknown, or the budget spent)."""
        if self.prompt_ids is None:
            return None
        body = {k: v for k, v in self.payload.items() if k not in ("text", "input_ids", "rid")}
        sampling = dict(self.payload.get("sampling_params") or {})
        done = len(self.ids)
        budget = sampling.get("max_new_tokens")
        left = (DEFAULT_MAX_NEW_TOKENS if budget is None else int(budget)) - done
        if left <= 0:
            return None
        sampling["max_new_tokens"] = left
        if sampling.get("min_new_tokens"):
            sampling["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - done)
        body["sampling_params"] = sampling
        body["input_ids"] = self.prompt_ids + self.ids
        return body

    def moved(self) -> None:
        """The stream continues on a new decode: its events are rewritten from now on."""
        self.moves += 1
        self.buffer = b""  # a partial event of the failed decode is dropped, not relayed
        self.offset_ids, self.offset_text = list(self.ids), self.text
