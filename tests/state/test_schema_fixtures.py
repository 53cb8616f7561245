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

import numpy as np
import pytest

import savable_loader as sl
from savable_loader.errors import StateVersionError
from savable_loader.rng import derive_seed
from savable_loader.state import SCHEMA_VERSION, RankState, decode, encode, load_file
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


def test_schema1_dropin_state_keeps_its_numpy_permutation() -> None:
    # Independent of the loader's own order code: the documented legacy derivation.
    state = load_file(DATA / "schema1_dropin.state")
    assert state.config.order_algorithm == "numpy-permutation"  # the default: the field is not in the file
    fresh = new_dropin()  # a loader of this version adopts the state's order
    fresh.restore_state_rank(state)
    got = [int(x) for epoch in range(2) for batch in fresh for x in batch[:, 0]]
    perms = [np.random.Generator(np.random.PCG64(derive_seed(7, "permutation", e))).permutation(40) for e in (0, 1)]
    assert got == perms[0][state.position.consumed :].tolist() + perms[1].tolist()
    assert fresh.save_state_rank().config.order_algorithm == "numpy-permutation"  # and it is written on


def test_new_drop_in_states_write_the_feistel_order() -> None:
    assert new_dropin().save_state_rank().config.order_algorithm == "feistel-1"


def new_dropin() -> sl.SavableDataLoader:
    """The fixture's drop-in loader as this version builds it (no older state restored)."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=7)
    return sl.SavableDataLoader(RandomMapDataset(40), batch_size=4, shuffle=True, worker_config=wc)


def test_newer_schema_asks_to_upgrade() -> None:
    with pytest.raises(StateVersionError, match="upgrade savable-loader") as info:
        load_file(DATA / "future_schema.state")
    assert "999" in str(info.value) and str(SCHEMA_VERSION) in str(info.value)
