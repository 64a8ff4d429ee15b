"""OpenAI-shaped error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every error the router and the reference engine answer with goes through `error_body()`, so
clients written for the OpenAI API read all of them the same way, streamed (`sse_error()`) or not.
`ApiError` is the exception that carries one such answer up to the HTTP layer.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["ApiError", "error_body", "error_dict", "error_response", "normalize_error_body", "sse_error"]

# HTTP status -> OpenAI error type, as the OpenAI API spells them.
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered to the client as is; carries the HTTP status and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=self.headers)


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_dict(status: int, message: str, *, param: str | None = None, code: str | None = None) -> Any:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    return orjson.dumps(error_dict(status, message, param=param, code=code))


def error_response(status: int, message: str, **fields: Any) -> Response:
    """The HTTP response of an error; `fields` are ApiError's keyword options (param, code, headers)."""
    return ApiError(status, message, **fields).response()


def sse_error(status: int, message: str, *, code: str | None = None) -> bytes:
    """An SSE event carrying an OpenAI error, followed by the `[DONE]` terminator."""
    return b"data: " + error_body(status, message, code=code) + b"\n\ndata: [DONE]\n\n"


def normalize_error_body(status: int, body: bytes) -> bytes:
    """An engine's error answer in the one OpenAI shape: kept when it already is one, else rebuilt
    from the message it carries (sglang answers `{"object": "error", "message": ...}` on its
    OpenAI routes and FastAPI's `{"detail": ...}` elsewhere)."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            param, code = error.get("param"), error.get("code")
            return error_body(
                status,
                error["message"],
                param=param if isinstance(param, str) else None,
                code=str(code) if isinstance(code, str | int) and not isinstance(code, bool) else None,
            )
        param = payload.get("param")  # sglang's flat shape names the field at fault
        for key in ("message", "detail", "error"):
            value = payload.get(key)
            if isinstance(value, str) and value:
                return error_body(status, value, param=param if isinstance(param, str) else None, code="engine_error")
    text = body[:500].decode("utf-8", "replace").strip() or f"The engine answered {status}."
    return error_body(status, text, code="engine_error")
