"""What every request must pass before the router does any work for it.

Header limits and API keys are checked on the raw ASGI scope (a few comparisons, no
allocation), so a rejected request costs less than a routed one; the sampling limits
are checked on the parsed body the proxy already holds. Every refusal is an
``ApiError`` in the OpenAI shape, so OpenAI clients raise their usual exception.
"""

from __future__ import annotations

from typing import Any

from router.config import RouterConfig
from router.http.asgi import Scope
from router.http.auth import bearer_ok
from router.http.errors import ApiError
from router.http.fields import check_fields, limit_rules

_PUBLIC = "/v1/"  # the OpenAI API; /health stays open for probes, /metrics and /admin have tokens


class Edge:
    """Header limits for every request, API keys for the public API."""

    __slots__ = ("keys", "limits", "max_bytes", "max_count")

    def __init__(self, cfg: RouterConfig) -> None:
        self.keys = [k.encode() for k in cfg.api_keys]
        self.max_count = cfg.max_header_count
        self.max_bytes = cfg.max_header_bytes
        # body field -> (lowest, highest) allowed: what one request may make an engine do
        self.limits = limit_rules(sampling_limits(cfg))

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
        check_fields(body, self.limits)


def sampling_limits(cfg: RouterConfig) -> dict[str, tuple[int, int]]:
    """The bounds ``check_sampling`` enforces (also what ``/openapi.json`` states)."""
    return {
        "n": (1, cfg.max_n),
        "best_of": (1, cfg.max_best_of),
        "max_tokens": (1, cfg.max_tokens),
        "max_completion_tokens": (1, cfg.max_tokens),
        "top_logprobs": (0, cfg.max_top_logprobs),
        "logprobs": (0, cfg.max_top_logprobs),  # the completions API's count
    }
