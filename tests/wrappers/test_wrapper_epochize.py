"""EpochizeDataset: fixed-length epochs that continue one stream, across epoch boundaries,
restores, fresh and persistent worker processes."""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import pytest
import torch

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.state import decode, encode
from savable_loader.wrappers import (
    EpochizeDataset,
    EpochizeReplayWarning,
    LogSampleDataset,
    MapDataset,
    PackingDataset,
    RepeatDataset,
    ShuffleBufferDataset,
)
from tests.common import RangeSource, assert_same, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    EpochShuffledSource,
    check_restore_samples,
    make_loader,
    make_wc,
    set_snapshot_policy,
    split_by_worker,
    worker_values,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::savable_loader.wrappers.EpochizeReplayWarning"),
]

N = 6  # per worker: 3 values (2 workers) or 6 (in-process)
LENGTH = 5  # 2 workers: 3 + 2 a epoch


def epochized(num_workers: int, length: int = LENGTH, n: int = N, **kw):
    wc = make_wc(num_workers)
    return make_loader(EpochizeDataset(RepeatDataset(RangeSource(n, wc)), length), **kw)


def ids(epoch) -> list[int]:
    return [int(x[0]) for x in epoch]


def worker_stream(n: int, worker: int, workers: int, count: int) -> list[int]:
    """The first ``count`` values of a worker's endless repetition of its RangeSource share."""
    mine = worker_values(n, worker, workers)
    return [mine[i % len(mine)] for i in range(count)]


# With worker processes only the default policy: its rare snapshots make most restores
# start from an epoch's start, which rebuilds the inner position (the interesting path).
@pytest.mark.parametrize(("num_workers", "policy"), [c for c in RESUME_CASES if c.id != "w2-every"])
def test_resume_at_every_step_three_epochs(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    steps = None if num_workers == 0 else [0, 1, LENGTH - 1, LENGTH, LENGTH + 2, 2 * LENGTH, 2 * LENGTH + 3, 3 * LENGTH]
    assert check_resume_everywhere(lambda: epochized(num_workers), 3, steps=steps) >= 8


def test_resume_persistent_workers():
    factory = lambda: epochized(2, persistent_workers=True)
    assert check_resume_everywhere(factory, 3, steps=[0, 3, LENGTH, 2 * LENGTH + 1, 3 * LENGTH]) == 7


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_continue_the_stream(num_workers, persistent):
    if persistent and num_workers == 0:
        pytest.skip("persistent workers need worker processes")
    workers = max(num_workers, 1)
    epochs = [ids(e) for e in epochs_of(epochized(num_workers, persistent_workers=persistent), 4)]
    assert [len(e) for e in epochs] == [LENGTH] * 4
    per_worker = [[] for _ in range(workers)]
    for e in epochs:
        for w, mine in enumerate(split_by_worker(e, workers)):
            per_worker[w] += mine
    for w in range(workers):
        assert per_worker[w] == worker_stream(N, w, workers, len(per_worker[w]))


def recording() -> tuple[list[int], list[EpochizeDataset], Any]:
    """In-process loaders over one stream that record every inner sample pulled: the
    pulled values, the wrappers built and the factory."""
    pulled: list[int] = []
    built: list[EpochizeDataset] = []

    def factory():
        wc = make_wc(0)
        inner = MapDataset(RepeatDataset(RangeSource(N, wc)), lambda x: pulled.append(int(x[0])) or x)
        built.append(EpochizeDataset(inner, LENGTH))
        return make_loader(built[-1])

    return pulled, built, factory


def test_no_replay_in_process_nor_after_a_boundary_restore():
    pulled, built, factory = recording()
    loader = factory()
    reference = epochs_of(loader, 3)
    # the same inner iterator went on across epochs: every inner sample produced once
    assert pulled == worker_stream(N, 0, 1, 3 * LENGTH)
    state = loader.save_state_rank()  # between epochs: epoch 3 about to start
    assert state.position.epoch == 3 and state.position.workers[0].carried is not None
    pulled.clear()
    fresh = factory()
    fresh.restore_state_rank(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpochizeReplayWarning)
        nxt = [int(x[0]) for x in fresh]
    # the carried end state of epoch 2: epoch 3 goes on at once, nothing replayed
    assert built[1].replayed == 0 and built[0].replayed == 0
    assert pulled == nxt == worker_stream(N, 0, 1, 4 * LENGTH)[3 * LENGTH :]
    assert ids(reference[2])[-1] == worker_stream(N, 0, 1, 3 * LENGTH)[-1]


def test_a_boundary_state_without_its_carried_end_replays_exactly():
    # states saved between epochs by earlier versions had no carried end state
    pulled, built, factory = recording()
    loader = factory()
    reference = epochs_of(loader, 4)
    state = loader.save_state_rank()
    old = msgspec.structs.replace(
        state,
        position=msgspec.structs.replace(
            state.position, workers=[msgspec.structs.replace(w, carried=None) for w in state.position.workers]
        ),
    )
    old = decode(encode(old))
    fresh = factory()
    fresh.restore_state_rank(old)
    pulled.clear()
    it = iter(fresh)
    with pytest.warns(
        EpochizeReplayWarning, match="replayed 20 inner samples to rebuild the start of epoch 4 for worker 0"
    ):
        first = next(it)
    assert built[1].replayed == 20
    assert pulled == worker_stream(N, 0, 1, 4 * LENGTH + 1)
    assert int(first[0]) == worker_stream(N, 0, 1, 4 * LENGTH + 1)[-1]
    assert ids(reference[3])[-1] == worker_stream(N, 0, 1, 4 * LENGTH)[-1]


@pytest.mark.parametrize("persistent", [False, True])
def test_inner_samples_produced_in_worker_processes(persistent, tmp_path):
    # a log inside the wrapper records every inner sample a worker produces, replays too:
    # fresh worker processes every epoch produce each inner sample once, as persistent ones
    wc = make_wc(2)
    inner = LogSampleDataset(RepeatDataset(RangeSource(N, wc)), tmp_path)
    loader = make_loader(EpochizeDataset(inner, LENGTH), persistent_workers=persistent)
    epochs = 6
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpochizeReplayWarning)
        streams = epochs_of(loader, epochs)
    assert [len(e) for e in streams] == [LENGTH] * epochs
    for w, per_epoch in enumerate((3, 2)):  # LENGTH 5 over 2 workers
        with open(tmp_path / f"rank0-worker{w}.jsonl") as f:
            produced = sum(1 for _ in f)
        assert produced == epochs * per_epoch


@pytest.mark.parametrize(
    ("num_workers", "policy", "persistent"),
    [(2, "default", False), (2, "every", False), (0, "default", False), (0, "every", False), (2, "every", True)],
)
def test_resume_at_every_step_without_replay(num_workers, policy, persistent, monkeypatch):
    # every save point (mid-epoch and between epochs) of 4 epochs; no restore replays an
    # earlier epoch ("every": a snapshot after each sample, so that states saved right
    # after a worker's last sample hold its end state; persistent workers restored with a
    # rotation are replaced by new ones for the next epoch, which restore the end states)
    set_snapshot_policy(monkeypatch, policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EpochizeReplayWarning)
        factory = lambda: epochized(num_workers, persistent_workers=persistent)
        assert check_resume_everywhere(factory, 4) >= 4 * LENGTH


@pytest.mark.parametrize(
    ("n", "length", "want"),
    [
        (5, 3, [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]),  # ends early, starts over next epoch
        (6, 3, [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]),  # ends on the boundary: at once
        (2, 5, [[0, 1], [0, 1], [0, 1], [0, 1]]),
        (4, 0, [[], [], [], []]),
    ],
)
def test_finite_inner_stream(n, length, want):
    wc = make_wc(0)
    loader = make_loader(EpochizeDataset(RangeSource(n, wc), length))
    assert [ids(e) for e in epochs_of(loader, 4)] == want


def test_finite_inner_resumes():
    wc = make_wc(0)
    assert check_resume_everywhere(lambda: make_loader(EpochizeDataset(RangeSource(5, wc), 3)), 4) >= 15


def test_restore_sample():
    wc = make_wc(0)
    assert check_restore_samples(lambda: EpochizeDataset(RepeatDataset(RangeSource(N, wc)), LENGTH), epochs=3) == 8
    with pytest.raises(RestoreKeyError, match=r"EpochizeDataset key must be \[inner pass, inner key\], got 3"):
        EpochizeDataset(RangeSource(N, wc), 2).restore_sample(3)


def test_restore_sample_of_samples_buffered_across_epochs():
    # a shuffle buffer inside holds samples drawn in one loader epoch and yielded in the
    # next: their keys must not depend on the loader epoch (the inner runs in its passes)
    wc = make_wc(0)
    factory = lambda: EpochizeDataset(ShuffleBufferDataset(RepeatDataset(RangeSource(N, wc)), 4), LENGTH)
    assert check_restore_samples(factory, epochs=3, count=3 * LENGTH) == 3 * LENGTH


def test_finite_inner_is_reshuffled_per_pass():
    wc = make_wc(0)
    loader = make_loader(EpochizeDataset(EpochShuffledSource(6, wc), 6))
    passes = [[int(v) for v in e] for e in epochs_of(loader, 3)]
    assert all(sorted(p) == list(range(6)) for p in passes)
    assert passes[0] != passes[1] and passes[1] != passes[2]


@pytest.mark.parametrize("bad", [-1, 2.5, True, "3", None])
def test_bad_length(bad):
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match=rf"EpochizeDataset length must be a non-negative int, got {bad!r}"):
        EpochizeDataset(RangeSource(3, wc), bad)


def test_config_and_can_restore():
    ds = EpochizeDataset(RangeSource(3, make_wc(0)), 2)
    assert ds.config() == {"length": 2}
    assert ds.can_restore_sample()
    assert not EpochizeDataset(RangeSource(3, make_wc(0), keyed=False), 2).can_restore_sample()


def _token_docs(info, start=0):
    """This worker's documents from ``start`` on (also the seek callback)."""
    for i in list(info.split(range(40)))[start:]:
        yield torch.full((1 + i % 7,), i) + torch.randint(0, 3, (1 + i % 7,))


def _packed_stream(num_workers: int):
    from savable_loader.sources import IterableSource

    wc = make_wc(num_workers)
    ds = ShuffleBufferDataset(RepeatDataset(IterableSource(_token_docs, wc, seek=_token_docs)), 3)
    return make_loader(EpochizeDataset(PackingDataset(ds, 8, strategy="best_fit", buffer_size=3, bos=-1), 6))


def test_over_an_iterable_source_with_packing():
    """Fixed-length epochs of packed rows from a generator source through a shuffle
    buffer: resume everywhere in 3 epochs, and loader restore keys (2 workers)."""
    assert check_resume_everywhere(lambda: _packed_stream(0), 3) >= 20
    loader = _packed_stream(2)
    run = [(loader.restore_key, row) for _ in range(3) for row in loader]
    assert len(run) == 18
    fresh = _packed_stream(2)
    for key, row in run:
        assert_same(fresh.restore_sample(str(key)), row, str(key))


@pytest.mark.parametrize(("n", "length", "limit"), [(2, 1, 5), (2, 2, 4), (3, 1, 7)])
def test_inside_a_repeat_resumes_at_epoch_boundaries(n, length, limit):
    # Found by tests/pipeline/test_pipeline_properties.py: an EpochizeDataset inside a
    # RepeatDataset kept (in-process) the inner stream it had built under the last pass's
    # seeds across the loader's epoch boundary, while a restore there rebuilt it outside
    # any pass: the next epoch drew another dataset of the blend first. The carry now
    # serves only a reset in the context (repetitions) it was made in.
    from savable_loader.wrappers import BlendDataset, LimitDataset

    def make():
        wc = make_wc(0)
        blend = BlendDataset([RangeSource(n, wc), RangeSource(n, wc)])
        return make_loader(LimitDataset(RepeatDataset(EpochizeDataset(blend, length)), limit))

    assert check_resume_everywhere(make, 2) == 2 * limit + 3
