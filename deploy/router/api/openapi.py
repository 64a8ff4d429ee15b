"""The OpenAPI document the router serves at `/openapi.json`: the OpenAI routes it implements, with
the ranges `validation.py` enforces, so that clients and schema-driven fuzzers (schemathesis,
`scripts/fuzz_router.py`) know what the router accepts. Written by hand because the inference
routes bypass FastAPI's routing (see `app.py`), so FastAPI cannot derive it."""

from __future__ import annotations

from typing import Any

from .validation import MAX_JSON_DEPTH, ROLES

__all__ = ["OPENAPI"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]}

_SAMPLING: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": {"type": "integer"},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": sorted(ROLES)},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                    },
                },
            ]
        },
        "name": {"type": "string"},
    },
}

_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
        **_SAMPLING,
    },
}

_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
            ]
        },
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        **_SAMPLING,
    },
}

_SGLANG_SAMPLING = {
    "type": "object",
    "properties": {
        "max_new_tokens": {"type": "integer", "minimum": 0},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": {"type": "number", "minimum": 0, "maximum": 1},
        "repetition_penalty": {"type": "number", "minimum": 0, "maximum": 2},
        "stop": _STOP,
    },
}

_GENERATE_REQUEST = {
    "type": "object",
    "properties": {
        "text": {"oneOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]},
        "input_ids": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        "sampling_params": _SGLANG_SAMPLING,
        "stream": {"type": "boolean"},
        "return_logprob": {"type": "boolean"},
    },
}


def _errors(*statuses: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": "an OpenAI-shaped error", "content": content} for s in statuses}


def _inference(summary: str, schema: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
            },
            "responses": {
                "200": {
                    "description": "the answer (JSON), or server-sent events when `stream` is true",
                    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
                },
                **_errors(400, 401, 404, 413, 414, 429, 431, 502, 503, 504),
            },
        }
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {
        "title": "sglang-pd router",
        "version": "1",
        "description": (
            "OpenAI-compatible routes served by prefill/decode pairs. Bodies nest at most "
            f"{MAX_JSON_DEPTH} levels. Authenticate with `Authorization: Bearer <key>` when keys are set."
        ),
    },
    "paths": {
        "/v1/chat/completions": _inference("Chat completion (OpenAI)", "ChatCompletionRequest"),
        "/v1/completions": _inference("Text completion (OpenAI legacy)", "CompletionRequest"),
        "/generate": _inference("sglang's native generate", "GenerateRequest"),
        "/v1/models": {
            "get": {
                "summary": "The models the workers serve",
                "responses": {"200": {"description": "an OpenAI model list"}, **_errors(401)},
            }
        },
    },
    "components": {
        "schemas": {
            "ChatCompletionRequest": _CHAT_REQUEST,
            "CompletionRequest": _COMPLETION_REQUEST,
            "GenerateRequest": _GENERATE_REQUEST,
            "Error": _ERROR,
        },
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
    },
}
