"""The request field rules (router/http/fields.py): the hot path's checks and the schemas
``/openapi.json`` publishes come from one table, and agree on every value tried."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from router.config import RouterConfig
from router.http import fields
from router.http.edge import Edge, sampling_limits
from router.http.errors import ApiError
from router.http.fields import FieldRule, check_fields, limit_rules, properties
from router.http.openapi import completion_paths

LIMITS = limit_rules(sampling_limits(RouterConfig(max_n=4, max_tokens=100, max_top_logprobs=5)))
TABLES = {"chat": fields.CHAT, "completion": fields.COMPLETION, "limits": LIMITS}
RULES = [(f"{table}.{r.name}", r) for table, rules in TABLES.items() for r in rules]

# Values at the edges of every rule (JSON as orjson parses it).
CORPUS: list[Any] = [
    None, True, False, 0, 1, -1, 4, 5, 6, 100, 101, 2**31, 2**32 - 1, 2**32, 10**12, 1.5,
    "", "x", "m", [], [""], ["a", "b"], ["a", 1], [1, 2], [0, 2**32 - 1], [0, 2**32], [-1],
    [True], [[1], [2]], [[]], [[1], "a"], [[1, True]], {}, {"role": "user"},
    [{"role": "user"}], [{"role": 1}], [{"content": "x"}], [{"role": "user", "content": None}],
    [{"role": "tool", "content": [{"type": "text", "text": "t"}]}], ["x", {"role": "user"}],
]  # fmt: skip


def agree(rule: FieldRule, value: Any) -> None:
    by_code = rule.check(value) is None
    by_schema = Draft202012Validator(rule.schema).is_valid(value)
    assert by_code == by_schema, (rule.name, value, rule.check(value), rule.schema)


@pytest.mark.parametrize(("where", "rule"), RULES, ids=[w for w, _ in RULES])
def test_each_check_accepts_exactly_what_its_schema_accepts(where: str, rule: FieldRule) -> None:
    Draft202012Validator.check_schema(rule.schema)
    for value in CORPUS:
        agree(rule, value)


# JSON Schema counts 1.0 as an integer (it sees numbers, not how they were written); the
# router, like the engines' strict parsers, takes only integers written as integers, so
# the generated values leave out floats with no fractional part.
_scalars = (
    st.none() | st.booleans() | st.integers(-3, 2**33) | st.text(max_size=3)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
)  # fmt: skip
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["role", "content", "x"]), inner, max_size=2),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(value=_json)
def test_checks_and_schemas_agree_on_generated_values(value: Any) -> None:
    for _, rule in RULES:
        agree(rule, value)


def test_a_missing_required_field_is_refused_and_the_schema_requires_it() -> None:
    for rules in (fields.CHAT, fields.COMPLETION):
        _, required = properties(rules)
        assert required == [r.name for r in rules if r.required] and "model" in required
        for name in required:
            body = {r.name: _valid(r) for r in rules if r.required and r.name != name}
            with pytest.raises(ApiError) as err:
                check_fields(body, rules)
            assert err.value.param == name and err.value.code == "missing_field"


def _valid(rule: FieldRule) -> Any:
    return next(v for v in CORPUS if v is not None and rule.check(v) is None)


def test_the_published_schemas_are_the_rules() -> None:
    cfg = RouterConfig(max_n=4, max_tokens=100, max_top_logprobs=5)
    paths = completion_paths(cfg)
    for path, rules in (("/v1/chat/completions", fields.CHAT),
                        ("/v1/completions", fields.COMPLETION)):  # fmt: skip
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props, required = properties(rules, LIMITS)
        assert schema["required"] == required
        for name, part in props.items():
            assert schema["properties"][name] == part, (path, name)
    # and the limits the edge enforces are the ones published
    body = {"model": "m", "prompt": "p", "n": 5}
    with pytest.raises(ApiError, match="at most 4") as err:
        Edge(cfg).check_sampling(body)
    assert err.value.param == "n"
    assert not Draft202012Validator(paths["/v1/completions"]["post"]["requestBody"]["content"]
                                    ["application/json"]["schema"]).is_valid(body)  # fmt: skip
