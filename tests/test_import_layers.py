"""The project's modules import in one direction: every import of a project module is at module
level, points to the importer's layer or one below it (the order of docs/ARCHITECTURE.md,
"Layers"), and no modules import each other in a circle. An import left inside a function (a heavy
or optional package) says why, ``# deferred: <reason>``.

The imports are read from the source with :mod:`ast` (nothing is imported), so the test is fast.
An import under ``if TYPE_CHECKING:`` is read as an import (it names a dependency too).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("mistill", "selection", "analysis", "benchmarks")

LAYERS: tuple[tuple[str, ...], ...] = (
    # the foundation: the package itself, errors, files, logging, processes
    ("mistill", "mistill.errors", "mistill.io", "mistill.progress", "mistill.distributed", "mistill.parent_watch",
     "mistill.results_index"),
    ("mistill.validation",),
    ("mistill.config",),
    # scoring a set of answers: no model, no corpus
    ("mistill.evaluation.parsing", "mistill.evaluation.metrics", "mistill.evaluation.sandbox", "mistill.stats"),
    ("mistill.models",),
    ("mistill.data",),
    ("mistill.tasks",),
    # the instrument, with the span buckets and recomputed attention rows it shares with distillation
    ("mistill.instrument", "mistill.distill.buckets", "mistill.distill.attention_rows"),
    ("mistill.distill", "mistill.evaluation", "mistill.params"),
    ("mistill.tracking",),
    ("mistill.stages", "selection", "analysis", "mistill.deviations", "mistill.runbook"),
    ("benchmarks",),
)
"""The layers, lowest first. A module belongs to the layer of the longest prefix listed (a
package's modules to the package's layer unless a module is listed itself; ``mistill`` stands for
the package's ``__init__`` alone); it may import its own layer and the layers before it."""

FAST_START = frozenset({"mistill.stages.cli", "mistill.runbook"})
"""Command lines that must start fast (``mistill --help``, ``python -m mistill.runbook``): they
alone may import a project module that loads MLflow or torch inside the function that needs it,
each such import marked ``# deferred: <reason>`` (on its line or the comment line above it)."""


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool
    marked_deferred: bool = False


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _project_module(name: str, known: dict[str, Path]) -> str | None:
    """The project module ``name`` loads: itself, else the longest known prefix (an attribute of
    a module); None for a module of another project."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in known:
            return prefix
    return None


def _marker(tree: ast.AST, lines: list[str]):
    """Whether an import says why it is deferred: ``# deferred:`` on its lines, or on a comment
    line above the run of imports it belongs to."""
    import_lines = {n for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                    for n in range(node.lineno, node.end_lineno + 1)}

    def marked(node: ast.stmt) -> bool:
        if any("# deferred:" in line for line in lines[node.lineno - 1: node.end_lineno]):
            return True
        n = node.lineno - 1
        while n >= 1 and (n in import_lines or lines[n - 1].strip().startswith("#")):
            if "# deferred:" in lines[n - 1]:
                return True
            n -= 1
        return False

    return marked


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    marked = _marker(tree, lines)

    def walk(node: ast.AST, in_function: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    target = _project_module(alias.name, known)
                    if target:
                        yield Import(module, target, child.lineno, in_function, marked(child))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                for alias in child.names:
                    # `from package import module` loads the module; `from module import name`, the module
                    target = _project_module(f"{source}.{alias.name}", known)
                    if target != f"{source}.{alias.name}":
                        target = _project_module(source, known)
                    if target:
                        yield Import(module, target, child.lineno, in_function, marked(child))
            yield from walk(child, inside)

    yield from walk(tree, False)


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            inside = module.startswith(prefix + ".") and prefix != "mistill"
            if (module == prefix or inside) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/ARCHITECTURE.md")
    return best


@pytest.fixture(scope="module")
def graph() -> list[Import]:
    known = modules()
    return [imp for module, path in known.items() for imp in imports(module, path, known)
            if imp.imported != imp.importer]


def test_every_module_has_a_layer():
    for module in modules():
        layer_of(module)


def test_no_function_level_imports_of_project_modules(graph):
    found = sorted({(i.importer, i.imported, i.line) for i in graph if i.in_function
                    and not (i.importer in FAST_START and i.marked_deferred)})
    assert not found, ("project modules imported inside functions (import them at module level):\n"
                       + "\n".join(f"  {a}:{line} imports {b}" for a, b, line in found))


def test_no_upward_imports(graph):
    found = sorted({(i.importer, i.imported, i.line) for i in graph
                    if layer_of(i.imported) > layer_of(i.importer)})
    assert not found, ("imports from a lower layer up (see LAYERS):\n"
                       + "\n".join(f"  {a}:{line} imports {b}" for a, b, line in found))


def test_no_circles(graph):
    edges: dict[str, set[str]] = {}
    for i in graph:
        edges.setdefault(i.importer, set()).add(i.imported)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in circles)



def test_deferred_imports_say_why():
    """An import inside a function (of a heavy or optional package) is marked ``# deferred: <reason>``."""
    found = []
    for module, path in modules().items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        marked = _marker(tree, lines)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not marked(node):
                    found.append(f"  {module}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not found, "imports inside functions without a '# deferred: <reason>' comment:\n" + "\n".join(
        sorted(set(found)))
