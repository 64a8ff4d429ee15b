"""Input logprobs in PD: the prefill computes the prompt's logprobs, the decode only its own part,
so the router puts the prefill's `meta_info.input_token_logprobs` in front of the decode's
(sglang's PD convention, native `/generate` with `return_logprob` only)."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["merge_first_event", "merge_logprobs", "wants_input_logprobs"]


def wants_input_logprobs(endpoint: str, payload: dict[str, Any]) -> bool:
    return endpoint == "/generate" and bool(payload.get("return_logprob"))


def merge_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    """decode.meta_info.input_token_logprobs = prefill's + decode's, per item of a batch."""
    p, d = orjson.loads(prefill_body), orjson.loads(decode_body)
    if isinstance(d, list) and isinstance(p, list):
        for pi, di in zip(p, d, strict=False):
            _merge_one(pi, di)
    elif isinstance(d, dict) and isinstance(p, dict):
        _merge_one(p, d)
    return orjson.dumps(d)


def merge_first_event(prefill_body: bytes, first: bytes) -> bytes:
    """The same for a stream: into decode's first SSE event, from the prefill's first event."""
    p, d = _first_event(prefill_body), _first_event(first)
    if p is None or d is None or d[0] == b"[DONE]":
        return first
    return b"data: " + merge_logprobs(p[0], d[0]) + d[1]


def _merge_one(p: dict[str, Any], d: dict[str, Any]) -> None:
    pl = (p.get("meta_info") or {}).get("input_token_logprobs")
    meta = d.get("meta_info")
    if isinstance(pl, list) and isinstance(meta, dict):
        meta["input_token_logprobs"] = pl + list(meta.get("input_token_logprobs") or [])


def _first_event(body: bytes) -> tuple[bytes, bytes] | None:
    """Split `data: {json}\\n\\n...` into the first event's JSON and the rest."""
    if not body.startswith(b"data: "):
        return None
    end = body.find(b"\n\n")
    if end < 0:
        return None
    return body[6:end], body[end:]
