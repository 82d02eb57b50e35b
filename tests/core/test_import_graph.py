"""The package's modules import each other without a circle, and the layers point one way.

A circle hidden by a function-level import (as plan.py <-> plan_tokens.py once was) still makes
two modules one: every import counts here, lazy ones too, except those under ``TYPE_CHECKING``
(never run). Read from the sources with ``ast``: no module is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_ascend_mooncake

PACKAGE = Path(vllm_ascend_mooncake.__file__).parent
NAME = PACKAGE.name
#: layer -> the layers it may import (vllm_ascend_mooncake/README.md: imports point one way)
LAYERS = {
    "core": set(),
    "datapath": {"core"},
    "connector": {"core", "datapath"},
}


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a package's own ``__init__`` not counted for
    its submodules: Python imports it first whatever they import)."""
    modules = _module_names()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        skipped = _type_checking_lines(tree)
        imported: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    imported.add(submodule if submodule in modules else source)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {m for m in imported if m in modules and m != name} - ancestors
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    assert _circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_the_graph_sees_function_level_imports() -> None:
    """transport.py once made Mooncake's transport inside a function; such imports count."""
    graph = import_graph()
    assert f"{NAME}.datapath.transport" in graph[f"{NAME}.datapath.mooncake"]
    assert f"{NAME}.connector.worker" in graph[f"{NAME}.connector.facade"]  # lazy, in a method


def test_layers_import_only_the_layers_below() -> None:
    wrong = []
    for module, imported in import_graph().items():
        layer = module.split(".")[1] if module.count(".") else ""
        if layer not in LAYERS:
            continue
        for other in imported:
            other_layer = other.split(".")[1] if other.count(".") else ""
            if other_layer in LAYERS and other_layer != layer and other_layer not in LAYERS[layer]:
                wrong.append(f"{module} imports {other}")
    assert wrong == []


#: Top-level packages of the repository that the wheel does not ship: importing one from the
#: package would break every installed copy.
UNSHIPPED = {"vam_testing", "tests", "benchmarks"}


def test_the_package_imports_nothing_it_does_not_ship() -> None:
    """The test fixtures (vam_testing/), tests and benchmarks sit beside the package, not in it."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            wrong += [
                f"{path.relative_to(PACKAGE.parent)} imports {name}"
                for name in names
                if name.split(".")[0] in UNSHIPPED
            ]
    assert wrong == []
