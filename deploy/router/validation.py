"""Cheap checks of a request body before it is forwarded, so that bad input gets a 4xx from the
router with an OpenAI-shaped error instead of reaching (or crashing) a worker.

Only the fields the router itself relies on, and the ones whose wrong type would fail on every
worker, are checked; everything else is the engine's to judge.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..openai_errors import ApiError

__all__ = ["ENDPOINTS", "batch_size", "parse_body", "routing_text", "validate"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/generate")

_NUMBER = (int, float)


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise ApiError(400, "The request body is empty. Send a JSON object.", code="invalid_json")
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(
            400, f"The request body is not valid JSON ({exc}). Send a JSON object.", code="invalid_json"
        ) from exc
    if not isinstance(payload, dict):
        raise ApiError(
            400,
            f"The request body is a JSON {type(payload).__name__}, not an object. Send a JSON object.",
            code="invalid_json",
        )
    return payload


def _type_error(param: str, expected: str, value: Any) -> ApiError:
    return ApiError(
        400,
        f"'{param}' must be {expected}, got {type(value).__name__} {_short(value)}.",
        param=param,
        code="invalid_type",
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _missing(param: str, what: str) -> ApiError:
    return ApiError(400, f"'{param}' is required: {what}.", param=param, code="missing_required_parameter")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _check_common(payload: dict[str, Any]) -> None:
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean", stream)
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "a string", model)
    for name in ("max_tokens", "max_completion_tokens", "n", "top_k", "seed"):
        value = payload.get(name)
        if value is not None and not _is_int(value):
            raise _type_error(name, "an integer", value)
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is not None and value < 0:
            raise ApiError(400, f"'{name}' must be >= 0, got {value}.", param=name, code="invalid_value")
    n = payload.get("n")
    if n is not None and n < 1:
        raise ApiError(400, f"'n' must be >= 1, got {n}.", param="n", code="invalid_value")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = payload.get(name)
        if value is not None and not _is_number(value):
            raise _type_error(name, "a number", value)
    stop = payload.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error("stop", "a string or a list of strings", stop)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)


def _check_chat(payload: dict[str, Any]) -> None:
    if "messages" not in payload:
        raise _missing("messages", "a non-empty list of {role, content} objects")
    messages = payload["messages"]
    if not isinstance(messages, list) or not messages:
        raise _type_error("messages", "a non-empty list of {role, content} objects", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _type_error(f"messages[{i}]", "an object with 'role' and 'content'", message)
        role = message.get("role")
        if not isinstance(role, str):
            raise _type_error(f"messages[{i}].role", "a string", role)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages[{i}].content", "a string or a list of content parts", content)


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value) or all(_is_int(v) for v in value):
            return True
        return all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value)
    return False


def _check_completions(payload: dict[str, Any]) -> None:
    if "prompt" not in payload:
        raise _missing("prompt", "a string, a list of strings, or token ids")
    if not _is_prompt(payload["prompt"]):
        raise _type_error("prompt", "a string, a list of strings, or token ids", payload["prompt"])


def _check_generate(payload: dict[str, Any]) -> None:
    text, ids = payload.get("text"), payload.get("input_ids")
    if text is None and ids is None and payload.get("input_embeds") is None:
        raise _missing("text", "send 'text' (a string or list of strings) or 'input_ids'")
    if text is not None and not (
        isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))
    ):
        raise _type_error("text", "a string or a non-empty list of strings", text)
    if ids is not None and not (isinstance(ids, list) and ids and _is_prompt(ids) and not isinstance(ids[0], str)):
        raise _type_error("input_ids", "a list of token ids or a list of such lists", ids)
    params = payload.get("sampling_params")
    if params is not None and not isinstance(params, dict | list):
        raise _type_error("sampling_params", "an object", params)
    logprob = payload.get("return_logprob")
    if logprob is not None and not isinstance(logprob, bool | list):
        raise _type_error("return_logprob", "a boolean", logprob)


_CHECKS = {
    "/v1/chat/completions": _check_chat,
    "/v1/completions": _check_completions,
    "/generate": _check_generate,
}


def validate(endpoint: str, payload: dict[str, Any], known_models: list[str]) -> None:
    _check_common(payload)
    _CHECKS[endpoint](payload)
    model = payload.get("model")
    if model is not None and known_models and model not in known_models and endpoint != "/generate":
        raise ApiError(
            404,
            f"The model {model!r} does not exist on this router. Available: {', '.join(known_models)} "
            "(see GET /v1/models).",
            param="model",
            code="model_not_found",
        )


def batch_size(endpoint: str, payload: dict[str, Any]) -> int | None:
    """The number of prompts of a batch `/generate` request, or None for a single request."""
    if endpoint != "/generate":
        return None
    text = payload.get("text")
    if isinstance(text, list):
        return len(text)
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def routing_text(payload: dict[str, Any]) -> str:
    """The prompt as text, for prefix-affinity routing."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                parts.append(content if isinstance(content, str) else orjson.dumps(content).decode())
        return "\n".join(parts)
    for key in ("prompt", "text", "input_ids"):
        value = payload.get(key)
        if isinstance(value, str):
            return value
        if value is not None:
            return orjson.dumps(value).decode()
    return ""
