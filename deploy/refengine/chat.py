"""OpenAI chat messages as sglang hands them to a text-only model's chat template.

As sglang 0.5.23 does (`serving_chat._apply_jinja_template`, `process_content_for_template_format`
with a "string" template, `_validate_media_content`): `content: null` becomes "", text parts are
joined with spaces, thinking and tool-reference parts are left out, a media part is refused with a
400 naming its type, and an assistant tool call's JSON `arguments` string becomes an object.
"""

from __future__ import annotations

import json
from typing import Any

from .exceptions import RequestFailed

__all__ = ["template_messages"]

# sglang's roles (`protocol._GenericMessageRole` plus the user message), matched case-insensitively.
ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")
MEDIA_PART_TYPES = frozenset({"image_url", "video_url", "audio_url", "input_audio"})
# Parts a string template has no place for: sglang drops them without a word.
DROPPED_PART_TYPES = frozenset({"thinking", "reasoning", "tool_reference"})
PASSED_FIELDS = ("name", "tool_call_id", "tool_calls", "reasoning_content")


def template_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate `messages` and return them with string content, ready for the chat template."""
    if not isinstance(messages, list) or not messages:
        raise RequestFailed("'messages' must be a non-empty list of {role, content} objects.", 400)
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise RequestFailed(f"messages[{i}] is a {type(m).__name__}; each message must be an object.", 400)
    role = m.get("role")
    if not isinstance(role, str) or role.lower() not in ROLES:
        allowed = ", ".join(repr(r) for r in ROLES)
        raise RequestFailed(f"messages[{i}] has role {role!r}; 'role' must be one of {allowed}.", 400)
    role = role.lower()
    content = m.get("content")
    if content is None and role == "user":
        raise RequestFailed(f"messages[{i}] is a user message without content; send a string or content parts.", 400)
    out: dict[str, Any] = {"role": role, "content": _text(i, role, content)}
    out.update((k, m[k]) for k in PASSED_FIELDS if m.get(k) is not None)
    if role == "assistant" and isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call(i, c) for c in out["tool_calls"]]
    return out


def _text(i: int, role: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestFailed(f"messages[{i}].content must be a string, a list of content parts or null.", 400)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in MEDIA_PART_TYPES:
            # sglang's own words for a model without a vision or audio encoder
            raise RequestFailed(f"Model only supports text input; received unsupported content type '{kind}'.", 400)
        elif kind in ("thinking", "reasoning") and role != "assistant":
            raise RequestFailed("thinking content parts are only valid in assistant messages.", 400)
        elif kind not in DROPPED_PART_TYPES:
            raise RequestFailed(
                f"messages[{i}] has a content part {json.dumps(part)[:200]}; a text part is "
                '{"type": "text", "text": "..."}.',
                400,
            )
    return " ".join(texts)


def _tool_call(i: int, call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise RequestFailed(
            f"messages[{i}]: assistant tool call function.arguments must be a JSON object, "
            f"not {function['arguments'][:100]!r}.",
            400,
        )
    return {**call, "function": {**function, "arguments": arguments}}
