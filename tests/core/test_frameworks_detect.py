"""savable_loader/core/frameworks.py: what the loader knows of the frameworks that drive it,
without reading its caller's stack: rebuilt loaders refused, the guard against a batch
Lightning fetched ahead, the loader's epoch count after a restore (Fabric's wrapper), and
no frame reading anywhere in the package (the end-to-end runs are in
tests/frameworks/test_frameworks.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import savable_loader as sl
from tests.common import RandomMapDataset, RangeSource, assert_streams

PACKAGE = Path(sl.__file__).resolve().parent


def _requires(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")


def test_no_module_of_the_package_reads_frames():
    pattern = re.compile(r"_getframe|inspect\.stack|inspect\.currentframe|f_locals|f_back|f_globals|currentframe\(")
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def _loader() -> sl.SavableDataLoader:
    return sl.SavableDataLoader(RandomMapDataset(12), batch_size=4, shuffle=True, seed=3)


def _sampler_loader() -> sl.SavableDataLoader:
    ds = RandomMapDataset(12)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
    return sl.SavableDataLoader(ds, batch_size=4, sampler=sampler, seed=3)


def _through_fabric(make, hook: bool) -> tuple[list, list]:
    """(what the resumed run yields, the uninterrupted run's) through Fabric's loader
    wrapper, saved in epoch 1 one batch in, resumed by a new wrapper (a new process:
    its count starts at 0 again)."""
    from lightning.fabric.wrappers import _FabricDataLoader

    from savable_loader.integrations.fabric import FabricLoaderState

    def saved(wrapper):
        return FabricLoaderState(wrapper) if hook else wrapper._dataloader

    reference = _FabricDataLoader(make())
    saved(reference)
    want = [b for _ in range(3) for b in reference]
    wrapper = _FabricDataLoader(make())
    got = list(wrapper)
    it = iter(wrapper)
    got.append(next(it))
    state = saved(wrapper).state_dict()
    resumed = _FabricDataLoader(make())
    saved(resumed).load_state_dict(state)
    for _ in range(2):
        got.extend(resumed)
    return got, want


@_requires("lightning")
def test_fabrics_per_process_epoch_count_does_not_move_the_loaders_own_order():
    """Nothing added: after a restore, ``loader.sampler.set_epoch(n)`` below the epoch the
    loader runs next is ignored, so Fabric's count (0 again) leaves the loader's epochs."""
    got, want = _through_fabric(_loader, hook=False)
    assert_streams(got, want, "through Fabric's wrapper, resumed in epoch 1")


@_requires("lightning")
def test_fabric_with_a_sampler_of_the_users_needs_the_hook():
    """Fabric's wrapper sets the user's DistributedSampler to its count (0 in a resumed
    process): without FabricLoaderState a clear error naming it, with it exact."""
    with pytest.raises(sl.LoaderUsageError, match="FabricLoaderState"):
        _through_fabric(_sampler_loader, hook=False)
    got, want = _through_fabric(_sampler_loader, hook=True)
    assert_streams(got, want, "a DistributedSampler through Fabric's wrapper and FabricLoaderState")


def test_after_a_restore_the_loaders_epoch_count_wins_over_a_lower_one():
    loader = _loader()
    for _ in range(2):
        list(loader)
    state = loader.state_dict()  # epoch 2 next
    reference = _epoch(2)
    want = [b for _ in range(2) for b in reference]
    restored = _loader()
    restored.load_state_dict(state)
    restored.sampler.set_epoch(0)  # a per-process count: ignored
    got = list(restored)
    restored.sampler.set_epoch(1)
    got.extend(restored)
    assert_streams(got, want, "epochs 2 and 3 after set_epoch(0), set_epoch(1)")
    restored.set_epoch(0)  # the loader's own set_epoch still goes back
    assert_streams(list(restored), list(_epoch(0)), "loader.set_epoch(0)")


def test_outside_a_framework_the_users_set_epoch_moves_the_loader():
    loader = _loader()
    loader.sampler.set_epoch(2)
    assert torch.equal(next(iter(loader)), next(iter(_epoch(2))))
    assert loader.sampler.indices() == [int(i) for b in _epoch(3) for i in b[:, 0]]


def _epoch(epoch: int) -> sl.SavableDataLoader:
    loader = _loader()
    loader.set_epoch(epoch)
    return loader


def test_iterating_the_loaders_sampler_is_a_clear_error():
    """Only a DataLoader rebuilt from the loader's attributes iterates it."""
    loader = _loader()
    with pytest.raises(sl.LoaderUsageError, match="SavableTrainer") as raised:
        list(torch.utils.data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler))
    assert "register_for_checkpointing" in str(raised.value)


@_requires("accelerate")
def test_a_loader_rebuilt_by_skip_first_batches_is_a_clear_error():
    from accelerate import skip_first_batches

    rebuilt = skip_first_batches(_loader(), 1)
    with pytest.raises(sl.LoaderUsageError, match="register_for_checkpointing"):
        next(iter(rebuilt))


@_requires("accelerate")
@pytest.mark.parametrize("workers", [2])
def test_a_pipeline_rebuilt_by_skip_first_batches_is_a_clear_error(workers):
    """A savable pipeline iterated by the plain DataLoader Accelerate rebuilt, in that
    loader's worker processes (each would read the same data). (With num_workers=0 the
    rebuilt loader iterates the pipeline in the main process, which a hand's iteration
    does too: not told apart without reading the stack; docs/accelerate.md.)"""
    from accelerate import skip_first_batches

    from savable_loader.sources import IterableSource

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=3)
    loader = sl.SavableDataLoader(IterableSource(_stream, wc), batch_size=None, worker_config=wc)
    with pytest.raises((sl.LoaderUsageError, RuntimeError), match="register_for_checkpointing") as raised:
        next(iter(skip_first_batches(loader, 1)))
    if workers == 0:
        assert isinstance(raised.value, sl.LoaderUsageError)


def _stream(info):
    """A global worker's share of 16 integers."""
    return range(info.global_worker, 16, info.num_global_workers)


def _pipeline() -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    return sl.SavableDataLoader(RangeSource(16, wc), batch_size=None, worker_config=wc)


def test_a_pipeline_may_be_iterated_by_hand_beside_its_loader():
    from savable_loader.sources import IterableSource

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=3)
    loader = sl.SavableDataLoader(IterableSource(_stream, wc), batch_size=None, worker_config=wc)
    want = [int(x) for x in loader]
    assert [int(x) for x in IterableSource(_stream, wc)] == want  # another pipeline of the same config
    assert [int(x) for x in loader] == want  # the loader is not disturbed


def test_a_loader_without_len_whose_epochs_a_framework_sets_needs_a_hook_mid_epoch():
    """Lightning's Trainer sets every loader's epoch through ``loader.sampler.set_epoch``
    and holds a batch fetched ahead of a loader without len(): such a loader's
    state_dict() mid-epoch is refused unless a hook claimed it; never a silent skip."""
    plain = _pipeline()
    it = iter(plain)
    next(it)
    assert list(plain.state_dict()) == ["dp_rank_0"]  # DCP, Accelerate, a loop of one's own: no set_epoch
    it.close()
    loader = _pipeline()
    loader.sampler.set_epoch(0)  # what Lightning's fit loop and Fabric's wrapper do
    it = iter(loader)
    next(it)
    with pytest.raises(sl.LoaderUsageError, match="SavableLoaderCallback"):
        loader.state_dict()
    it.close()
    loader.state_dict()  # no live iteration: nothing can be held
    own = _loader()
    own.sampler.set_epoch(0)
    next(iter(own))
    own.state_dict()  # a loader with len(): Lightning fetches nothing ahead
    from savable_loader.integrations import EveryRankState

    claimed = _pipeline()
    claimed.sampler.set_epoch(0)
    hook = EveryRankState(claimed)
    it = iter(claimed)
    next(it)
    state = hook.state_dict()
    want = list(it)
    resumed = _pipeline()
    EveryRankState(resumed).load_state_dict(state)
    assert_streams(list(resumed), want, "restored through EveryRankState")


def test_a_pipeline_loaders_sampler_is_never_iterated():
    with pytest.raises(sl.LoaderUsageError, match="register_for_checkpointing"):
        iter(_pipeline().sampler)
