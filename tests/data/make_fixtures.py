"""Write the state fixtures of the current schema version into tests/data/.

States written by every released schema version are kept here, and
tests/state/test_schema_fixtures.py decodes them (and restores them) in every later version.
Run this once per new schema version, from the repository root, and commit the new
files; never regenerate or delete the files of older versions once a version with them
is released (the schema-1 files were last regenerated before the first release, for
restore keys and elastic stages):

    python -m tests.data.make_fixtures

Files: ``schema<V>_<name>.state`` (``save_file`` format) and ``manifest.json`` entries
saying which loader (a factory below) and how many steps each state belongs to. The
factories must keep producing the same stream in later versions; if a loader API
changes, adapt the factory, not the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

import savable_loader as sl
from savable_loader.state import SCHEMA_VERSION, encode, save_file
from savable_loader.state.files import _HEADER, FILE_FORMAT, MAGIC, _digest
from savable_loader.wrappers import BatchDataset, MapDataset, ShuffleBufferDataset
from tests.common import RandomMapDataset, RangeSource

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "manifest.json"


def _double(x: Any) -> Any:
    return x * 2


def _seed_formula_1(loader: sl.SavableDataLoader) -> sl.SavableDataLoader:
    """The schema-1 states were written with per-item seed formula 1 (all 64 bits; the
    ``seed_formula`` field did not exist yet) and, on the drop-in path, the materialised
    numpy permutation (``order_algorithm`` did not exist either), which a restore of them
    keeps. The factories make loaders that use them too, through the public API:
    restoring a start state that records both."""
    start = loader.save_state_rank()
    config = msgspec.structs.replace(start.config, seed_formula=1, order_algorithm="numpy-permutation")
    loader.restore_state_rank(msgspec.structs.replace(start, config=config))
    return loader


def dropin(rank: int = 0, world_size: int = 1) -> sl.SavableDataLoader:
    """Drop-in path: shuffled, batched, in-process."""
    wc = sl.WorkerConfig(rank=rank, world_size=world_size, num_workers=0, seed=7)
    return _seed_formula_1(sl.SavableDataLoader(RandomMapDataset(40), batch_size=4, shuffle=True, worker_config=wc))


def pipeline() -> sl.SavableDataLoader:
    """Savable pipeline with 2 workers; the shuffle buffer puts tensors into the state."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=7)
    ds = BatchDataset(MapDataset(ShuffleBufferDataset(RangeSource(30, wc), size=4), _double), batch_size=3)
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, multiprocessing_context="fork")
    return _seed_formula_1(loader)


FACTORIES = {"dropin": dropin, "pipeline": pipeline}


def saved_after(loader: sl.SavableDataLoader, steps: int) -> Any:
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.save_state_rank()
    del it
    return state


def main() -> None:
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    prefix = f"schema{SCHEMA_VERSION}_"
    entries = {
        "dropin": ("dropin", 3, saved_after(dropin(), 3)),
        "pipeline": ("pipeline", 4, saved_after(pipeline(), 4)),
        "global": ("dropin", 2, [saved_after(dropin(r, 2), 2) for r in range(2)]),
    }
    for name, (loader, steps, state) in entries.items():
        file = f"{prefix}{name}.state"
        save_file(HERE / file, state)
        manifest[file] = {
            "loader": loader,
            "steps": steps,
            "schema_version": SCHEMA_VERSION,
            "library_version": sl.__version__,
            "ranks": 2 if isinstance(state, list) else 1,
        }
    # A state from a schema newer than any release: must be refused with "upgrade".
    plain = msgspec.msgpack.decode(encode(entries["dropin"][2]))
    plain["schema_version"] = 999
    payload = msgspec.msgpack.encode(plain)
    (HERE / "future_schema.state").write_bytes(
        _HEADER.pack(MAGIC, FILE_FORMAT, len(payload), _digest(payload)) + payload
    )
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    # run the module's own import, so that functions in the pipeline configs are named
    # tests.data.make_fixtures.* (as the test sees them), not __main__.*
    from tests.data.make_fixtures import main as _main

    _main()
