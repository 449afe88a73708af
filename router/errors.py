"""Errors in the OpenAI error format, so every OpenAI client reports them properly.

``{"error": {"message", "type", "param", "code"}}``: the official clients raise the
matching exception class from the status and show ``message``.
"""

from __future__ import annotations

import orjson

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
}


class ApiError(Exception):
    """A request the router answers itself with ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def sse_error(message: str, code: str) -> bytes:
    """One SSE event carrying an error, for a stream that breaks after it started."""
    return b"data: " + error_body(502, message, code) + b"\n\n"
