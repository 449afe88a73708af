"""Data flows one way, so imports do too: index <- policies <- {router, sim, agent}.

Read from the source with ``ast`` (nothing is imported): which package may import which,
and no import cycle among modules at load time. Imports under ``TYPE_CHECKING`` are
annotations only, and imports inside functions are deliberate lazy edges (the CLI's
subcommands, the demo's simulator workload); both are left out of the cycle check, not
out of the package rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("index", "policies", "router", "sim", "agent")

# Package -> the project packages it may import.
ALLOWED: dict[str, set[str]] = {
    "index": set(),
    "policies": {"index"},
    "router": {"index", "policies"},
    "sim": {"index", "policies", "router"},
    "agent": {"index", "policies", "router"},
}
# The only module -> package edges outside those rules.
EXCEPTIONS = {("router.demo", "sim")}  # the demo entry point drives the simulator's workload


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at load time?) for every project import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                visit(stmt, False)
            for stmt in node.orelse:
                visit(stmt, eager)
            return
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            eager = False
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        found.extend((name, eager) for name in names if name.split(".")[0] in PACKAGES)
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(tree, True)
    return found


def test_packages_import_only_downstream() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        pkg = module.split(".")[0]
        for name, _ in _imports(path, module):
            target = name.split(".")[0]
            if target == pkg or target in ALLOWED[pkg] or (module, target) in EXCEPTIONS:
                continue
            wrong.append(f"{module} imports {name}")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                walk(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    return cycles


def test_no_import_cycles_at_load_time() -> None:
    modules = _modules()
    graph = {
        module: {name for name, eager in _imports(path, module) if eager and name in modules}
        - {module}
        for module, path in modules.items()
    }
    # a module reaching its own package's __init__ (which re-exports it) is left out
    for module in graph:
        graph[module] = {m for m in graph[module] if not module.startswith(m + ".")}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rule can fail: a leaf module importing the router is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("import router.app\nif TYPE_CHECKING:\n  import sim\ndef f():\n  import agent\n")
    assert _imports(bad, "index.bad") == [("router.app", True), ("sim", False), ("agent", False)]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
