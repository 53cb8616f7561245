"""Tests for savable_loader.dataset.guards: the dataset contract's silent mistakes are reported
at the first save (an unlisted child: error; an unsaved generator: warning) and two live
iterations of one pipeline object are refused."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.dataset import guards as _guards
from savable_loader.errors import DatasetContractError, LoaderUsageError, UnsavedRngWarning
from tests.common import RangeSource


def _wc(num_workers: int = 0) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=0)


class _Hides(sl.SavableDataset):
    """Wraps a dataset but does not return it from children()."""

    def __init__(self, inner: sl.SavableDataset) -> None:
        super().__init__(inner.worker_config)
        self.parts = {"main": inner}

    def __iter__(self):
        yield from self.parts["main"]

    def config(self):
        return {}


class _HoldsRng(sl.SavableDataset):
    _savable_fields = ("pos",)

    def __init__(self, worker_config, gen) -> None:
        super().__init__(worker_config)
        self.aug = type("Aug", (), {})()
        self.aug.rng = gen
        self.pos = 0

    def __iter__(self):
        while self.pos < 3:
            self.pos += 1
            yield self.pos

    def config(self):
        return {}


def test_an_inner_dataset_not_returned_by_children_is_an_error_at_every_save() -> None:
    ds = _Hides(RangeSource(4, _wc()))
    for _ in range(2):  # a class that failed is checked again
        with pytest.raises(
            DatasetContractError,
            match=r"_Hides holds the SavableDataset RangeSource in "
            r"_Hides.parts\['main'\] but _Hides.children\(\) does not return it",
        ):
            ds.save_state()
    with pytest.raises(DatasetContractError):
        list(sl.SavableDataLoader(_Hides(RangeSource(4, _wc())), batch_size=None, worker_config=_wc()))


def test_wrappers_that_return_their_children_pass() -> None:
    ds = sl.wrappers.MapDataset(RangeSource(4, _wc()), lambda x: x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.save_state()


@pytest.mark.parametrize(
    "make",
    [
        lambda: random.Random(0),
        lambda: np.random.default_rng(0),
        lambda: np.random.RandomState(0),
        lambda: torch.Generator().manual_seed(0),
    ],
    ids=["random", "numpy", "randomstate", "torch"],
)
def test_an_unsaved_generator_warns_once_per_class(make, monkeypatch) -> None:
    monkeypatch.setattr(_guards, "_checked", set())
    ds = _HoldsRng(_wc(), make())
    with pytest.warns(
        UnsavedRngWarning,
        match=r"_HoldsRng holds a random generator in _HoldsRng.aug.rng, but 'aug' "
        r"is not in _HoldsRng._savable_fields",
    ):
        ds.save_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds.save_state()
        _HoldsRng(_wc(), make()).save_state()


def test_a_saved_generator_does_not_warn(monkeypatch) -> None:
    monkeypatch.setattr(_guards, "_checked", set())

    class Saves(_HoldsRng):
        _savable_fields = ("pos", "rng")

        def __init__(self, worker_config):
            sl.SavableDataset.__init__(self, worker_config)
            self.pos = 0
            self.rng = np.random.default_rng(0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Saves(_wc()).save_state()


def test_two_live_in_process_iterations_of_one_pipeline_object_are_refused() -> None:
    ds = RangeSource(6, _wc())
    first = sl.SavableDataLoader(ds, batch_size=None, worker_config=_wc())
    second = sl.SavableDataLoader(ds, batch_size=None, worker_config=_wc())
    it = iter(first)
    next(it)
    with pytest.raises(LoaderUsageError, match="RangeSource .* is already being iterated by another loader"):
        next(iter(second))
    assert len(list(it)) == 5  # the first iteration goes on, untouched
    # ended: the object is free again, and one loader may iterate it again and again
    assert len(list(second)) == 6
    next(iter(first))
    assert len(list(first)) == 6


def test_an_abandoned_iteration_frees_the_object() -> None:
    ds = RangeSource(6, _wc())
    first = sl.SavableDataLoader(ds, batch_size=None, worker_config=_wc())
    next(iter(first))  # the iterator is dropped at once
    assert len(list(sl.SavableDataLoader(ds, batch_size=None, worker_config=_wc()))) == 6
