"""Every Sphinx cross-reference in the package's docstrings (and the test fixtures', vam_testing)
names something that exists.

Docstrings point at other code with roles such as :mod:`.engine`,
:func:`..core.layout.kernel_block_ids` or :class:`~.wire.RegionInfo`. A module moved or a function
renamed leaves such a reference pointing nowhere, and nothing but a reader notices. Here each
module is imported (``__main__`` modules are not: importing one runs the program) and each
reference in its module, class and function docstrings and its ``#:`` comments (an attribute's
docstring for autodoc) resolved:

* leading dots: relative to the module's package, as ``from . import`` reads them (one dot the
  package the module is in, each further dot one package up), then a chain of attributes;
* otherwise first where the docstring is (the enclosing classes, innermost first, then the
  module's namespace), then as a builtin, then as an absolute name (imported, then a chain of
  attributes).

``~`` (shorten what is shown) and ``!`` (no link) are dropped first. A class's fields declared
but not set on the class (dataclass, msgspec, annotations, slots) count. An absolute name whose
top package cannot be imported here (an optional dependency) is accepted if that name reads as a
package's (lower case, not this package, not a name where the reference is).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from types import ModuleType

import pytest

import vam_testing
import vllm_ascend_mooncake

NAME = vllm_ascend_mooncake.__name__
#: The packages whose docstrings are checked: the shipped one and the test fixtures beside it.
PACKAGES = (vllm_ascend_mooncake, vam_testing)
ROLES = ("mod", "func", "class", "meth", "data", "attr", "exc", "obj", "const")
REFERENCE = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`([^`]+)`")
_MISSING = object()


def _modules() -> tuple[dict[str, ModuleType], list[str]]:
    """The packages' modules by name, and those whose import needs a missing optional dependency."""
    modules: dict[str, ModuleType] = {}
    skipped = []
    for package in PACKAGES:
        modules[package.__name__] = package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith(".__main__"):  # runs the program when imported
                continue
            try:
                modules[info.name] = importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                if exc.name is None or exc.name.split(".")[0] in {p.__name__ for p in PACKAGES}:
                    raise
                skipped.append(f"{info.name} (needs {exc.name})")
    return modules, skipped


def _docstrings(tree: ast.Module) -> list[tuple[tuple[str, ...], int, str]]:
    """(enclosing class names, line, text) of the module's, classes' and functions' docstrings; a
    class's names include the class itself."""
    found = []

    def visit(node: ast.AST, classes: tuple[str, ...]) -> None:
        inner = (*classes, node.name) if isinstance(node, ast.ClassDef) else classes
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:  # a class's docstring sees the class's own names
                found.append((inner, node.body[0].lineno, text))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, ())
    return found


def _doc_comments(tree: ast.Module, source: str) -> list[tuple[tuple[str, ...], int, str]]:
    """(enclosing class names, line, text) of the ``#:`` comments that document attributes (what
    autodoc reads as their docstrings); consecutive lines are one comment."""
    classes = []  # (first line, last line, names from the module down)

    def visit(node: ast.AST, names: tuple[str, ...]) -> None:
        if isinstance(node, ast.ClassDef):
            names = (*names, node.name)
            classes.append((node.lineno, node.end_lineno or node.lineno, names))
        for child in ast.iter_child_nodes(node):
            visit(child, names)

    visit(tree, ())
    found: list[tuple[tuple[str, ...], int, str]] = []
    block: list[str] = []
    for number, line in enumerate([*source.splitlines(), ""], start=1):
        stripped = line.strip()
        if stripped.startswith("#:"):
            block.append(stripped[2:])
            continue
        if block:
            first = number - len(block)
            inside = [names for start, end, names in classes if start <= first <= end]
            found.append((max(inside, key=len, default=()), first, "\n".join(block)))
            block = []
    return found


def _has(owner: object, name: str) -> bool:
    """``owner.name`` exists, counting fields declared but not set on the class (dataclass and
    msgspec fields, annotated attributes) and submodules not yet imported."""
    if getattr(owner, name, _MISSING) is not _MISSING:
        return True
    if isinstance(owner, type):
        for klass in owner.__mro__:
            own = vars(klass)
            for declared in ("__annotations__", "__struct_fields__", "__slots__"):
                names = own.get(declared, ())
                if isinstance(names, (dict, tuple, list, set, frozenset)) and name in names:
                    return True
    if isinstance(owner, ModuleType) and hasattr(owner, "__path__"):
        try:
            importlib.import_module(f"{owner.__name__}.{name}")
        except ModuleNotFoundError:
            return False
        return True
    return False


def _walk(owner: object, chain: list[str]) -> bool:
    """Whether the attribute chain ``chain`` resolves from ``owner``."""
    for i, name in enumerate(chain):
        if not _has(owner, name):
            return False
        nxt = getattr(owner, name, _MISSING)
        if nxt is _MISSING:
            if isinstance(owner, ModuleType):
                nxt = importlib.import_module(f"{owner.__name__}.{name}")
            else:  # a declared field: nothing further can be checked on it
                return i == len(chain) - 1
        owner = nxt
    return True


def _absolute(target: str) -> bool | None:
    """Whether ``target`` resolves as an absolute name; None when its top package is missing."""
    parts = target.split(".")
    try:
        owner = importlib.import_module(parts[0])
    except ModuleNotFoundError:
        return None
    return _walk(owner, parts[1:])


def _resolves(module: ModuleType, classes: tuple[str, ...], target: str) -> bool:
    target = target.lstrip("~!").strip()
    if target.endswith("()"):
        target = target[:-2]
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        package = module.__name__ if hasattr(module, "__path__") else module.__package__
        parts = package.split(".")
        if dots > len(parts):
            return False  # more dots than packages
        base = ".".join(parts[: len(parts) - dots + 1])
        rest = target[dots:]
        return _walk(importlib.import_module(base), rest.split(".") if rest else [])
    chain = target.split(".")
    scopes: list[object] = []
    owner: object = module
    for name in classes:  # enclosing classes, outermost first
        owner = getattr(owner, name, None)
        if owner is None:
            break
        scopes.insert(0, owner)
    scopes.append(module)
    if any(_walk(scope, chain) for scope in scopes):
        return True
    if any(_has(scope, chain[0]) for scope in scopes):
        return False  # a local name without the rest of the chain
    if len(chain) == 1 and hasattr(builtins, target):
        return True
    absolute = _absolute(target)
    if absolute is None:  # an optional dependency missing here: only another package's names
        return chain[0] != NAME and chain[0].islower() and len(chain) > 1
    return absolute


def _dangling() -> tuple[list[str], list[str], int]:
    modules, skipped = _modules()
    dangling = []
    count = 0
    for name, module in sorted(modules.items()):
        with open(module.__file__, encoding="utf-8") as file:
            source = file.read()
        tree = ast.parse(source)
        for classes, line, text in _docstrings(tree) + _doc_comments(tree, source):
            for match in REFERENCE.finditer(text):
                count += 1
                if not _resolves(module, classes, match.group(2)):
                    at = line + text.count("\n", 0, match.start())
                    dangling.append(f"{name}:{at}: :{match.group(1)}:`{match.group(2)}`")
    return dangling, skipped, count


def test_every_docstring_reference_resolves() -> None:
    dangling, skipped, count = _dangling()
    assert count > 100, f"only {count} references found: is the pattern still right?"
    assert not dangling, "dangling docstring references:\n" + "\n".join(dangling)
    assert len(skipped) < 10, f"most modules not imported: {skipped}"


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (".side_channel.PeerRefused", True),
        ("~.side_channel.PeerRefused", True),
        ("..core.layout.kernel_block_ids", True),
        ("..core.layout.no_such_function", False),
        (".no_such_module", False),
        ("SideChannelClient.request", True),
        ("SideChannelClient.no_such_method", False),
        ("vllm_ascend_mooncake.datapath.wire.RegionInfo", True),
        ("vllm_ascend_mooncake.datapath.wire.Nowhere", False),
        ("not_a_top_package_here.Thing", True),
        ("NotAPackage.thing", False),
        ("bytes", True),
    ],
)
def test_references_are_resolved_as_the_roles_read_them(target: str, expected: bool) -> None:
    """The resolver itself, from ``datapath/side_channel.py``."""
    module = importlib.import_module(f"{NAME}.datapath.side_channel")
    assert _resolves(module, (), target) is expected
