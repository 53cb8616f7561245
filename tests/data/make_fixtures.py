"""Write the state fixtures of the current schema version into tests/data/.

States written by every released schema version are kept here, and
tests/state/test_schema_fixtures.py decodes them (and restores them) in every later version.
Run this once per new schema version, from the repository root, and commit the new
files; never regenerate or delete the files of older versions once a version with them
is released (the schema-1 files were last regenerated before the first release, when
the seed formula and the epoch order of unreleased versions were removed: they record
seed formula 3 and the ``"feistel-1"`` order, the only ones this version has):

    python -m tests.data.make_fixtures

Files: ``schema<V>_<name>.state`` (``save_file`` format) and ``manifest.json`` entries
saying which loader (a factory below) and how many steps each state belongs to.
``unreleased_dropin.state`` is not made here: the drop-in state of 3 steps as an
unreleased version wrote it, before ``seed_formula`` and ``order_algorithm`` existed
(seed formula 1, a materialised numpy permutation), kept to show that such a state is
refused. The
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


def dropin(rank: int = 0, world_size: int = 1) -> sl.SavableDataLoader:
    """Drop-in path: shuffled, batched, in-process."""
    wc = sl.WorkerConfig(rank=rank, world_size=world_size, num_workers=0, seed=7)
    return sl.SavableDataLoader(RandomMapDataset(40), batch_size=4, shuffle=True, worker_config=wc)


def pipeline() -> sl.SavableDataLoader:
    """Savable pipeline with 2 workers; the shuffle buffer puts tensors into the state."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=7)
    ds = BatchDataset(MapDataset(ShuffleBufferDataset(RangeSource(30, wc), size=4), _double), batch_size=3)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, multiprocessing_context="fork")


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
