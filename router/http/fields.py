"""The body fields the router itself checks, in one table per endpoint.

Each rule holds the JSON Schema that ``/openapi.json`` states for the field and the
same rule as code, which the hot path runs (``Router.parse`` the shape, ``Edge``'s
``check_sampling`` the configured limits): interpreting the schema per request would
cost more than the whole routing decision, and writing the two apart let them drift
(the schema required a message ``content`` the router never asked for, and capped
token ids at 2^31 where the router takes 2^32). ``tests/test_fields.py`` holds every
check against its schema on the same values.

Everything else in a body goes to the engine unchanged and is the engine's to check.
The Responses and Anthropic Messages bodies are checked by ``router.routing.responses`` and
``router.routing.messages``, with their schemas beside ``router.http.openapi``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from router.http.errors import ApiError, ErrorCode

# What a failed check says: the message and the error ``code`` (``param`` is the field).
Problem = tuple[str, ErrorCode]
MAX_TOKEN_ID = (1 << 32) - 1  # what an engine (and the hasher's u32 packing) can take


@dataclass(frozen=True, slots=True)
class FieldRule:
    """One field: its schema, and its check (None: fine). A required field's check gets
    None when the field is missing; an optional one is checked only when present."""

    name: str
    schema: dict[str, Any]
    check: Callable[[Any], Problem | None]
    required: bool = False


def check_fields(body: Mapping[str, Any], rules: tuple[FieldRule, ...]) -> None:
    """``ApiError`` 400 naming the first of ``rules`` that ``body`` breaks."""
    for rule in rules:
        if rule.required or rule.name in body:
            problem = rule.check(body.get(rule.name))
            if problem is not None:
                message, code = problem
                raise ApiError(400, message, code, rule.name)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(value: Any) -> bool:
    return _int(value) and 0 <= value <= MAX_TOKEN_ID


# -- shape: what routing reads (``Router.parse``) ---------------------------------------------


def _model(value: Any) -> Problem | None:
    if isinstance(value, str) and value:
        return None
    return "missing required field: model (a non-empty string)", "missing_field"


def _messages(value: Any) -> Problem | None:
    if not isinstance(value, list) or not value:
        return "messages must be a non-empty array", "missing_field"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string role", "invalid_request"
    return None


def _prompt(value: Any) -> Problem | None:
    if not isinstance(value, str | list) or (isinstance(value, list) and not value):
        return "prompt must be a string or a non-empty array", "missing_field"
    if isinstance(value, list) and not _prompt_list(value):
        return "prompt must be strings or arrays of token ids", "invalid_request"
    return None


def _prompt_list(prompt: list[Any]) -> bool:
    first = prompt[0]
    if isinstance(first, str):
        return all(isinstance(p, str) for p in prompt)
    if _int(first):
        return all(_token_id(t) for t in prompt)
    return all(isinstance(p, list) and p and all(_token_id(t) for t in p) for p in prompt)


def _stream(value: Any) -> Problem | None:
    return None if isinstance(value, bool) else ("stream must be a boolean", "invalid_request")


def _integer(name: str) -> Callable[[Any], Problem | None]:
    def check(value: Any) -> Problem | None:
        if value is None or _int(value):
            return None
        return f"{name} must be an integer", "invalid_request"

    return check


_TOKEN_IDS = {"type": "array", "minItems": 1,
              "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}  # fmt: skip
MODEL = (FieldRule("model", {"type": "string", "minLength": 1}, _model, required=True),)
LENGTHS = (
    FieldRule("stream", {"type": "boolean"}, _stream),
    FieldRule("max_tokens", {"type": ["integer", "null"]}, _integer("max_tokens")),
    FieldRule(
        "max_completion_tokens",
        {"type": ["integer", "null"]},
        _integer("max_completion_tokens"),
    ),
)
CHAT: tuple[FieldRule, ...] = (
    *MODEL,
    FieldRule(
        "messages",
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"type": "string", "description": "system, user, assistant, tool..."},
                    "content": {"description": "text, content parts, or null; the engine's"},
                },
            },
        },
        _messages,
        required=True,
    ),
    *LENGTHS,
)
COMPLETION: tuple[FieldRule, ...] = (
    *MODEL,
    FieldRule(
        "prompt",
        {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "string"}},
                _TOKEN_IDS,
                {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
            ]
        },
        _prompt,
        required=True,
    ),
    *LENGTHS,
)


# -- limits: what one request may make an engine do (``Edge.check_sampling``) -----------------


def _bounded(name: str, low: int, high: int) -> Callable[[Any], Problem | None]:
    def check(value: Any) -> Problem | None:
        if value is None or (name == "logprobs" and isinstance(value, bool)):
            return None  # chat's logprobs is a switch; its count is top_logprobs
        if not _int(value) or value < low:
            kind = "positive" if low else "non-negative"
            message = f"{name} must be a {kind} integer: at least {low}, got {value!r}"
            return message, "invalid_value"
        if value > high:
            return f"{name} is {value}; this router allows at most {high}", "invalid_value"
        return None

    return check


def limit_rules(bounds: Mapping[str, tuple[int, int]]) -> tuple[FieldRule, ...]:
    """The limit rules for ``bounds`` (field -> lowest, highest; ``edge.sampling_limits``)."""
    rules = []
    for name, (low, high) in bounds.items():
        kinds = ["boolean", "integer", "null"] if name == "logprobs" else ["integer", "null"]
        schema = {"type": kinds, "minimum": low, "maximum": high}
        rules.append(FieldRule(name, schema, _bounded(name, low, high)))
    return tuple(rules)


def properties(*tables: tuple[FieldRule, ...]) -> tuple[dict[str, Any], list[str]]:
    """The schema ``properties`` and ``required`` of the fields in ``tables`` (a field in
    two tables, e.g. ``max_tokens``'s type and its limit, gets both schemas)."""
    props: dict[str, Any] = {}
    required: list[str] = []
    for rules in tables:
        for rule in rules:
            props[rule.name] = {**props.get(rule.name, {}), **rule.schema}
            if rule.required and rule.name not in required:
                required.append(rule.name)
    return props, required
