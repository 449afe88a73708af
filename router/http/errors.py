"""Errors in the OpenAI error format, so every OpenAI client reports them properly.

``{"error": {"message", "type", "param", "code"}}``: the official clients raise the
matching exception class from the status and show ``message``.
"""

from __future__ import annotations

import typing
from typing import Literal

import orjson

# Every error ``code`` this project answers with: clients, dashboards and alerts match
# on them, so the set is closed (tests/test_error_codes.py reads every call site). Two
# families are open only in their number: ``http_<status>`` (a framework 404/405) and
# the ``errors_total`` kind ``engine_<status>`` (the engine's own error status).
ErrorCode = Literal[
    # the request
    "invalid_request", "invalid_json", "invalid_value", "missing_field", "invalid_body",
    "model_not_found", "chat_template_error", "context_length_exceeded",
    "request_too_large", "request_timeout", "too_many_headers", "headers_too_large",
    "header_timeout", "too_many_connections", "upgrade", "client_gone",
    # the router's tokenize pool is full, or did not tokenize the prompt in time
    "tokenizer_busy", "tokenizer_timeout",
    # credentials and the admin API
    "invalid_api_key", "unauthorized", "admin_disabled", "worker_not_found",
    "invalid_worker", "off", "multiple_processes",
    # the engines
    "no_healthy_worker", "upstream_unreachable", "upstream_timeout", "upstream_error",
    "upstream_broken", "engine_error", "kv_cache_too_small", "unresolved_blocks",
    # the Responses API: a stored response lives in one engine
    "response_not_found", "previous_response_not_found", "previous_response_unavailable",
    # prefill/decode disaggregation (router.pd.exchange): a prefill answered without its transfer;
    # the mock engine's KV transfer failing, or pulled twice, or no decode engine joining
    # the SGLang bootstrap room (sim.mock.pd)
    "pd_no_transfer_params", "kv_transfer", "transfer_not_found", "bootstrap_timeout",
    # admission at the router (router.admission): queue full, tenant over its token rate
    # (429); the queue's wait past the deadline, now or later (503); all with Retry-After
    "queue_full", "rate_limited", "overloaded", "queue_timeout",
    # the router itself
    "internal_error",
]  # fmt: skip
# ``errors_total{kind}`` beyond the codes: failures no response code names.
ErrorKind = Literal[
    "connect", "timeout", "upstream", "cluster_unavailable", "client_disconnect", "internal",
    "prefill_broken", "prefill_status",  # router.pd.exchange: retried on another prefill engine
    "stall",  # a down engine silent past stall_after: the request goes to another one
]  # fmt: skip
ERROR_CODES: frozenset[str] = frozenset(typing.get_args(ErrorCode))
ERROR_KINDS: frozenset[str] = ERROR_CODES | frozenset(typing.get_args(ErrorKind))

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(Exception):
    """A request the router answers itself with ``status`` and an OpenAI error body."""

    headers: tuple[tuple[bytes, bytes], ...] = ()  # sent with it (Retry-After)

    def __init__(
        self, status: int, message: str, code: ErrorCode, param: str | None = None
    ) -> None:
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
