"""Tests for savable_loader.testing.check_resume: it passes on datasets that resume
exactly and fails, naming the save point and the first differing item, on the contract's
classic mistakes (state in a local, advancing after the yield)."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.errors import LoaderUsageError, ResumeMismatchError
from savable_loader.testing import assert_same, assert_streams, check_resume, expected_chunks
from tests.common import RandomMapDataset, RangeSource


class _LocalState(sl.SavableDataset):
    """Keeps its position in a local of __iter__: restores start over."""

    _savable_fields = ()

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n

    def __iter__(self):
        yield from range(self.n)

    def config(self):
        return {"n": self.n}


class _AdvanceAfterYield(sl.SavableDataset):
    """Advances its field after the yield: a save right after an item repeats it."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = 0

    def __iter__(self):
        while self.pos < self.n:
            yield self.pos
            self.pos += 1

    def config(self):
        return {"n": self.n}


def _wc(num_workers: int = 0) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=3)


def test_passes_on_a_drop_in_loader_with_every_variant() -> None:
    def factory():
        return sl.SavableDataLoader(RandomMapDataset(7), batch_size=2, shuffle=True, seed=1)

    # 4 + 4 items: steps 0..8 (live), both epoch ends twice, break and raise at 1..8
    assert check_resume(factory, 2, variants=("live", "break", "raise")) == 9 + 2 + 8 * 2


def test_passes_on_a_savable_dataset_factory_in_process_and_with_workers() -> None:
    assert check_resume(lambda: RangeSource(5, _wc()), 2) == 6 + 5 + 2
    wc = _wc(2)
    assert check_resume(lambda: RangeSource(5, wc), 1, steps=[0, 2, 5]) == 4


def test_fails_on_state_kept_in_a_local() -> None:
    with pytest.raises(ResumeMismatchError) as info:
        check_resume(lambda: _LocalState(4, _wc()), 1)
    message = str(info.value)
    # step 0 and the between-epoch save resume; step 1 is the first that cannot
    assert message.startswith("save at step 1 (live, after epoch 0, item 0): the resumed run"), message
    assert "item 1 (epoch 0, item 1) differs" in message, message


def test_fails_on_advancing_after_the_yield() -> None:
    with pytest.raises(ResumeMismatchError, match=r"save at step 1 .*item 1 \(epoch 0, item 1\) differs: item: 0 vs 1"):
        check_resume(lambda: _AdvanceAfterYield(4, _wc()), 1)


def test_fails_on_a_loader_that_forgets_its_rng() -> None:
    class Noisy(sl.SavableDataset):
        """Draws from a generator it does not save."""

        _savable_fields = ("pos",)

        def __init__(self, worker_config):
            super().__init__(worker_config)
            self.rng = random.Random(0)
            self.reset_state_own()

        def reset_state_own(self):
            self.pos = 0

        def __iter__(self):
            while self.pos < 4:
                self.pos += 1
                yield self.rng.random()

        def config(self):
            return {}

    with pytest.warns(sl.errors.UnsavedRngWarning), pytest.raises(ResumeMismatchError, match="save at step 1"):
        check_resume(lambda: Noisy(_wc()), 1)


def test_factory_must_build_a_loader_or_a_savable_dataset() -> None:
    with pytest.raises(LoaderUsageError, match="returned a list"):
        check_resume(lambda: [1, 2, 3])
    with pytest.raises(LoaderUsageError, match="variants"):
        check_resume(lambda: RangeSource(3, _wc()), variants=("sometimes",))


def test_an_empty_reference_is_refused() -> None:
    with pytest.raises(ResumeMismatchError, match="yielded nothing"):
        check_resume(lambda: RangeSource(0, _wc()), 1)


def test_assert_same_compares_types_and_bits() -> None:
    assert_same({"a": [torch.ones(2), np.zeros(1)]}, {"a": [torch.ones(2), np.zeros(1)]})
    for a, b, where in [
        (torch.ones(2), torch.ones(2, dtype=torch.float64), "item"),
        ([1, 2], (1, 2), "item"),
        ({"a": 1}, {"a": 1.0}, "item['a']"),
        ([torch.zeros(1), np.ones(2)], [torch.zeros(1), np.zeros(2)], "item[1]"),
    ]:
        with pytest.raises(ResumeMismatchError) as info:
            assert_same(a, b)
        assert str(info.value).startswith(f"{where}: "), str(info.value)
    with pytest.raises(ResumeMismatchError, match=r"3 items, expected 2 \(first difference at item 2\)"):
        assert_streams([1, 2, 3], [1, 2], "run")


def test_assert_same_is_as_strict_as_the_project_tests() -> None:
    # what tests/common.py used to check on its own: types at every level, dict order,
    # NaN payloads and signed zeros by their bits, NumPy scalar dtypes
    pair = collections.namedtuple("pair", "a b")
    nan = torch.tensor([float("nan")])
    assert_same(nan, nan.clone())  # the same NaN bits: equal
    assert_same(np.array([np.nan]), np.array([np.nan]))
    assert_same(float("nan"), float("nan"))
    for a, b, where in [
        (pair(1, 2), (1, 2), "item"),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "item"),
        (collections.OrderedDict(a=1), {"a": 1}, "item"),
        (0.0, -0.0, "item"),
        ([np.float32(1)], [np.float64(1)], "item[0]"),
        (np.array([1], dtype=">i4"), np.array([1], dtype="<i4"), "item"),
        (torch.tensor([0.0]), torch.tensor([1.0]), "item"),
        (True, 1, "item"),
    ]:
        with pytest.raises(ResumeMismatchError) as info:
            assert_same(a, b)
        assert str(info.value).startswith(f"{where}: "), str(info.value)


def test_expected_chunks() -> None:
    assert expected_chunks([3, 3], 0, False) == [3, 3]
    assert expected_chunks([3, 3], 3, False) == [0, 3]  # at the epoch's last item
    assert expected_chunks([3, 3], 3, True) == [3]  # after its StopIteration
    assert expected_chunks([3, 3], 4, False) == [2]
    assert expected_chunks([0, 1], 0, True) == [1]  # after an empty first epoch
    assert expected_chunks([2, 0, 3], 2, True) == [0, 3]


class _Endless(sl.SavableDataset):
    """An endless stream (an LLM pretraining source): token counts that never end."""

    _savable_fields = ("pos",)

    def __init__(self, worker_config: sl.WorkerConfig, forget: bool = False) -> None:
        super().__init__(worker_config)
        self.forget = forget
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        pos = self.pos
        while True:
            i, pos = pos, pos + self.worker_config.workers_per_rank
            if not self.forget:
                self.pos = pos
            yield torch.arange(i % 5 + 1)

    def config(self):
        return {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_max_batches_checks_an_endless_pipeline(workers: int) -> None:
    wc = _wc(workers)

    def factory():
        packed = sl.wrappers.PackingDataset(_Endless(wc), 4, strategy="best_fit", buffer_size=3)
        return sl.SavableDataLoader(sl.wrappers.BatchDataset(packed, 2), batch_size=None, worker_config=wc)

    steps = None if workers == 0 else [0, 1, 5, 12]
    # save points 0..12 (the epoch is cut at 12: no save between epochs)
    assert check_resume(factory, 1, max_batches=12, steps=steps, variants=("live", "break")) == (
        13 + 12 if workers == 0 else 4 + 3
    )
    assert check_resume(factory, 3, max_batches=5, steps=[2]) == 1  # more epochs asked for: the same


def test_max_batches_still_finds_a_pipeline_that_does_not_resume() -> None:
    with pytest.raises(ResumeMismatchError, match=r"save at step 1 \(live"):
        check_resume(lambda: _Endless(_wc(), forget=True), 1, max_batches=6)


def test_max_batches_on_finite_epochs_keeps_their_ends() -> None:
    # 5 + 5 items cut at 7: both save points at the end of epoch 0 stay, none after 7
    assert check_resume(lambda: RangeSource(5, _wc()), 2, max_batches=7) == 8 + 1
    with pytest.raises(LoaderUsageError, match="max_batches"):
        check_resume(lambda: RangeSource(5, _wc()), 1, max_batches=0)
