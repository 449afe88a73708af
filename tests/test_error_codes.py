"""Error codes and ``errors_total`` kinds are a closed set (``router.http.errors``).

Every call site that names a code with a literal is read from the source (``ast``), so
a new code must be added to ``ErrorCode`` (or a new kind to ``ErrorKind``) on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

from router.forward.relay import CLUSTER_UNAVAILABLE, SEND_FAILURES
from router.http.errors import ERROR_CODES, ERROR_KINDS

ROOT = Path(__file__).resolve().parent.parent
# callable name -> position of its code argument (or its keyword ``code``)
CODE_AT = {"ApiError": 2, "error_body": 2, "sse_error": 1, "_refuse": 2, "_bad": 2}


def _literal_codes() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(where, code) for every literal code, and (where, kind) for every literal kind."""
    codes, kinds = [], []
    for path in sorted([*ROOT.glob("router/**/*.py"), *ROOT.glob("sim/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name in CODE_AT:
                args = [*node.args[CODE_AT[name] : CODE_AT[name] + 1]]
                args += [k.value for k in node.keywords if k.arg == "code"]
                codes += [(where, a.value) for a in args if isinstance(a, ast.Constant)]
            if name == "error" and isinstance(func, ast.Attribute) and len(node.args) == 3:
                kind = node.args[2]
                if isinstance(kind, ast.Constant):
                    kinds.append((where, kind.value))
    return codes, kinds


def test_every_code_and_kind_in_the_source_is_declared() -> None:
    codes, kinds = _literal_codes()
    assert len(codes) > 30 and kinds  # the scan sees the call sites
    unknown = [f"{w} {c!r}" for w, c in codes if c not in ERROR_CODES]
    unknown += [f"{w} kind {k!r}" for w, k in kinds if k not in ERROR_KINDS]
    assert not unknown, "add to router.http.errors.ErrorCode / ErrorKind:\n" + "\n".join(unknown)


def test_the_proxy_failure_table_uses_declared_names() -> None:
    for failure in [f for _, f in SEND_FAILURES] + [CLUSTER_UNAVAILABLE]:
        assert failure.code in ERROR_CODES and failure.kind in ERROR_KINDS
