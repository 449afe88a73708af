"""Data flows one way, so imports do too: index <- policies <- {router, sim, agent}.

Read from the source with ``ast`` (nothing is imported). The rules, each a test:

- which package may import which (the service never imports the simulator: the demo and
  its nats-server live in ``sim/``); no exceptions;
- no import cycle among modules, at load time nor at all: imports under ``TYPE_CHECKING``
  (annotations) and inside functions (lazy) count too, since a circle held together by a
  lazy import or an annotation is still two modules that must be read together (seams are
  small public protocols instead: ``router.forward.relay``, ``EventSink``, ...);
- no package folder with more than 16 modules side by side;
- a package's ``__init__`` says what lives there and imports nothing of the project, so
  importing one module never loads its siblings (``router.config`` re-exports its own).

The CLI maps verbs to module paths as strings (``router.cli.COMMANDS``): no import, so no
edge; its targets are checked to exist by tests/test_contract.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("index", "policies", "router", "sim", "agent")
MAX_MODULES = 16  # per folder, ``__init__`` not counted

# Package -> the project packages it may import.
ALLOWED: dict[str, set[str]] = {
    "index": set(),
    "policies": {"index"},
    "router": {"index", "policies"},
    "sim": {"index", "policies", "router"},
    "agent": {"index", "policies", "router"},
}
# ``__init__`` modules that re-export their own package's modules (public import paths).
REEXPORTS = {"index", "policies", "router.config"}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(imported module, at load time?) for every project import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
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
                parts = package.split(".")
                pkg = parts[: len(parts) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        found.extend((name, eager) for name in names if name.split(".")[0] in PACKAGES)
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(tree, True)
    return found


def _graph(modules: dict[str, Path], eager_only: bool) -> dict[str, set[str]]:
    graph = {
        module: {n for n, eager in _imports(path, module) if (eager or not eager_only)}
        for module, path in modules.items()
    }
    # ``from pkg import mod`` names both ``pkg`` and ``pkg.mod``: keep the modules only, and
    # leave out a module reaching its own package's ``__init__`` (which may re-export it)
    return {
        module: {
            n for n in names if n in modules and n != module and not module.startswith(n + ".")
        }
        for module, names in graph.items()
    }


def _back_edges(modules: dict[str, Path]) -> list[str]:
    wrong = []
    for module, path in modules.items():
        pkg = module.split(".")[0]
        for name, _ in _imports(path, module):
            target = name.split(".")[0]
            if target != pkg and target not in ALLOWED[pkg]:
                wrong.append(f"{module} imports {name}")
    return wrong


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


def _crowded(root: Path = ROOT) -> list[str]:
    """Package folders holding more than ``MAX_MODULES`` modules."""
    out = []
    for pkg in PACKAGES:
        for init in sorted((root / pkg).rglob("__init__.py")):
            n = sum(1 for p in init.parent.glob("*.py") if p.name != "__init__.py")
            if n > MAX_MODULES:
                out.append(f"{init.parent.relative_to(root)}: {n} modules")
    return out


def _heavy_inits(modules: dict[str, Path]) -> list[str]:
    """``__init__`` modules importing the project, other than the re-exporting ones."""
    return [
        f"{module} imports {name}"
        for module, path in modules.items()
        if path.name == "__init__.py" and module not in REEXPORTS
        for name, _ in _imports(path, module)
    ]


def test_packages_import_only_downstream() -> None:
    wrong = _back_edges(_modules())
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_at_load_time() -> None:
    cycles = _cycles(_graph(_modules(), eager_only=True))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_at_all() -> None:
    """Annotations and lazy imports included: no two modules lean on each other."""
    cycles = _cycles(_graph(_modules(), eager_only=False))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_folder_holds_more_than_16_modules() -> None:
    crowded = _crowded()
    assert not crowded, "\n".join(crowded)


def test_package_inits_are_light() -> None:
    modules = _modules()
    heavy = _heavy_inits(modules)
    assert not heavy, "\n".join(heavy)
    for module, path in modules.items():
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{module}: say what lives here"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rules can fail: a leaf module importing the router is caught, a cycle is, a
    lazy import is an edge, and a crowded folder is."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import router.http.app\nif TYPE_CHECKING:\n  import sim\ndef f():\n  import agent\n"
    )
    assert _imports(bad, "index.bad") == [
        ("router.http.app", True), ("sim", False), ("agent", False),
    ]  # fmt: skip
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    rel = tmp_path / "rel.py"
    rel.write_text("from .forward import relay\nfrom ..config import settings\n")
    assert [n for n, _ in _imports(rel, "router.pd.exchange")] == [
        "router.pd.forward", "router.pd.forward.relay", "router.config", "router.config.settings",
    ]  # fmt: skip
    crowd = tmp_path / "router" / "crowd"
    crowd.mkdir(parents=True)
    (crowd / "__init__.py").write_text('"""A crowd."""\n')
    for i in range(MAX_MODULES + 1):
        (crowd / f"m{i}.py").write_text("")
    assert _crowded(tmp_path) == [f"router/crowd: {MAX_MODULES + 1} modules"]
