"""Behaviour under ``python -O`` is unchanged: CI runs this module and a part of the suite
with ``python -O -m pytest`` (see .ci/run).

``-O`` strips ``assert`` statements, so no user-facing check may be one; and the test
helpers must still check (tests/conftest.py has pytest rewrite their asserts).
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

import savable_loader as sl
from savable_loader.errors import LoaderUsageError, StateError
from savable_loader.state import decode
from tests.common import assert_same

PACKAGE = Path(sl.__file__).resolve().parent


def test_library_has_no_assert_statements() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not found, f"assert statements vanish under python -O: {found}"


def test_shared_helpers_still_check() -> None:
    with pytest.raises(AssertionError):
        assert_same([1, 2], [1, 3])


def test_user_facing_checks_still_raise() -> None:
    with pytest.raises(LoaderUsageError, match="batch_size"):
        sl.SavableDataLoader(list(range(4)), batch_size=0)
    with pytest.raises(StateError):
        decode(b"\x00garbage")


def test_runs_optimized_when_ci_says_so() -> None:
    # .ci/run's second step sets SAVABLE_LOADER_EXPECT_OPTIMIZE=1 and runs `python -O`
    expected = int(os.environ.get("SAVABLE_LOADER_EXPECT_OPTIMIZE", sys.flags.optimize))
    assert sys.flags.optimize == expected
