"""Load the code of docs/recipes.md's blocks into a namespace (shared setup + one recipe)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def recipe_namespace(marker: str) -> dict[str, Any]:
    """The setup block and the first block that contains ``marker``, executed."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPES.read_text(), flags=re.DOTALL)
    namespace: dict[str, Any] = {"__name__": "recipes"}
    exec(compile(blocks[0], f"{RECIPES}:setup", "exec"), namespace)
    block = next(b for b in blocks if marker in b)
    exec(compile(block, f"{RECIPES}:{marker}", "exec"), namespace)
    return namespace
