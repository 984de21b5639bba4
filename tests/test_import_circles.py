"""No import circle: the package's import graph has no cycle, lazy imports included.

A function-local import (``def f(): from protein_performer.data.inputs import open_input``)
hides a circle from Python's load order, not from the design: the two modules still need each
other, so neither can be read, tested or moved alone (issue 44). Every ``import`` and
``from ... import`` of a ``protein_performer`` module counts, at module level or inside a
function; only ``if TYPE_CHECKING:`` blocks are left out (annotations, never run). Parsed with
``ast``; nothing is imported. ``importlib.import_module`` calls (the core registry's scan of its
folder) are not imports the graph can see.

``from package import name`` is an edge to the submodule when ``name`` is one, else to the
package (its ``__init__``, for an attribute). A module's enclosing packages, which Python loads
before it, are not edges: a package whose ``__init__`` re-exports its submodules is not a circle.
"""

from __future__ import annotations

import ast

import pytest

from tests.test_import_floors import PACKAGE, ROOT, from_target, module_name, package_modules


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _known(name: str) -> str:
    """The longest prefix of ``name`` that is a module of the package."""
    parts = name.split(".")
    while parts and not _is_module(".".join(parts)):
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    found: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return found


def import_edges(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module of the package) for every runtime import in ``source``."""
    edges: list[tuple[int, str]] = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = from_target(module, node, is_package)
            targets = [
                f"{origin}.{alias.name}" if _is_module(f"{origin}.{alias.name}") else origin
                for alias in node.names
            ]
        else:
            continue
        edges += [
            (node.lineno, _known(t))
            for t in targets
            if t.split(".")[0] == PACKAGE and _known(t) != module
        ]
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: the first line importing it}."""
    graph: dict[str, dict[str, int]] = {}
    for path in package_modules():
        name = module_name(path)
        out = graph.setdefault(name, {})
        for line, target in import_edges(
            name, path.read_text(encoding="utf-8"), path.name == "__init__.py"
        ):
            out.setdefault(target, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted, the list sorted: every module of a component reaches every other one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
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
                    work.append((child, iter(sorted(graph.get(child, {})))))
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
                    found.append(sorted(component))
    return sorted(found)


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """The edges inside one circle, ``a:LINE -> b``."""
    members = set(component)
    return "; ".join(
        f"{a}:{line} -> {b}"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    )


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert len(graph) > 60 and sum(map(len, graph.values())) > 200  # the graph was read
    found = circles(graph)
    assert not found, "import circles:\n  " + "\n  ".join(describe(graph, c) for c in found)


def _graph_of(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    return {
        name: {target: line for line, target in import_edges(name, source)}
        for name, source in sources.items()
    }


DATA, IO = f"{PACKAGE}.data", f"{PACKAGE}.io"


@pytest.mark.parametrize(
    "sources",
    [
        {  # both lazy: the circle issue 44 found between inputs and homology
            f"{DATA}.inputs": "def f():\n    from protein_performer.data.homology import a",
            f"{DATA}.homology": "def g():\n    from protein_performer.data.inputs import b",
        },
        {  # one at the top, one lazy, through a third module
            f"{IO}.outputs": "from protein_performer.io.sharding import detect_ranks",
            f"{IO}.sharding": "from protein_performer.io import atomic",
            f"{IO}.atomic": "def h():\n    import protein_performer.io.outputs",
        },
        {  # relative imports
            f"{IO}.outputs": "from .sharding import detect_ranks",
            f"{IO}.sharding": "def f():\n    from . import outputs",
        },
        {  # the package's lazy entry point and a read of its attribute
            PACKAGE: "def f():\n    from protein_performer.training.linearize import fit",
            f"{PACKAGE}.training.linearize": "from protein_performer.interop.export import e",
            f"{PACKAGE}.interop.export": "def f():\n    from protein_performer import __version__",
        },
    ],
)
def test_a_circle_is_found(sources: dict[str, str]) -> None:
    graph = _graph_of(sources)
    assert circles(graph) == [sorted(sources)], graph


@pytest.mark.parametrize(
    "sources",
    [
        {  # a chain downward
            f"{DATA}.inputs": "from protein_performer.data.hits import hit_coordinates",
            f"{DATA}.homology": "from protein_performer.data.inputs import open_input\n"
                                "from protein_performer.data.hits import Homolog",
        },
        {  # a package re-exporting a submodule that imports a sibling through the package
            f"{PACKAGE}.model.favor": "from protein_performer.model.favor.module import F",
            f"{PACKAGE}.model.favor.module": "from protein_performer.model.favor import recurrent",
        },
        {  # annotations only
            f"{PACKAGE}.interop.identity": "from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n"
                                           "    from protein_performer.interop.record import L",
            f"{PACKAGE}.interop.record": "from protein_performer.interop.identity import w",
        },
    ],
)  # fmt: skip
def test_no_circle_is_reported_where_there_is_none(sources: dict[str, str]) -> None:
    assert circles(_graph_of(sources)) == []


def test_the_graph_reads_the_real_files() -> None:
    """A module of the package is found by its file, and ``from pkg import submodule`` points
    at the submodule."""
    assert _is_module(f"{PACKAGE}.model.favor.recurrent")
    assert not _is_module(f"{PACKAGE}.model.favor.FavorState")
    source = "from protein_performer.model.favor import FavorState, recurrent"
    edges = {t for _, t in import_edges(f"{PACKAGE}.model.decode", source)}
    assert edges == {f"{PACKAGE}.model.favor", f"{PACKAGE}.model.favor.recurrent"}
