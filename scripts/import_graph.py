"""The import graph of savable_loader: every import of one of its modules by another, at
the top of a file, inside a function or under ``TYPE_CHECKING`` alike.

Run from the repository root::

    python scripts/import_graph.py              # packages, arrows between them, circles
    python scripts/import_graph.py --modules    # every module and what it imports
    python scripts/import_graph.py --dot > graph.dot   # for Graphviz: dot -Tpng graph.dot

``tests/project/test_architecture.py`` checks the rules of ``docs/architecture.md`` on the
same graph (:func:`module_graph`): no circle, counting imports inside functions too.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "savable_loader"


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, here: str, is_package: bool, files: dict[str, Path]) -> Iterator[str]:
    """The modules of the package an import statement names (``from pkg import name``
    names ``pkg.name`` when that is a module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            package = here if is_package else here.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base


def module_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package (dotted name) -> the modules of the package it imports,
    wherever the import stands (top, function, ``TYPE_CHECKING``); a package's
    ``__init__`` is the module named like the package."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = {
            target
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            for target in _imported(node, name, path.name == "__init__.py", files)
        }
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def unit(module: str) -> str:
    """The package a module belongs to (``savable_loader.index.engine`` -> ``index``; a
    top-level module is its own unit)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "__init__"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="list every module and its imports")
    parser.add_argument("--dot", action="store_true", help="print the package graph in Graphviz form")
    args = parser.parse_args(argv)
    graph = module_graph()
    units: dict[str, set[str]] = {}
    for a, targets in graph.items():
        units.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    if args.dot:
        print("digraph savable_loader {")
        for a in sorted(units):
            print(f'  "{a}";')
            for b in sorted(units[a]):
                print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    if args.modules:
        for a in sorted(graph):
            print(f"{a}: {', '.join(sorted(graph[a])) or '-'}")
    else:
        for a in sorted(units):
            print(f"{a} -> {', '.join(sorted(units[a])) or '-'}")
    found = circles(graph)
    print(f"\n{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(found)} circles")
    for c in found:
        print("circle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
