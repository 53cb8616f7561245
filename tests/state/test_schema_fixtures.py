"""States written by earlier versions stay readable (tests/data/, see make_fixtures.py).

Every kept fixture must load with ``load_file``, carry a schema version this library
knows, re-encode to a state that decodes equal, and restore into the loader it was saved
from with an exact continuation of that loader's uninterrupted stream. A schema newer
than the library is refused with an "upgrade savable-loader" error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

import savable_loader as sl
from savable_loader.errors import StateError, StateVersionError
from savable_loader.rng import SEED_FORMULA
from savable_loader.state import SCHEMA_VERSION, RankState, decode, encode, load_file
from savable_loader.state.schema import ORDER_ALGORITHM
from tests.common import RandomMapDataset, assert_streams, epochs_of
from tests.data.make_fixtures import FACTORIES

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).resolve().parents[1] / "data"
MANIFEST: dict[str, dict[str, Any]] = json.loads((DATA / "manifest.json").read_text())


def test_every_state_file_is_in_the_manifest() -> None:
    files = sorted(p.name for p in DATA.glob("schema*.state"))
    assert files and files == sorted(MANIFEST)
    assert any(entry["schema_version"] == 1 for entry in MANIFEST.values())
    assert max(entry["schema_version"] for entry in MANIFEST.values()) <= SCHEMA_VERSION


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_kept_state_decodes_and_restores_exactly(name: str) -> None:
    entry = MANIFEST[name]
    loaded = load_file(DATA / name)
    states = loaded if isinstance(loaded, list) else [loaded]
    assert len(states) == entry["ranks"]
    assert all(isinstance(s, RankState) and s.schema_version == entry["schema_version"] for s in states)
    assert decode(encode(loaded)) == loaded
    factory = FACTORIES[entry["loader"]]
    for rank, state in enumerate(states):
        make = (lambda r=rank: factory(r, len(states))) if len(states) > 1 else factory
        reference = epochs_of(make(), 2)
        flat = [x for e in reference for x in e]
        k = entry["steps"]
        fresh = make()
        fresh.restore_state_rank(state)
        rest = list(fresh) + list(fresh)  # the rest of the saved epoch, then the next one
        assert_streams(rest, flat[k:], f"{name} rank {rank}: continuation")


def test_kept_states_record_the_one_seed_formula_and_order() -> None:
    for name in MANIFEST:
        loaded = load_file(DATA / name)
        for state in loaded if isinstance(loaded, list) else [loaded]:
            assert (state.config.seed_formula, state.config.order_algorithm) == (SEED_FORMULA, ORDER_ALGORITHM), name
    config = new_dropin().save_state_rank().config
    assert (config.seed_formula, config.order_algorithm) == (3, "feistel-1")


def test_a_state_of_an_unreleased_version_is_refused() -> None:
    """``unreleased_dropin.state``: written before ``seed_formula`` and ``order_algorithm``
    existed (seed formula 1, a numpy permutation); it decodes, and a restore refuses it
    with our error naming the field, the value found and the value expected."""
    state = load_file(DATA / "unreleased_dropin.state")
    assert state.schema_version == SCHEMA_VERSION and state.library_version == "0.1.0.dev0"
    assert (state.config.seed_formula, state.config.order_algorithm) == (1, "numpy-permutation")  # defaults
    fresh = new_dropin()
    with pytest.raises(StateError, match=r"config\.seed_formula is 1, expected 3: .*unreleased version"):
        fresh.restore_state_rank(state)
    formula_fixed = msgspec.structs.replace(state, config=msgspec.structs.replace(state.config, seed_formula=3))
    with pytest.raises(
        StateError, match=r"config\.order_algorithm is 'numpy-permutation', expected 'feistel-1': .*unreleased version"
    ):
        fresh.restore_state_rank(formula_fixed)
    assert_streams(list(fresh), epochs_of(new_dropin(), 1)[0], "the refusing loader, from the start")


def new_dropin() -> sl.SavableDataLoader:
    """The fixture's drop-in loader as this version builds it (no older state restored)."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=7)
    return sl.SavableDataLoader(RandomMapDataset(40), batch_size=4, shuffle=True, worker_config=wc)


def test_newer_schema_asks_to_upgrade() -> None:
    with pytest.raises(StateVersionError, match="upgrade savable-loader") as info:
        load_file(DATA / "future_schema.state")
    assert "999" in str(info.value) and str(SCHEMA_VERSION) in str(info.value)
