"""Golden values of every seed formula (savable_loader.rng.formulas): the streams of every
saved state depend on them, so a refactor that changes one must fail here. And no module
but ``rng.formulas`` (and the primitives in ``rng``) derives a seed from a namespace."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import savable_loader
from savable_loader.rng import derive_seed
from savable_loader.rng import formulas as S

GOLDEN = [
    ("sample_base", S.sample_base(7, ("sample",), 3), 10093222609530028193),
    ("sample_item", S.sample_item(12345, 17), 168974444027492382),
    ("collate_seed", S.collate_seed(7, 3, 16), 2459627284196217753),
    ("owned_stream_seed", S.owned_stream_seed(7, ("sampler", 1)), 11309229396052606201),
    ("owned_stream_seed own order", S.owned_stream_seed(7, ("sample",)), 7),
    ("owned_rng_base", S.owned_rng_base(7, 3, "dataset.rng"), 3540287442383536900),
    ("pcg_increment", S.pcg_increment(99), 131498591603535047220450273677562599765),
    ("engine_generator_seed", S.engine_generator_seed(7, 3), 7125898274847677007),
    ("sampler_seed", S.sampler_seed(7, 1, 3), 10008236550795204982),
    ("pipeline_base", S.pipeline_base(7, 1, 2, 3), 2177723346779873004),
    ("pipeline_item", S.pipeline_item(12345, 5), 6217189988962137646),
    ("key_seed", S.key_seed(7, 3, (1,), "RangeSource", "[4]"), 6358320015103172491),
    ("key_prefix", S.key_prefix(7, 3, (1,), "RangeSource"), b"7\x1fkey\x1f3\x1f1\x1fRangeSource\x1f"),
    ("key_seed_of", S.key_seed_of(S.key_prefix(7, 3, (1,), "RangeSource"), b"[4]"), 6358320015103172491),
    ("sample_items", S.sample_items(12345, [17]), [168974444027492382]),
    ("worker_seed", S.worker_seed(7, 1, 2), 8296181787550485606),
    ("worker_epoch_seed", S.worker_epoch_seed(7, 1, 2, 3, (4,)), 9593139345557521410),
    ("draw", S.draw(12345, 6), 2262534019502804546),
    ("feistel_key", S.feistel_key(7, 3), 12199752852984971372),
    ("shard_order_seed", S.shard_order_seed(7, (3, 1)), 13128273705462840260),
    ("shard_samples_seed", S.shard_samples_seed(7, (3, 1), 5), 7841282420573183072),
    ("torch_iterable_base", S.torch_iterable_base(7, 1, 2, 3, (4,)), 17581849285874706381),
    ("torch_worker_info_seed", S.torch_worker_info_seed(7, 1, 2, 3, (4,)), 8788869791747196609),
    ("undeclared_rngs_seed", S.undeclared_rngs_seed(7, 3), 1565907000821936681),
    ("datapipe_shuffle_seed", S.datapipe_shuffle_seed(7, 3, (4,)), 6035231451759496595),
]


@pytest.mark.parametrize(("name", "got", "want"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden_values(name: str, got: int, want: int) -> None:
    assert got == want, f"{name} changed: every stream it seeds (and every saved state) would change"


def test_every_formula_is_pinned() -> None:
    pinned = {name.split()[0] for name, _, _ in GOLDEN}
    assert pinned == set(S.__all__) - {"NAMESPACES"}


def test_item_seeds_are_below_2_63() -> None:
    assert all(S.sample_item(b, p) < 2**63 for b in (0, 2**64 - 1, 12345) for p in range(50))


def test_only_the_seeds_module_names_namespaces() -> None:
    root = Path(savable_loader.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() in ("rng/formulas.py", "rng/seeding.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "derive_seed":
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not offenders, f"seed formulas outside savable_loader/rng/formulas.py: {offenders}"


def test_namespaces_are_the_ones_used() -> None:
    source = Path(S.__file__).read_text().split("NAMESPACES = (", 1)[1]
    used = set(re.findall(r'derive_seed\([^)]*?"([a-z-]+)"', source))
    # "sample" is the salt of the loader's own order (sample_base's salt argument)
    assert used | {"sample"} == set(S.NAMESPACES)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 64, 200])
@pytest.mark.parametrize("base", [0, 12345, 2**63, 2**64 - 1])
def test_sample_items_are_the_per_sample_formula(count: int, base: int) -> None:
    # the batch path (NumPy's wrapping uint64 arithmetic from 16 positions on) gives the
    # seeds of sample_item, position by position, up to the largest positions
    positions = list(range(0, 2 * count, 2))
    if count >= 2:
        positions[-2:] = [2**63 - 2, 2**64 - 2]
    assert S.sample_items(base, positions) == [S.sample_item(base, p) for p in positions]
    assert all(type(x) is int for x in S.sample_items(base, positions))


@pytest.mark.parametrize(
    "key_text", ["4", "[3,12345,0]", '["a",[1,2.5],{"k":null}]', '"\u00e9t\u00e9 \u2603"', "true", "-7"]
)
def test_key_seed_of_a_prefix_is_the_key_formula(key_text: str) -> None:
    text = json.dumps(json.loads(key_text), ensure_ascii=False, separators=(",", ":"))
    prefix = S.key_prefix(2**64 - 1, 9, (0, 3), "Src")
    expected = derive_seed(2**64 - 1, "key", 9, 0, 3, "Src", text)
    assert S.key_seed_of(prefix, text.encode()) == expected == S.key_seed(2**64 - 1, 9, (0, 3), "Src", text)


#: What the seed formula (3) gives the three global generators from one seed: NumPy's first
#: words, torch's first words, Python's first 32 bits after ``seed_global(123456789123)``.
GLOBAL_GOLDEN = ([1030625977, 680601513, 796467562], [2137898522, 1743473606, 1954145021], 2955483530)


@pytest.mark.parametrize("how", ["seed_global", "global_seeder", "global_seeder per generator"])
def test_golden_global_draws(how: str) -> None:
    import random

    import numpy as np
    import torch

    from savable_loader.rng import GLOBAL_RNG_NAMES, global_seeder, preserve_global_rng, seed_global

    with preserve_global_rng():
        if how == "seed_global":
            seed_global(123456789123)
        elif how == "global_seeder":
            global_seeder(GLOBAL_RNG_NAMES)(123456789123)
        else:  # the partial seeders of global_rngs=... seed each generator as seed_global does
            global_seeder(("numpy",))(123456789123)
            global_seeder(("random", "torch"))(123456789123)
        got = (np.random.randint(0, 2**31, 3).tolist(), torch.randint(0, 2**31, (3,)).tolist(), random.getrandbits(32))
    assert got == GLOBAL_GOLDEN, "the global streams changed: every state would resume into other data"


def test_golden_numpy_words() -> None:
    from savable_loader.rng import SEED_FORMULA, numpy_word

    assert SEED_FORMULA == 3
    assert numpy_word(123456789123) == 4047244993
    assert numpy_word(2**64 - 1) == 1640531526 and numpy_word(2**64 + 5) == numpy_word(5)
    # all 64 bits count: seeds with one low word get different NumPy words
    assert len({numpy_word(lo | hi << 32) for lo in (0, 7) for hi in range(64)}) == 128
