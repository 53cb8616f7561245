"""savable_loader.rng.code_refs: what a dataset's code reaches (module globals its methods
read, closure cells, default arguments), for the user's code only."""

from __future__ import annotations

import json
import random

import numpy as np

from savable_loader.rng.code_refs import code_children, is_user_function

SHARED = random.Random(0)
UNUSED = random.Random(1)


def helper(x: int, scale: int = 2, *, rng: random.Random = SHARED) -> int:
    return x * scale + rng.randrange(4)


class Reads:
    def __getitem__(self, i: int) -> list[int]:
        return [helper(i) for _ in range(2)]  # read inside a comprehension


def test_a_class_s_methods_reach_the_globals_they_read_and_no_others() -> None:
    found = dict(code_children("d", Reads()))
    assert found == {"d<global helper>": helper}
    assert "d<global UNUSED>" not in found


def test_a_function_s_closure_defaults_and_globals() -> None:
    gen = np.random.default_rng(0)

    def outer() -> int:
        return int(gen.integers(3)) + helper(1)

    assert dict(code_children("f", outer)) == {"f<closure gen>": gen, "f<global helper>": helper}
    assert dict(code_children("h", helper)) == {"h<default 0>": 2, "h<kwdefault rng>": SHARED}


def test_only_the_user_s_functions_are_read() -> None:
    assert is_user_function(helper) and is_user_function(lambda: 0)
    assert not is_user_function(json.dumps)  # the standard library
    assert not is_user_function(np.random.default_rng) and not is_user_function(len)
    assert list(code_children("j", json.dumps)) == []
