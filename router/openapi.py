"""The OpenAPI description of the completion routes, which FastAPI never sees.

``/v1/chat/completions`` and ``/v1/completions`` are served by the raw proxy
(``router.proxy``) ahead of FastAPI, so FastAPI's generated schema lacks them. This
hand-written part describes what the router itself checks (the body goes on to the
engine unchanged, so other fields are allowed) and the errors it answers with; the app
merges it into ``/openapi.json`` so clients and schema fuzzers see every route.
"""

from __future__ import annotations

from typing import Any

from router.config import RouterConfig

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _sampling(cfg: RouterConfig) -> dict[str, Any]:
    return {
        "model": {"type": "string", "minLength": 1},
        "stream": {"type": "boolean"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "n": {"type": "integer", "minimum": 1, "maximum": cfg.max_n},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "user": {"type": "string", "description": "session key (or the x-session-id header)"},
        "stream_options": {
            "type": "object",
            "properties": {"include_usage": {"type": "boolean"}},
        },
        "cache_salt": {"type": "string"},
    }


def _chat(cfg: RouterConfig) -> dict[str, Any]:
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"type": "string"},
        },
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_sampling(cfg),
            "messages": {"type": "array", "minItems": 1, "items": message},
        },
    }


def _completion(cfg: RouterConfig) -> dict[str, Any]:
    prompt = {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {
                "type": "array",
                "minItems": 1,
                "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
            },
        ]
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {**_sampling(cfg), "prompt": prompt},
    }


def _operation(summary: str, schema: dict[str, Any]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": _ERROR}}}
    return {
        "post": {
            "summary": summary,
            "parameters": [
                {"name": "x-session-id", "in": "header", "schema": {"type": "string"}},
                {"name": "x-request-id", "in": "header", "schema": {"type": "string"}},
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": schema}},
            },
            "responses": {
                "200": {
                    "description": "the engine's answer, passed through (SSE when streaming)",
                    "content": {
                        "application/json": {"schema": {"type": "object"}},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **{
                    code: {"description": text, **error}
                    for code, text in (
                        ("400", "invalid request"),
                        ("401", "missing or wrong API key"),
                        ("404", "unknown model"),
                        ("408", "request body too slow"),
                        ("413", "request body too large"),
                        ("431", "too many or too large headers"),
                        ("502", "the engine failed or is unreachable"),
                        ("503", "no healthy worker"),
                        ("504", "the engine did not answer in time"),
                    )
                },
            },
        }
    }


def completion_paths(cfg: RouterConfig) -> dict[str, Any]:
    """OpenAPI path items for the two raw completion routes."""
    return {
        "/v1/chat/completions": _operation("Chat completion (OpenAI)", _chat(cfg)),
        "/v1/completions": _operation("Text completion (OpenAI)", _completion(cfg)),
    }
