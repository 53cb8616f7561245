"""GcDataset: the same stream, resumable, a collection every N samples, a frozen heap in
worker processes only."""

from __future__ import annotations

import gc

import pytest

from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers import GcDataset, MapDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import check_restore_samples, make_loader, make_wc

pytestmark = pytest.mark.timeout(120)

N = 12


@pytest.mark.parametrize("num_workers", [0, 2])
def test_same_stream_and_resume(num_workers):
    wc = make_wc(num_workers)
    plain = epochs_of(make_loader(RangeSource(N, wc)), 2)
    # generation 0, no freeze: full collections of the test process's heap are slow (see below)
    factory = lambda: make_loader(GcDataset(RangeSource(N, wc), 3, generation=0, freeze=False))
    assert_streams(epochs_of(factory(), 2)[1], plain[1], "with GcDataset")
    steps = None if num_workers == 0 else [0, 5, N, 2 * N]
    assert check_resume_everywhere(factory, 2, steps=steps) >= 4


def test_collects_every_n_samples():
    calls = []

    def callback(phase, info):
        if phase == "start":
            calls.append(info["generation"])

    ds = GcDataset(RangeSource(N, make_wc(0)), 5, generation=1)
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collections during the count
    gc.callbacks.append(callback)
    try:
        assert len(list(ds)) == N
    finally:
        gc.callbacks.remove(callback)
        if was_enabled:
            gc.enable()
    assert calls == [1, 1]  # after samples 5 and 10; no freeze in the main process


def test_freezes_in_workers_only():
    wc = make_wc(2)
    ds = MapDataset(GcDataset(RangeSource(4, wc), 2), lambda x: gc.get_freeze_count() > 0)
    assert list(make_loader(ds)) == [True] * 4
    frozen_here = gc.get_freeze_count()
    in_process = MapDataset(GcDataset(RangeSource(4, make_wc(0)), 2), lambda x: gc.get_freeze_count())
    assert list(make_loader(in_process)) == [frozen_here] * 4


def test_restore_sample_and_arguments():
    wc = make_wc(0)
    assert check_restore_samples(lambda: GcDataset(RangeSource(N, wc), 2)) == 8
    with pytest.raises(LoaderUsageError, match="GcDataset every_n_samples must be a positive int, got 0"):
        GcDataset(RangeSource(N, wc), 0)
    with pytest.raises(LoaderUsageError, match="GcDataset generation must be 0, 1 or 2, got 3"):
        GcDataset(RangeSource(N, wc), generation=3)
    assert GcDataset(RangeSource(N, wc)).config() == {}
