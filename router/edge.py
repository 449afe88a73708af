"""What every request must pass before the router does any work for it.

Header limits and API keys are checked on the raw ASGI scope (a few comparisons, no
allocation), so a rejected request costs less than a routed one; the sampling limits
are checked on the parsed body the proxy already holds. Every refusal is an
``ApiError`` in the OpenAI shape, so OpenAI clients raise their usual exception.
"""

from __future__ import annotations

from typing import Any

from router.asgi import Scope
from router.auth import bearer_ok
from router.config import RouterConfig
from router.errors import ApiError

_PUBLIC = "/v1/"  # the OpenAI API; /health stays open for probes, /metrics and /admin have tokens


class Edge:
    """Header limits for every request, API keys for the public API."""

    __slots__ = ("keys", "max_bytes", "max_count", "max_n")

    def __init__(self, cfg: RouterConfig) -> None:
        self.keys = [k.encode() for k in cfg.api_keys]
        self.max_count = cfg.max_header_count
        self.max_bytes = cfg.max_header_bytes
        self.max_n = cfg.max_n

    def check(self, scope: Scope) -> ApiError | None:
        """The reason to refuse this request before reading its body, or None."""
        headers = scope["headers"]
        if len(headers) > self.max_count:
            return ApiError(431, f"more than {self.max_count} request headers", "too_many_headers")
        size = 0
        for key, value in headers:
            size += len(key) + len(value)
        if size > self.max_bytes:
            return ApiError(
                431, f"request headers over {self.max_bytes} bytes", "headers_too_large"
            )
        if self.keys and scope["path"].startswith(_PUBLIC) and not bearer_ok(headers, self.keys):
            return ApiError(401, "missing or wrong API key (Bearer token)", "invalid_api_key")
        return None

    def check_sampling(self, body: dict[str, Any]) -> None:
        """Limits on what one request may ask an engine to generate (``ApiError`` 400)."""
        n = body.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ApiError(400, "n must be a positive integer", "invalid_value", "n")
        if n is not None and n > self.max_n:
            raise ApiError(
                400, f"n is {n}; this router allows at most {self.max_n}", "invalid_value", "n"
            )
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is not None and value < 1:  # parse() checked it is an int
                raise ApiError(400, f"{key} must be at least 1, got {value}", "invalid_value", key)
