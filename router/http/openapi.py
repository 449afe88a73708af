"""The OpenAPI description of the completion routes, which FastAPI never sees.

``/v1/chat/completions`` and ``/v1/completions`` are served by the raw proxy
(``router.forward.proxy``) ahead of FastAPI, so FastAPI's generated schema lacks them. This
part describes what the router itself checks (the chat and completion bodies from the
rules it enforces, ``router.http.fields``; the body goes on to the engine unchanged, so other
fields are allowed) and the errors it answers with; the app merges it into
``/openapi.json`` so clients and schema fuzzers see every route.
"""

from __future__ import annotations

from typing import Any

from router.config import RouterConfig
from router.http import fields
from router.http.edge import sampling_limits
from router.http.fields import FieldRule, limit_rules, properties

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


# Fields the engines read and the router passes on unchecked: documented, not enforced.
_ENGINE_FIELDS: dict[str, Any] = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "user": {"type": "string", "description": "session key (or the x-session-id header)"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "cache_salt": {"type": "string"},
}


def _checked(cfg: RouterConfig, shape: tuple[FieldRule, ...]) -> dict[str, Any]:
    """A body schema from the rules the router enforces (``router.http.fields``)."""
    props, required = properties(shape, limit_rules(sampling_limits(cfg)))
    return {
        "type": "object",
        "required": required,
        "properties": {**_ENGINE_FIELDS, **props},
    }


def _chat(cfg: RouterConfig) -> dict[str, Any]:
    return _checked(cfg, fields.CHAT)


def _completion(cfg: RouterConfig) -> dict[str, Any]:
    return _checked(cfg, fields.COMPLETION)


def _responses_create(cfg: RouterConfig) -> dict[str, Any]:
    part = {"type": "object", "properties": {"type": {"type": "string"},
                                             "text": {"type": "string"}}}  # fmt: skip
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
            "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
        },
    }
    given = {
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": message},
        ]
    }
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": given,
            "instructions": {"type": "string", "minLength": 1},
            "previous_response_id": {
                "type": "string",
                "minLength": 1,
                "description": "routed to the engine that stored it",
            },
            "stream": {"type": "boolean"},
            "store": {"type": "boolean"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "minimum": 0, "maximum": 1},
            "user": {"type": "string"},
        },
    }


def _anthropic(cfg: RouterConfig) -> dict[str, Any]:
    block = {"type": "object", "required": ["type"],
             "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}  # fmt: skip
    text = {"oneOf": [{"type": "string"}, {"type": "array", "items": block}]}
    message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"type": "string", "enum": ["user", "assistant"]}, "content": text},
    }
    return {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": message},
            "system": text,
            "max_tokens": {"type": "integer", "minimum": 1},
            "stream": {"type": "boolean"},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        },
    }


def _texts() -> dict[str, Any]:
    return {"oneOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "minItems": 1, "items": {"type": "string"}}]}  # fmt: skip


# Load-routed endpoints (``router.forward.passthrough``): what the router reads is ``model``;
# the rest is the engine's to check, so the schemas only name the usual fields.
_PASSTHROUGH: dict[str, tuple[str, dict[str, Any]]] = {
    "/v1/embeddings": ("Embeddings (OpenAI)", {"input": _texts()}),
    "/v1/score": ("Scores of text pairs (vLLM)", {"text_1": _texts(), "text_2": _texts()}),
    "/score": ("Scores of text pairs (vLLM)", {"text_1": _texts(), "text_2": _texts()}),
    "/v1/rerank": ("Rerank documents (vLLM, Jina/Cohere style)",
                   {"query": {"type": "string"}, "documents": _texts()}),
    "/rerank": ("Rerank documents (vLLM)", {"query": {"type": "string"}, "documents": _texts()}),
    "/v2/rerank": ("Rerank documents (vLLM)",
                   {"query": {"type": "string"}, "documents": _texts()}),
    "/tokenize": ("Tokenize a prompt or chat messages (vLLM)", {"prompt": {"type": "string"}}),
    "/detokenize": ("Token ids to text (vLLM)", {"tokens": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 2**31 - 1}}}),
}  # fmt: skip


def _passthrough(fields: dict[str, Any]) -> dict[str, Any]:
    model = {"model": {"type": "string", "minLength": 1,
                       "description": "required when the router serves several models"}}
    return {"type": "object", "properties": {**model, **fields}}  # fmt: skip


def _errors(codes: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": _ERROR}}}
    return {code: {"description": text, **error} for code, text in codes}


def _stored(summary: str, method: str) -> dict[str, Any]:
    """``/v1/responses/{response_id}`` (GET) and ``.../cancel`` (POST)."""
    rid = {"name": "response_id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,256}$"}}  # fmt: skip
    return {
        method: {
            "summary": summary,
            "parameters": [rid],
            "responses": {
                "200": {"description": "the storing engine's answer",
                        "content": {"application/json": {"schema": {"type": "object"}}}},
                **_errors((("400", "the engine refused"), ("404", "no such response"),
                           ("502", "the engine failed or is unreachable"),
                           ("503", "no healthy worker"))),
            },
        }
    }  # fmt: skip


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
    """OpenAPI path items for the raw routes (completions, responses, passthrough)."""
    return {
        "/v1/chat/completions": _operation("Chat completion (OpenAI)", _chat(cfg)),
        "/v1/completions": _operation("Text completion (OpenAI)", _completion(cfg)),
        "/v1/responses": _operation("Create a response (OpenAI Responses API)",
                                    _responses_create(cfg)),
        "/v1/messages": _operation("Create a message (Anthropic Messages API)", _anthropic(cfg)),
        "/v1/responses/{response_id}": _stored("Retrieve a stored response", "get"),
        "/v1/responses/{response_id}/cancel": _stored("Cancel a background response", "post"),
        **{path: _operation(summary, _passthrough(fields))
           for path, (summary, fields) in _PASSTHROUGH.items()},
    }  # fmt: skip
