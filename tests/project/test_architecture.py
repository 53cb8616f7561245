"""docs/architecture.md is true to the code: every module is listed, each package imports
only what the doc's table allows (and says so in its ``__init__``), there is no import
circle, counting imports inside functions, and the rules it states hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import savable_loader

ROOT = Path(savable_loader.__file__).parent
DOC = (ROOT.parent / "docs" / "architecture.md").read_text()
PRIVATE_TORCH = ("torch._utils", "torch.utils.data._utils", "torch.utils.data.dataloader")
UNRULED = {"__init__", "__main__", "_version"}  # the face, the entry point, the version

sys.path.insert(0, str(ROOT.parent / "scripts"))
import import_graph

GRAPH = import_graph.module_graph(ROOT)


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _rules() -> dict[str, set[str]]:
    """The doc's table: package -> what it may import."""
    section = DOC.split("## What may import what", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w]+)` \| (.*) \|$", section, flags=re.MULTILINE)
    face = {"savable_loader": "__init__"}  # the public face, as import_graph.unit names it
    return {name: {face.get(n, n) for n in re.findall(r"`([\w]+)`", allowed)} for name, allowed in rows}


def test_every_module_is_listed() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _modules() if p.name != "__init__.py"}
    top = {n for n in names if "/" not in n}
    listed_top = {n for n in top if f"`{n}`" in DOC}
    packaged = {n for n in names if "/" in n and not n.startswith("wrappers/")}
    listed = {n for n in packaged if f"`{n}`" in DOC}
    assert top == listed_top, f"docs/architecture.md does not list {sorted(top - listed_top)}"
    assert packaged == listed, f"docs/architecture.md does not list {sorted(packaged - listed)}"
    packages = {p.parent.relative_to(ROOT).as_posix() for p in ROOT.rglob("__init__.py") if p.parent != ROOT}
    missing = sorted(p for p in packages if f"**`{p}/`**" not in DOC)
    assert not missing, f"docs/architecture.md has no section for {missing}"


def test_at_most_eight_modules_at_the_top_level() -> None:
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 8, top


def test_no_import_circle_counting_imports_inside_functions() -> None:
    assert import_graph.circles(GRAPH) == []


def test_every_package_imports_only_what_its_row_allows() -> None:
    rules = _rules()
    units = {import_graph.unit(m) for m in GRAPH}
    assert units - UNRULED == set(rules), "the doc's table must have one row per package and top-level module"
    offenders = []
    for module, targets in GRAPH.items():
        here = import_graph.unit(module)
        if here in UNRULED:
            continue
        for target in targets:
            there = import_graph.unit(target)
            if there != here and there not in rules[here]:
                offenders.append(f"{module} -> {target}")
    assert not offenders, f"imports the table of docs/architecture.md does not allow: {offenders}"


@pytest.mark.parametrize("package", sorted(p.parent.name for p in ROOT.glob("*/__init__.py")))
def test_each_package_says_what_it_may_import(package: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
    said = re.search(r"May import: (.*?)\.(\s|$)", doc, flags=re.DOTALL)
    assert said, f"savable_loader/{package}/__init__.py does not say what it may import"
    face = {"savable_loader": "__init__"}
    assert {face.get(n, n) for n in re.findall(r"``([\w]+)``", said.group(1))} == _rules()[package]


def test_shards_stand_apart_and_the_manifest_is_a_leaf() -> None:
    shards = "savable_loader.sources.shards"
    for module, targets in GRAPH.items():
        if module.startswith(shards):
            outside = {t for t in targets if t.startswith("savable_loader.sources") and not t.startswith(shards)}
            assert not outside, f"{module} imports {outside}"
    assert GRAPH[f"{shards}.manifest"] == {"savable_loader.errors"}


def test_only_torch_internals_imports_private_torch() -> None:
    offenders = []
    for path in _modules():
        if path.relative_to(ROOT).as_posix() == "_torch/internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith(PRIVATE_TORCH)]
    assert not offenders, offenders


def test_the_state_package_imports_no_torch() -> None:
    code = "import sys, savable_loader.state as s; s.decode; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_the_loader_never_switches_on_an_engine_name() -> None:
    source = (ROOT / "loader" / "dataloader.py").read_text()
    assert ".kind ==" not in source and ".path_name ==" not in source


def test_the_graph_script_runs_and_reports_no_circle() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT.parent / "scripts" / "import_graph.py")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 circles" in out.stdout


ENGINES = {
    "savable_loader.index.engine",
    "savable_loader.index.sampler_engine",
    "savable_loader.pipeline.engine",
    "savable_loader.pipeline.iterable",
}


def _interface() -> set[str]:
    """The members :class:`Mode`'s docstring lists under "The interface"."""
    from savable_loader.core.engine import Mode

    listed = (Mode.__doc__ or "").split("**The interface**", 1)[1].split("**", 1)[0]
    return set(re.findall(r":(?:attr|meth):`(\w+)`", listed))


def test_only_construction_names_the_engines() -> None:
    for path in sorted((ROOT / "loader").glob("*.py")):
        if path.name == "construction.py":
            continue
        named = GRAPH[import_graph.module_name(path, ROOT)] & ENGINES
        assert not named, f"loader/{path.name} imports {named}: it must reach an engine through core.engine.Mode"


def test_the_loader_reaches_an_engine_only_through_the_interface() -> None:
    interface = _interface()
    assert 10 <= len(interface) <= 14, sorted(interface)
    used = set()
    for path in sorted((ROOT / "loader").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in ("mode", "_mode"):
                used.add((path.name, node.attr))
    outside = sorted(f"{file}: mode.{attr}" for file, attr in used if attr not in interface)
    assert not outside, f"the loader uses engine members outside the interface: {outside}"
