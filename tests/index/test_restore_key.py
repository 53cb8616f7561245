"""Restore keys: every yielded batch has one, and restore_sample rebuilds that batch.

Keys are taken from real 2-worker, 2-epoch runs; the rebuilt batch must equal the one
yielded, bit for bit, in a fresh loader too (other num_workers), and after a trip
through str().
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

import savable_loader as sl
from savable_loader.errors import RestoreKeyError
from savable_loader.state import RestoreKey
from savable_loader.wrappers import (
    BatchDataset,
    FilterDataset,
    LimitDataset,
    MapDataset,
    RepeatDataset,
    ShuffleBufferDataset,
)
from tests.common import RandomMapDataset, RangeSource, assert_same

pytestmark = pytest.mark.timeout(300)

SEED = 13


def dropin(num_workers: int, batch_size: int | None = 4, collate_fn=None) -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        RandomMapDataset(30),
        batch_size=batch_size,
        shuffle=True,
        seed=SEED,
        num_workers=num_workers,
        collate_fn=collate_fn,
        multiprocessing_context="fork" if num_workers else None,
    )


def noisy(x: torch.Tensor) -> torch.Tensor:
    return x + torch.randint(0, 1000, x.shape)


def pipeline(num_workers: int, keyed: bool = True) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=SEED)
    ds = RangeSource(40, wc, keyed=keyed)
    ds = FilterDataset(ds, lambda x: random.random() < 0.8)  # a random predicate
    ds = MapDataset(ds, noisy)  # random augmentation before the buffer
    ds = ShuffleBufferDataset(ds, size=6)
    ds = MapDataset(ds, noisy)  # and after it
    ds = LimitDataset(RepeatDataset(ds, repeats=2), 50)
    ds = BatchDataset(ds, 3)
    return sl.SavableDataLoader(
        ds, batch_size=None, worker_config=wc, multiprocessing_context="fork" if num_workers else None
    )


def keyed_run(loader, epochs=2):
    return [(loader.restore_key, batch) for _ in range(epochs) for batch in loader]


@pytest.mark.parametrize("make", [dropin, pipeline], ids=["drop-in", "pipeline"])
def test_rebuilt_batches_equal_the_yielded_ones(make):
    run = keyed_run(make(2))
    keys = [k for k, _ in run]
    assert all(isinstance(k, RestoreKey) for k in keys)
    assert len({str(k) for k in keys}) == len(keys), "two batches share a key"
    assert {k.epoch for k in keys} == {0, 1}
    rnd = random.Random(0)
    picks = rnd.sample(range(len(run)), 12)
    same = make(2)
    fresh = make(0) if make is dropin else make(2)  # never iterated (drop-in: other num_workers)
    for i in picks:
        key, batch = run[i]
        assert_same(same.restore_sample(key), batch, f"batch {i} ({key})")
        assert_same(fresh.restore_sample(str(key)), batch, f"batch {i} from str(key)")
        assert RestoreKey.parse(str(key)) == key


def test_restore_sample_leaves_iteration_and_caller_rng_alone():
    loader = dropin(0)
    reference = list(dropin(0))
    got, keys = [], []
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    for batch in loader:
        got.append(batch)
        keys.append(loader.restore_key)
        loader.restore_sample(keys[0])  # between batches, in the middle of the epoch
    assert torch.equal(torch.rand(3), want), "restore_sample moved the caller's RNG"
    for a, b in zip(got, reference):
        assert_same(a, b)


def test_keys_of_unbatched_and_custom_collate_loaders():
    unbatched = dropin(0, batch_size=None)
    run = keyed_run(unbatched, epochs=1)
    assert all(len(k.sample_positions()) == 1 for k, _ in run)
    for key, sample in run[::7]:
        assert_same(unbatched.restore_sample(key), sample)
    summed = dropin(0, collate_fn=lambda xs: torch.stack(xs).sum(0) + torch.randint(0, 9, ()))
    for key, batch in keyed_run(summed, epochs=1):
        assert_same(summed.restore_sample(key), batch)


def test_an_ordinary_batch_key_is_one_range():
    loader = dropin(0)
    next(iter(loader))
    key = loader.restore_key
    assert key.kind == "index" and key.positions == [(0, 4, 1)] and key.rank == 0
    assert loader.restore_key == key  # reading it twice gives the same


def test_no_key_before_the_first_batch_or_after_a_restore():
    loader = dropin(0)
    assert loader.restore_key is None
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    fresh = dropin(0)
    fresh.restore_state_rank(state)
    assert fresh.restore_key is None


def test_foreign_and_malformed_keys_are_refused():
    loader = dropin(0)
    next(iter(loader))
    key = loader.restore_key
    other_seed = sl.SavableDataLoader(RandomMapDataset(30), batch_size=4, shuffle=True, seed=SEED + 1)
    with pytest.raises(RestoreKeyError, match="key.seed is 13"):
        other_seed.restore_sample(key)
    other_data = sl.SavableDataLoader(RandomMapDataset(31), batch_size=4, shuffle=True, seed=SEED)
    with pytest.raises(RestoreKeyError, match="key.fingerprint"):
        other_data.restore_sample(key)
    with pytest.raises(RestoreKeyError, match="not a restore key"):
        loader.restore_sample("{garbage")
    with pytest.raises(RestoreKeyError, match="RestoreKey or its str"):
        loader.restore_sample(42)
    far = msgspec.structs.replace(key, positions=[(10**6, 10**6 + 1, 1)])
    with pytest.raises(RestoreKeyError, match="positions below"):
        loader.restore_sample(far)
    with pytest.raises(RestoreKeyError, match="expects 'pipeline'"):
        pipeline(0).restore_sample(msgspec.structs.replace(key, fingerprint=pipeline(0)._mode.fingerprint))


def test_a_pipeline_key_needs_the_same_world_size_and_rebuilds_under_any_num_workers():
    loader = pipeline(2)
    run = keyed_run(loader, epochs=1)
    key = next(k for k, _ in run if k.worker == 1)
    assert (key.num_workers, key.world_size) == (2, 1)
    # (refused before hosting) the key's logical worker view is rebuilt: 1 of 2 workers
    assert_same(pipeline(0).restore_sample(key), run[[k for k, _ in run].index(key)][1])
    with pytest.raises(RestoreKeyError, match="key.world_size is 2, this loader's world_size is 1"):
        loader.restore_sample(msgspec.structs.replace(key, world_size=2))
    # a key made before num_workers was recorded is checked as before: its worker must exist
    old = msgspec.structs.replace(key, num_workers=None, world_size=None)
    assert_same(loader.restore_sample(old), run[[k for k, _ in run].index(key)][1])
    with pytest.raises(RestoreKeyError, match="key.worker is 1.*num_workers"):
        pipeline(0).restore_sample(old)


def test_a_pipeline_that_cannot_rebuild_says_why():
    loader = pipeline(0, keyed=False)
    dataset = loader.dataset.dataset
    assert not dataset.can_restore_sample()
    assert "keyed=False" in dataset.restore_sample_blocker()
    batch = next(iter(loader))
    key = loader.restore_key
    assert key.sample is None and batch is not None  # no source key: no batch key
    with pytest.raises(RestoreKeyError, match="cannot rebuild samples: RangeSource"):
        loader.restore_sample(key)


def test_a_source_without_keys_names_itself():
    class Plain(sl.SavableDataset):
        def __iter__(self):
            yield from range(3)

        def config(self):
            return {}

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)
    ds = MapDataset(Plain(wc), lambda x: x)
    assert not ds.can_restore_sample()
    assert "Plain does not implement restore_sample()" in ds.restore_sample_blocker()
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)
    assert list(loader) == [0, 1, 2]
    assert loader.restore_key.sample is None
    with pytest.raises(RestoreKeyError, match="Plain does not implement"):
        loader.restore_sample(loader.restore_key)


# -- keys carry the settings that decide their data ---------------------------------------


def test_a_key_of_another_shuffle_setting_is_refused():
    shuffled = dropin(0)
    batches = [(shuffled.restore_key, batch) for batch in shuffled]
    key, batch = batches[2]
    assert key.shuffle is True
    in_order = sl.SavableDataLoader(RandomMapDataset(30), batch_size=4, shuffle=False, seed=SEED)
    with pytest.raises(RestoreKeyError, match="key.shuffle is True, this loader's shuffle is False"):
        in_order.restore_sample(key)
    with pytest.raises(RestoreKeyError, match="key.shuffle is True, this loader's shuffle is False"):
        in_order.restore_sample(str(key))
    assert_same(dropin(0).restore_sample(key), batch)


def test_a_key_of_another_batching_is_refused():
    unbatched = dropin(0, batch_size=None)
    next(iter(unbatched))
    single = unbatched.restore_key
    batched = dropin(0)
    next(iter(batched))
    with pytest.raises(RestoreKeyError, match="key.batched is False, this loader's batched is True"):
        batched.restore_sample(single)
    with pytest.raises(RestoreKeyError, match="key.batched is True, this loader's batched is False"):
        unbatched.restore_sample(batched.restore_key)
    # even with the setting removed, an unbatched loader does not rebuild a 4-sample key as one sample
    with pytest.raises(RestoreKeyError, match="names 4 samples, this loader is unbatched"):
        unbatched.restore_sample(msgspec.structs.replace(batched.restore_key, batched=None))


def test_keys_made_by_earlier_versions():
    loader = dropin(0)
    batches = [(loader.restore_key, batch) for batch in loader]
    key, batch = batches[-1]  # the last batch: 2 samples
    old = msgspec.json.decode(str(key).encode())
    for name in ("shuffle", "batched", "world_size"):
        del old[name]
    text = msgspec.json.encode(old).decode()
    with pytest.raises(RestoreKeyError, match='key.shuffle is missing .* add "shuffle": true or false'):
        loader.restore_sample(text)
    # the order it names is unambiguous once the shuffle setting is known
    old["shuffle"] = True
    assert_same(dropin(0).restore_sample(msgspec.json.encode(old).decode()), batch)


def test_padding_positions_follow_the_key_s_world_size():
    # 30 samples on 4 ranks: positions 30 and 31 repeat samples 0 and 1 (torch's padding)
    wc = sl.WorkerConfig(rank=3, world_size=4, num_workers=0, seed=SEED)
    rank3 = sl.SavableDataLoader(RandomMapDataset(30), batch_size=4, shuffle=True, worker_config=wc)
    last_key, last_batch = [(rank3.restore_key, b) for b in rank3][-1]
    assert last_key.positions[-1][1] - 1 == 31 and last_key.world_size == 4
    one_rank = dropin(0)  # world size 1 rebuilds it
    assert_same(one_rank.restore_sample(last_key), last_batch)
    with pytest.raises(RestoreKeyError, match="reaches position 31, expected positions below 30"):
        one_rank.restore_sample(msgspec.structs.replace(last_key, world_size=1))


# -- malformed keys: refused before anything is expanded -----------------------------------

MALFORMED = {
    "2**40 positions": [(0, 2**40, 1)],
    "2**70 stop": [(0, 2**70, 1)],
    "2**20 positions spread out": [(0, 2**40, 2**20)],
    "a huge world size does not widen the count": "world_size",
    "stop before start": [(5, 2, 1)],
    "negative start": [(-1, 3, 1)],
    "step 0": [(0, 4, 0)],
    "not a triple": [(0, 4)],
    "floats": [(0.0, 4.0, 1.0)],
    "bools": [(False, True, True)],
    "too many ranges": [(i, i + 1, 1) for i in range(10**5)],
    "past the end": [(36, 44, 1)],
    "repeated positions": [(0, 4, 1), (2, 3, 1)],
    "no positions": [],
}

CONSTANT_MEMORY = r"""
import resource, sys
import msgspec
import savable_loader as sl
from tests.common import RandomMapDataset
from tests.index.test_restore_key import MALFORMED

loader = sl.SavableDataLoader(RandomMapDataset(40), batch_size=4, shuffle=True, seed=1)
next(iter(loader))
key = loader.restore_key
cases = []
for name, positions in MALFORMED.items():
    if positions == "world_size":
        cases.append((name, msgspec.structs.replace(key, world_size=2**40, positions=[(0, 2**40, 1)])))
    else:
        cases.append((name, msgspec.structs.replace(key, positions=positions)))
cases.append(("epoch -1", msgspec.structs.replace(key, epoch=-1)))
cases.append(("epoch 'x'", msgspec.structs.replace(key, epoch="x")))
cases.append(("world size 0", msgspec.structs.replace(key, world_size=0)))
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
limit = (size + 256 * 1024) * 1024   # 256 MiB more than the interpreter has now
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for name, bad in cases:
    try:
        loader.restore_sample(bad)
        print(name, "|", "accepted")
    except BaseException as e:
        print(name, "|", type(e).__name__, str(e).splitlines()[0][:200])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status for the address-space limit")
def test_malformed_keys_are_refused_in_constant_memory():
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONSTANT_MEMORY)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    outcomes = dict(line.split(" | ", 1) for line in result.stdout.strip().splitlines())
    assert len(outcomes) == len(MALFORMED) + 3
    for name, outcome in outcomes.items():
        assert outcome.startswith("RestoreKeyError key."), f"{name}: {outcome}"


def test_parsed_keys_with_bad_values_are_refused():
    loader = dropin(0)
    next(iter(loader))
    good = msgspec.json.decode(str(loader.restore_key).encode())
    for field, value in [("positions", [[-1, 3, 1]]), ("positions", [[0, 3, 0]]), ("epoch", -1), ("world_size", 0)]:
        with pytest.raises(RestoreKeyError, match="not a restore key"):
            loader.restore_sample(msgspec.json.encode({**good, field: value}))


class Grid(torch.utils.data.Dataset):
    """A table read by ``(row, col)``: ``table[(r, c)]`` is one cell, ``table[[r, c]]``
    two rows."""

    def __init__(self) -> None:
        self.table = torch.arange(48.0).reshape(6, 8)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index):
        return self.table[index] + torch.rand(())


class CellSampler(torch.utils.data.Sampler):
    """Yields ``(row, col)`` tuples, shuffled by its generator."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(4)

    def __len__(self) -> int:
        return 48

    def __iter__(self):
        for i in torch.randperm(48, generator=self.generator).tolist():
            yield (i // 8, i % 8)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_tuple_indices_are_rebuilt_as_tuples(num_workers: int) -> None:
    """A sampler yielding ``(row, col)``: each key rebuilds the batch it names (a tuple
    coming back as a list would read whole rows instead of cells), after str() too."""
    make = lambda: sl.SavableDataLoader(Grid(), sampler=CellSampler(), batch_size=4, num_workers=num_workers, seed=SEED)
    loader = make()
    batches, keys = [], []
    for batch in loader:
        batches.append(batch)
        keys.append(str(loader.restore_key))
    assert batches[0].shape == (4,)
    fresh = make()
    for batch, key in zip(batches, keys):
        assert_same(fresh.restore_sample(key), batch)
