"""Cheap checks of a request body before it is forwarded, so that bad input gets a 4xx from the
router with an OpenAI-shaped error instead of reaching (or crashing) a worker.

Checked: the fields the router itself relies on, the ones whose wrong type would fail on every
worker, and the sampling parameters with OpenAI's ranges (sglang's for `/generate`'s
`sampling_params`). A request that an engine would fail on is the client's fault, so it must be
refused here with a 400 naming the parameter rather than reach an engine: the client learns what
to fix, and the engine's 5xx would cost a retry on another pair and a health probe (`legs`).
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from ...common.openai_errors import ApiError
from .fields import refused_fields

__all__ = [
    "ENDPOINTS",
    "MAX_JSON_DEPTH",
    "MAX_STOP",
    "ROLES",
    "Payload",
    "batch_size",
    "parse_body",
    "routing_text",
    "validate",
]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/generate")

_NUMBER = (int, float)

# Nesting deeper than this is refused: orjson serialises at most 255 levels (the router re-encodes
# bodies) and no OpenAI request needs more than a handful.
MAX_JSON_DEPTH = 64

# OpenAI's chat roles ("function" is its deprecated predecessor of "tool").
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})

# (low, high, low included, high included) of OpenAI's sampling parameters.
_OPENAI_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, 2.0, True, True),
    "top_p": (0.0, 1.0, False, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
}
# sglang's checks of `/generate`'s sampling_params (sglang/srt/sampling/sampling_params.py, verify()).
_SGLANG_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, math.inf, True, False),
    "top_p": (0.0, 1.0, False, True),
    "min_p": (0.0, 1.0, True, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
    "repetition_penalty": (0.0, 2.0, True, True),
}
_MAX_N = 128  # OpenAI's limit
_MAX_TOP_LOGPROBS = 20  # chat; legacy completions allow 5; `/generate`'s top_logprobs_num too
_MAX_TOKEN_IDS_LOGPROB = 64  # `/generate`'s token_ids_logprob, ids per prompt (as stop ids)
# OpenAI's API reference: `stop` "up to 4 sequences", `tools` "a max of 128 functions",
# `logit_bias` values "from -100 to 100", `metadata` "up to 16 key-value pairs". sglang's native
# `/generate` documents no bound; the router holds it to the same 4 stop sequences and stop ids
# to 64, so that no request makes every decode step scan a million strings.
MAX_STOP = 4
_MAX_STOP_TOKEN_IDS = 64
_MAX_TOOLS = 128
_MAX_METADATA = 16
_LOGIT_BIAS = 100


class Payload(dict[str, Any]):
    """A parsed request body that remembers its routing text and batch size: several steps of one
    request read them (the capacity estimate, the pair's policies, the prefix's DP rank), and the
    text of a long prompt is a join and copy of all of it. The router never changes the prompt of
    a body it has parsed, so the first answer stays right."""

    __slots__ = ("batch", "text")

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.text: str | None = None
        self.batch: tuple[str, int | None] | None = None  # (endpoint, batch size)


def parse_body(raw: bytes) -> Payload:
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
    _check_depth(raw, payload)
    return Payload(payload)


def _check_depth(raw: bytes, payload: Any) -> None:
    # Counting brackets runs in C: a body with fewer brackets than the limit cannot nest deeper,
    # so the walk below only runs for the rare body full of brackets.
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(
                400,
                f"The request body nests JSON deeper than {MAX_JSON_DEPTH} levels. Flatten it.",
                code="invalid_json",
            )
        children = value.values() if isinstance(value, dict) else value
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))


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
    n = payload.get("n")
    if n is not None and not 1 <= n <= _MAX_N:
        raise _range_error("n", f"between 1 and {_MAX_N}", n)
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        value = payload.get(name)
        if value is not None and not _is_number(value):
            raise _type_error(name, "a number", value)
    _check_stop(payload, "")
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    _check_size(payload, "tools", list, "a list of tool objects", _MAX_TOOLS, "tools")
    _check_size(payload, "metadata", dict, "an object", _MAX_METADATA, "key-value pairs")
    _check_logit_bias(payload.get("logit_bias"), "logit_bias")


def _check_stop(params: dict[str, Any], prefix: str) -> None:
    param = prefix + "stop"
    stop = params.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error(param, "a string or a list of strings", stop)
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise _range_error(param, f"a list of at most {MAX_STOP} stop sequences", f"{len(stop)} sequences")
    ids = params.get("stop_token_ids")
    if ids is not None:
        if not (isinstance(ids, list) and all(_is_int(i) for i in ids)):
            raise _type_error(prefix + "stop_token_ids", "a list of token ids", ids)
        if len(ids) > _MAX_STOP_TOKEN_IDS:
            raise _range_error(prefix + "stop_token_ids", f"at most {_MAX_STOP_TOKEN_IDS} token ids", f"{len(ids)} ids")


def _check_logit_bias(bias: Any, param: str) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise _type_error(param, "an object mapping token ids to biases", bias)
    for token, value in bias.items():
        if not _is_number(value) or not -_LOGIT_BIAS <= value <= _LOGIT_BIAS:
            raise _range_error(f"{param}.{token}", f"a number in [-{_LOGIT_BIAS}, {_LOGIT_BIAS}]", value)


def _check_size(
    payload: dict[str, Any], name: str, kind: type[list[Any] | dict[str, Any]], shape: str, most: int, unit: str
) -> None:
    """`payload[name]`, when given, is a `kind` (`shape`) of at most `most` `unit`."""
    value = payload.get(name)
    if value is None:
        return
    if not isinstance(value, kind):
        raise _type_error(name, shape, value)
    if len(value) > most:
        raise _range_error(name, f"at most {most} {unit}", f"{len(value)} {unit}")


def _range_error(param: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"'{param}' must be {expected}, got {_short(value)}.", param=param, code="invalid_value")


def _check_ranges(params: dict[str, Any], ranges: dict[str, tuple[float, float, bool, bool]], prefix: str) -> None:
    for name, (low, high, low_in, high_in) in ranges.items():
        value = params.get(name)
        if value is None:
            continue
        param = prefix + name
        if not _is_number(value):
            raise _type_error(param, "a number", value)
        above = value > low if not low_in else value >= low
        below = value < high if not high_in else value <= high
        if not (math.isfinite(value) and above and below):
            lo, hi = ("[" if low_in else "("), ("]" if high_in else ")")
            raise _range_error(param, f"a number in {lo}{low:g}, {high:g}{hi}", value)


def _check_max_tokens(payload: dict[str, Any]) -> None:
    # OpenAI refuses max_tokens 0 on chat ("Expected a value >= 1"); on legacy completions 0 only
    # makes sense with echo, which the router does not support, so both refuse it.
    for name in ("max_tokens", "max_completion_tokens"):
        value = payload.get(name)
        if value is not None and value < 1:
            raise _range_error(name, "at least 1 (the number of tokens to generate)", value)


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
        if role not in ROLES:
            raise _range_error(f"messages[{i}].role", f"one of {', '.join(sorted(ROLES))}", role)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages[{i}].content", "a string or a list of content parts", content)
    _check_max_tokens(payload)
    _check_ranges(payload, _OPENAI_RANGES, "")
    logprobs, top = payload.get("logprobs"), payload.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _type_error("logprobs", "a boolean", logprobs)
    if top is not None:
        if not _is_int(top):
            raise _type_error("top_logprobs", "an integer", top)
        if not 0 <= top <= _MAX_TOP_LOGPROBS:
            raise _range_error("top_logprobs", f"between 0 and {_MAX_TOP_LOGPROBS}", top)
        if not logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")


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
    _check_max_tokens(payload)
    _check_ranges(payload, _OPENAI_RANGES, "")
    logprobs = payload.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs):
            raise _type_error("logprobs", "an integer (the number of top logprobs per token)", logprobs)
        if not 0 <= logprobs <= 5:
            raise _range_error("logprobs", "between 0 and 5", logprobs)


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
    for i, one in enumerate(params if isinstance(params, list) else [params] if params else []):
        prefix = f"sampling_params[{i}]." if isinstance(params, list) else "sampling_params."
        if not isinstance(one, dict):
            raise _type_error(prefix.rstrip("."), "an object", one)
        _check_sampling_params(one, prefix)
    logprob = payload.get("return_logprob")
    if logprob is not None and not isinstance(logprob, bool | list):
        raise _type_error("return_logprob", "a boolean", logprob)
    _check_generate_logprobs(payload)


def _per_prompt(value: Any) -> list[Any]:
    """A `/generate` option given once, or as a list with one value per prompt of a batch."""
    return value if isinstance(value, list) else [value]


def _check_generate_logprobs(payload: dict[str, Any]) -> None:
    # sglang's GenerateReqInput bounds none of these; each one costs work per generated token (a
    # top-k over the vocabulary, a gather per listed id), so they get the chat API's bounds.
    top = payload.get("top_logprobs_num")
    if top is not None:
        for value in _per_prompt(top):
            if not _is_int(value):
                raise _type_error("top_logprobs_num", "an integer (or a list of them, one per prompt)", value)
            if not 0 <= value <= _MAX_TOP_LOGPROBS:
                raise _range_error("top_logprobs_num", f"between 0 and {_MAX_TOP_LOGPROBS}", value)
    start = payload.get("logprob_start_len")
    if start is not None:
        for value in _per_prompt(start):
            if not _is_int(value):
                raise _type_error("logprob_start_len", "an integer (or a list of them, one per prompt)", value)
            if value < -1:
                raise _range_error("logprob_start_len", "-1 (the last prompt token) or a prompt position >= 0", value)
    ids = payload.get("token_ids_logprob")
    if ids is not None:
        lists = ids if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids) else [ids]
        for one in lists:
            if not isinstance(one, list) or not all(_is_int(i) and i >= 0 for i in one):
                raise _type_error("token_ids_logprob", "a list of token ids (or one such list per prompt)", one)
            if len(one) > _MAX_TOKEN_IDS_LOGPROB:
                raise _range_error("token_ids_logprob", f"at most {_MAX_TOKEN_IDS_LOGPROB} token ids", len(one))


def _check_sampling_params(params: dict[str, Any], prefix: str) -> None:
    _check_ranges(params, _SGLANG_RANGES, prefix)
    _check_stop(params, prefix)
    _check_logit_bias(params.get("logit_bias"), prefix + "logit_bias")
    for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
        value = params.get(name)
        if value is not None and not _is_int(value):
            raise _type_error(prefix + name, "an integer", value)
    max_new = params.get("max_new_tokens")
    if max_new is not None and max_new < 0:  # sglang: 0 runs the prefill only
        raise _range_error(prefix + "max_new_tokens", ">= 0", max_new)
    top_k = params.get("top_k")
    if top_k is not None and top_k < 1 and top_k != -1:
        raise _range_error(prefix + "top_k", "-1 (all tokens) or at least 1", top_k)
    n = params.get("n")
    if n is not None and not 1 <= n <= _MAX_N:
        raise _range_error(prefix + "n", f"between 1 and {_MAX_N}", n)


_CHECKS = {
    "/v1/chat/completions": _check_chat,
    "/v1/completions": _check_completions,
    "/generate": _check_generate,
}


def validate(endpoint: str, payload: dict[str, Any], known_models: list[str], *, admin: bool = False) -> None:
    """Raise an ApiError (4xx, OpenAI-shaped) for the first problem of `payload`; `admin`: the
    request carries the admin key, so engine-internal fields may pass (`fields.py`)."""
    refused_fields(endpoint, payload, admin=admin)
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
    if isinstance(payload, Payload):
        if payload.batch is None or payload.batch[0] != endpoint:
            payload.batch = (endpoint, _batch_size(payload))
        return payload.batch[1]
    return _batch_size(payload)


def _batch_size(payload: dict[str, Any]) -> int | None:
    text = payload.get("text")
    if isinstance(text, list):
        return len(text)
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def routing_text(payload: dict[str, Any]) -> str:
    """The prompt as text, for prefix-affinity routing and the capacity estimate (once per `Payload`)."""
    if isinstance(payload, Payload):
        if payload.text is None:
            payload.text = _routing_text(payload)
        return payload.text
    return _routing_text(payload)


def _routing_text(payload: dict[str, Any]) -> str:
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
