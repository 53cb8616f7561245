"""The user's dataset is itself: ``loader.dataset is ds``, writes through it reach the
batches where torch's would, ``get_worker_info().dataset`` is the worker's copy of it
(so torch's ``worker_init_fn`` idioms work), ``len(dataset)`` is read at every epoch
start, and worker seeds fit in an int64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

import savable_loader as sl
from savable_loader.errors import ConfigMismatchError
from tests.common import RandomMapDataset, RangeSource

pytestmark = pytest.mark.timeout(300)


class Scaled(Dataset):
    """Sample i is i * scale (the torch idiom: switch a transform through loader.dataset)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.scale = 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * self.scale


def test_loader_dataset_is_the_users_dataset_on_every_path():
    ds = Scaled(8)
    assert sl.SavableDataLoader(ds).dataset is ds
    assert sl.SavableDataLoader(ds, sampler=range(8)).dataset is ds
    wc = sl.WorkerConfig(seed=0)
    source = RangeSource(4, wc)
    assert sl.SavableDataLoader(source, batch_size=None).dataset is source
    loader = sl.SavableDataLoader(ds)
    assert loader.dataset[3] == 3 and len(loader.dataset) == 8
    with pytest.raises(ValueError, match="dataset attribute should not be set"):
        loader.dataset = Scaled(2)  # as torch


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_setattr_through_loader_dataset_changes_batches_like_torch(num_workers, persistent):
    def run(cls):
        kw = {"multiprocessing_context": "fork"} if num_workers else {}
        loader = cls(Scaled(8), batch_size=4, num_workers=num_workers, persistent_workers=persistent, **kw)
        first = [b.tolist() for b in loader]
        loader.dataset.scale = 10
        second = [b.tolist() for b in loader]
        return first, second

    ours, theirs = run(sl.SavableDataLoader), run(DataLoader)
    assert ours == theirs
    # fresh workers (or the main process) see the change; persistent workers keep their copy
    assert ours[1][0][1] == (1 if persistent else 10)


class Noisy(Dataset):
    """Draws from an RNG the worker_init_fn gives each worker (torch's documented idiom)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> float:
        if self.rng is None:
            return -1.0
        return float(self.rng.random())


def _seed_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert isinstance(info.dataset, Noisy), type(info.dataset)
    info.dataset.rng = np.random.default_rng(info.seed)


@pytest.mark.parametrize("cls", [sl.SavableDataLoader, DataLoader], ids=["ours", "torch"])
def test_worker_init_fn_seeding_gives_distinct_values_per_worker(cls):
    loader = cls(Noisy(32), batch_size=4, num_workers=2, worker_init_fn=_seed_worker, multiprocessing_context="fork")
    values = [v for batch in loader for v in batch.tolist()]
    assert -1.0 not in values  # the RNG landed on the dataset the worker loads from
    assert len(set(values)) == len(values) == 32


class WorkerView(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> list:
        info = get_worker_info()
        return [type(info.dataset).__name__, info.dataset is self, info.id, info.num_workers]


def test_get_worker_info_dataset_is_the_workers_copy_of_the_users_dataset():
    loader = sl.SavableDataLoader(WorkerView(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = list(loader)
    assert [g[:2] for g in got] == [["WorkerView", True]] * 4
    assert sorted({g[2] for g in got}) == [0, 1] and {g[3] for g in got} == {2}


def _pipeline_worker_dataset(worker_id: int) -> None:
    info = get_worker_info()
    assert isinstance(info.dataset, RangeSource), type(info.dataset)


def test_get_worker_info_dataset_on_the_pipeline_path():
    wc = sl.WorkerConfig(num_workers=2, seed=0)
    loader = sl.SavableDataLoader(
        RangeSource(6, wc), batch_size=None, worker_init_fn=_pipeline_worker_dataset, multiprocessing_context="fork"
    )
    assert len(list(loader)) == 6


class InitialSeed(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        return torch.initial_seed()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_worker_seeds_fit_in_int64(num_workers):
    kw = {"multiprocessing_context": "fork"} if num_workers else {}
    loader = sl.SavableDataLoader(InitialSeed(), batch_size=8, shuffle=True, seed=5, num_workers=num_workers, **kw)
    seeds = torch.cat(list(loader)).tolist()  # default_collate makes LongTensors of them
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    default_collate(seeds)


def test_len_dataset_is_read_at_every_epoch_start():
    data = [torch.ones(1) * i for i in range(4)]
    loader = sl.SavableDataLoader(data, batch_size=1, shuffle=True, seed=0)
    sequential = sl.SavableDataLoader(data, batch_size=1, shuffle=False, seed=0)
    assert len(loader) == 4
    first = [int(b) for b in loader]
    data.append(torch.ones(1) * 4)
    assert len(loader) == len(sequential) == 5  # as torch's test_growing_dataset
    assert sorted(int(b) for b in loader) == [0, 1, 2, 3, 4] and sorted(first) == [0, 1, 2, 3]
    state = loader.save_state_rank()
    assert state.position.dataset_len == 5
    data.append(torch.ones(1) * 5)
    with pytest.raises(ConfigMismatchError) as info:
        sl.SavableDataLoader(data, batch_size=1, shuffle=True, seed=0).restore_state_rank(state)
    assert info.value.field == "len(dataset)"


def test_the_dataset_is_not_wrapped_in_a_copy_in_the_main_process():
    ds = RandomMapDataset(6)
    loader = sl.SavableDataLoader(ds, batch_size=2, seed=0)
    ds.n = 4  # the loader reads the user's object, not a snapshot of it
    assert len(loader) == 2 and len(list(loader)) == 2
