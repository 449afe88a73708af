"""``python3 -m router.config.docs > docs/configuration.md``: every setting, from its
declaration.

Each setting is one field of a section in ``router.config.settings``: its name is the TOML
key, ``CACHE_ROUTER_<NAME>`` its environment variable, its ``setting(...)`` the default,
the bounds and the flag's help. What a setting means is the flag's help, else the comment
on or above its line; so the page is as current as the declarations, and
tests/test_docs.py fails when docs/configuration.md was not regenerated after a change.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

from router.config import settings as s

SOURCE = Path(s.__file__)

HEAD = """# Configuration

Generated from the settings' declarations (`router/config/settings.py`) by
`python3 -m router.config.docs > docs/configuration.md`; tests/test_docs.py fails when it
is stale. Do not edit by hand.

Every setting has one flat name. Layers, each over the one before: the default, the TOML
file (`--config router.toml`), the `CACHE_ROUTER_<NAME>` environment variable, the
command-line flag (the settings that have one). Tables (workers, models, arms, ...) come
from TOML only, except where noted. `cache-router serve --help` lists the flags.
"""


def _comments() -> tuple[dict[int, str], set[int]]:
    """Line number -> the comment text on that line; the lines that are only a comment."""
    out, alone = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(SOURCE.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                alone.add(tok.start[0])
    return out, alone


Lines = dict[tuple[str, str], tuple[int, int]]


def _field_lines() -> Lines:
    """(class, field) -> (first, last) line of the field's declaration."""
    out = {}
    for node in ast.walk(ast.parse(SOURCE.read_text())):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    span = (stmt.lineno, stmt.end_lineno or stmt.lineno)
                    out[(node.name, stmt.target.id)] = span
    return out


Comments = tuple[dict[int, str], set[int]]


def _meaning(where: tuple[str, str], flag: str | None, lines: Lines, comments: Comments) -> str:
    """The flag's help, else the comments in and right above the declaration."""
    if flag:
        return flag
    text, alone = comments
    first, last = lines[where]
    inline = [text[n] for n in range(first, last + 1) if n in text]
    above: list[str] = []
    n = first - 1
    while n in alone:
        above.insert(0, text[n])
        n -= 1
    return " ".join(above + inline)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return "unset" if f.default is None else f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return f"`{value!r}`" if value else "empty"
    return ""


def _number(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _bounds(r: s.Range | None) -> str:
    if r is None:
        return ""
    low = f"> {_number(r.low)}" if r.low_open else f">= {_number(r.low)}"
    return f"{low}, <= {_number(r.high)}"


def _hint(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return text.replace("typing.", "").replace("|", "\\|")


def _type(name: str) -> str:
    if name in s.TABLES:
        return "table"
    scalar = s.SCALARS[name]
    choices = " \\| ".join(f"`{c}`" for c in scalar.choices)
    kind = choices or scalar.kind.__name__
    return kind + (" or unset" if scalar.optional else "")


TABLE_ENV = {"workers": "`CACHE_ROUTER_WORKERS` (`ID=URL,...`)",
             "api_keys": "`CACHE_ROUTER_API_KEYS` (comma-separated)",
             "discovery": "`CACHE_ROUTER_DISCOVER` (comma-separated)",
             "kubernetes": "`CACHE_ROUTER_DISCOVER` (`k8s://...` entries)"}  # fmt: skip
TABLE_FLAG = {"workers": "`--worker [ROLE:]ID=URL` (repeatable)",
              "discovery": "`--discover dns://NAME:PORT|srv://NAME` (repeatable)",
              "kubernetes": "`--discover k8s://NAMESPACE?selector=...` (repeatable)"}  # fmt: skip


def _row(section: type, f: dataclasses.Field[Any], lines: Lines, comments: Comments) -> str:
    name = f.name
    flag = f.metadata.get("flag")
    if name in s.TABLES:
        env, flag_text = TABLE_ENV.get(name, ""), TABLE_FLAG.get(name, "")
    else:
        env = f"`{s.ENV_PREFIX}{name.upper()}`"
        flag_text = f"`--{name.replace('_', '-')}`" if flag else ""
    meaning = _meaning((section.__name__, name), flag, lines, comments).replace("|", "\\|")
    bounds = _bounds(f.metadata.get("range"))
    cells = [f"`{name}`", _type(name), _default(f), bounds, env, flag_text, meaning]
    return "| " + " | ".join(cells) + " |"


def _spec_table(title: str, cls: type, lines: Lines, comments: Comments) -> list[str]:
    out = [f"### {title}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = _default(f) or "required"
        meaning = _meaning((cls.__name__, f.name), None, lines, comments).replace("|", "\\|")
        out.append(f"| `{f.name}` | `{_hint(hints[f.name])}` | {default} | {meaning} |")
    return [*out, ""]


def render() -> str:
    lines, comments = _field_lines(), _comments()
    out = [HEAD]
    for section in s.SECTIONS:
        doc = " ".join((section.__doc__ or "").split())
        out += [f"## {section.__name__}", "", doc, ""]
        out += ["| TOML key | type | default | bounds | environment | flag | meaning |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        out += [_row(section, f, lines, comments) for f in dataclasses.fields(section)]
        out.append("")
    out += ["## Table entries", ""]
    for title, cls in (
        ("`[[workers]]`", s.WorkerSpec),
        ("`[[discovery]]` (or `dns://NAME:PORT?key=value`, `srv://NAME?...`)", s.DiscoverySpec),
        ("`[models.NAME]`", s.ModelSpec),
    ):
        out += _spec_table(title, cls, lines, comments)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
