"""savable_loader/_frameworks.py: the frameworks' private parts it recognises exist in the
installed releases, and each recognition does its job in-process (the end-to-end runs
are in tests/test_frameworks.py)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect

import pytest
import torch

import savable_loader as sl
from savable_loader import _frameworks
from tests.common import RandomMapDataset, assert_streams


def _requires(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed")


def _function(module: str, name: str) -> bool:
    """Whether ``module`` defines a function (or a method of one of its classes) ``name``."""
    mod = importlib.import_module(module)
    if callable(getattr(mod, name, None)):
        return True
    return any(isinstance(cls, type) and name in vars(cls) for cls in vars(mod).values())


@_requires("lightning", "accelerate")
def test_the_recognised_framework_functions_exist():
    """A release that renames them fails here, not silently in a user's run."""
    for module, name in _frameworks._SAVES:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            continue  # pytorch_lightning / lightning_fabric: the standalone packages
        assert _function(module, name), f"{module}.{name}"
    wrappers = [m for m in _frameworks.FABRIC_WRAPPERS if importlib.util.find_spec(m.split(".")[0]) is not None]
    assert wrappers
    for module in wrappers:
        assert "__iter__" in vars(importlib.import_module(module)._FabricDataLoader)
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.loops.fit_loop import _FitLoop

    assert "batches" in vars(_PrefetchDataFetcher(prefetch_batches=1))
    source = inspect.getsource(_FitLoop)
    assert "self._data_fetcher" in source and "self._combined_loader" in source


def _loader() -> sl.SavableDataLoader:
    return sl.SavableDataLoader(RandomMapDataset(12), batch_size=4, shuffle=True, seed=3)


@_requires("lightning")
def test_fabrics_per_process_epoch_count_does_not_move_the_loaders_epochs():
    """Fabric's wrapper calls ``sampler.set_epoch(n)``, n counting its ``iter()`` calls
    from 0 in each process: a resumed loader keeps its restored epochs."""
    from lightning.fabric.wrappers import _FabricDataLoader

    uninterrupted = _loader()
    want = [b for _ in range(3) for b in uninterrupted]
    loader = _loader()
    it = iter(_FabricDataLoader(loader))
    got = list(it)
    it = iter(_FabricDataLoader(loader))
    got.append(next(it))
    state = loader.state_dict()  # epoch 1, one batch in
    restored = _loader()
    restored.load_state_dict(state)
    wrapped = _FabricDataLoader(restored)  # a new process: its count starts at 0 again
    for _ in range(2):
        got.extend(wrapped)
    assert_streams(got, want, "through Fabric's wrapper, resumed in epoch 1")


@_requires("accelerate")
def test_a_loader_rebuilt_by_skip_first_batches_is_a_clear_error():
    from accelerate import skip_first_batches

    rebuilt = skip_first_batches(_loader(), 1)
    with pytest.raises(sl.LoaderUsageError, match="register_for_checkpointing"):
        next(iter(rebuilt))


def test_outside_a_framework_nothing_is_recognised():
    assert _frameworks.saving_framework(_loader()) is None
    assert not _frameworks.fabric_iterating()
    assert _frameworks.rebuilt_by() is None
    loader = _loader()
    loader.sampler.set_epoch(2)  # the user's own call still moves the loader
    assert torch.equal(next(iter(loader)), next(iter(_epoch(2))))


def _epoch(epoch: int) -> sl.SavableDataLoader:
    loader = _loader()
    loader.set_epoch(epoch)
    return loader


@_requires("accelerate")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_pipeline_rebuilt_by_skip_first_batches_is_a_clear_error(workers):
    """A savable pipeline iterated by the plain DataLoader Accelerate rebuilt: in the main
    process, or in that loader's worker processes (each would read the same data)."""
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
