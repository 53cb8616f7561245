"""docs/architecture.md is true to the code: every module is listed, and the import rules
it states hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import savable_loader

ROOT = Path(savable_loader.__file__).parent
DOC = (ROOT.parent / "docs" / "architecture.md").read_text()
PRIVATE_TORCH = ("torch._utils", "torch.utils.data._utils", "torch.utils.data.dataloader")


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_top_level_module_and_package_is_listed() -> None:
    names = {p.name for p in ROOT.glob("*.py")} | {f"{p.name}/" for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(n for n in names if f"`{n}`" not in DOC and n != "__init__.py")
    assert not missing, f"docs/architecture.md does not list {missing}"


def test_only_torch_internals_imports_private_torch() -> None:
    offenders = []
    for path in _modules():
        if path.name == "_torch_internals.py":
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


def test_the_loader_never_switches_on_a_path_name() -> None:
    source = (ROOT / "loader.py").read_text()
    assert ".kind ==" not in source and ".path_name ==" not in source
