"""Helpers shared by the ``test_wrapper_*`` modules.

* ``make_wc`` / ``make_loader``: a rank-0 worker config and a pipeline loader over it
  (``batch_size=None``; ``fork`` workers so that a monkeypatched snapshot policy reaches
  them).
* ``set_snapshot_policy(monkeypatch, "every")`` makes every loading context take a
  snapshot before every sample, so that a save uses the wrapper's own state at that
  point (skip offset 0) instead of replaying from an earlier snapshot. The default policy
  rarely snapshots fast samples, so it mostly exercises the skip replay; both are run.
* ``resume_steps``: the save points checked with worker processes (a subset, to stay
  fast: every save point starts fresh worker processes several times).
* ``round_robin`` models how the loader interleaves its workers' streams (one item per
  worker in turn, exhausted workers skipped), so that expectations can be computed per
  worker without the loader.
* ``EpochShuffledSource``: a savable source that reshuffles every epoch (and every pass
  of a ``RepeatDataset``) from ``worker_config.epoch_seed()``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

import savable_loader as sl
import savable_loader.pipeline.worker as worker_module

#: ``(num_workers, snapshot policy)`` for the resume-at-every-step tests.
RESUME_CASES = [
    pytest.param(0, "default", id="w0-default"),
    pytest.param(0, "every", id="w0-every"),
    pytest.param(2, "default", id="w2-default"),
    pytest.param(2, "every", id="w2-every"),
]

#: RESUME_CASES with one worker-process case: snapshots before every sample, so that a
#: save holds the wrapper's own state (each worker-process case costs several seconds).
RESUME_CASES_FAST = [case for case in RESUME_CASES if case.id != "w2-default"]


def make_wc(num_workers: int, seed: int = 3) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=seed)


def make_loader(ds: sl.SavableDataset, **kw: Any) -> sl.SavableDataLoader:
    if ds.worker_config.num_workers > 0:
        kw.setdefault("multiprocessing_context", "fork")
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, **kw)


def set_snapshot_policy(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """``"every"``: snapshot before every sample; ``"default"``: the library's policy."""
    if policy == "every":
        monkeypatch.setattr(worker_module, "SNAPSHOT_BUDGET", 1e12)
    elif policy != "default":
        raise ValueError(policy)


def resume_steps(num_workers: int, epoch_len: int) -> list[int] | None:
    """Save points for a two-epoch resume test: all of them in-process; with worker
    processes (each save point starts several) the start, both epoch ends and their
    neighbourhoods."""
    if num_workers == 0:
        return None
    n = epoch_len
    return sorted({k for k in (0, 2, n - 1, n, n + 2, 2 * n - 1, 2 * n) if 0 <= k <= 2 * n})


def worker_values(n: int, worker: int, workers: int) -> list[int]:
    """The integers below ``n`` that worker ``worker`` of ``workers`` reads from a RangeSource."""
    return list(range(worker, n, workers))


def round_robin(streams: Sequence[Sequence[Any]]) -> list[Any]:
    """One item of each stream in turn; an exhausted stream is skipped."""
    out: list[Any] = []
    iters = [iter(s) for s in streams]
    active = list(range(len(iters)))
    while active:
        still = []
        for w in active:
            try:
                out.append(next(iters[w]))
            except StopIteration:
                continue
            still.append(w)
        active = still
    return out


def split_by_worker(values: Sequence[int], workers: int) -> list[list[int]]:
    """Values grouped by ``value % workers`` (the RangeSource worker that read them), in order."""
    out: list[list[int]] = [[] for _ in range(workers)]
    for v in values:
        out[v % workers].append(v)
    return out


class EpochShuffledSource(sl.SavableDataset):
    """This worker's integers below ``n`` (w, w+W, ...), shuffled anew every epoch.

    The order is drawn from a private ``random.Random`` seeded with
    ``worker_config.epoch_seed()`` in ``reset_state_own``; the seed is a savable field,
    so a restore rebuilds the same order without touching the global RNGs.
    """

    _savable_fields = ("seed", "pos")

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.seed = self.worker_config.epoch_seed()
        self.pos = 0

    def order(self) -> list[int]:
        values = worker_values(self.n, self.worker_config.rank_worker_id(), self.worker_config.workers_per_rank)
        random.Random(self.seed).shuffle(values)
        return values

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        while self.pos < len(order):
            value = order[self.pos]
            self.pos += 1
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def iterate_with_keys(ds: sl.SavableDataset, epoch: int = 0, worker: int = 0) -> list[tuple[Any, Any]]:
    """``(sample, sample_key)`` for every sample ``ds`` yields in ``epoch`` as logical
    ``worker``, iterated in-process from the epoch's start (as the loader would)."""
    from savable_loader.config import _ActiveWorker
    from savable_loader.rng import preserve_global_rng

    out = []
    with _ActiveWorker(worker, epoch), preserve_global_rng():
        ds.reset_state_deep()
        for sample in ds:
            out.append((sample, ds.sample_key))
    return out


def check_restore_samples(
    factory: Callable[[], sl.SavableDataset], epochs: int = 1, count: int = 8, seed: int = 0
) -> int:
    """Iterate ``factory()`` for ``epochs`` epochs (logical worker 0, epochs in order on one
    object), then rebuild ``count`` random samples from their keys (after a trip through
    JSON) in a fresh pipeline and compare bit for bit; the fresh pipeline's state must not
    change. Returns the number of samples checked."""
    import msgspec

    from savable_loader.config import _ActiveWorker
    from savable_loader.rng import preserve_global_rng
    from tests.common import assert_same

    ds = factory()
    yielded = [(e, s, k) for e in range(epochs) for s, k in iterate_with_keys(ds, e)]
    assert yielded, "the pipeline yielded nothing"
    assert all(k is not None for _, _, k in yielded), "a sample has no key"
    picks = random.Random(seed).sample(range(len(yielded)), min(count, len(yielded)))
    fresh = factory()
    before = encode_state(fresh)
    for i in picks:
        epoch, sample, key = yielded[i]
        key = msgspec.json.decode(msgspec.json.encode(key))
        with _ActiveWorker(0, epoch), preserve_global_rng():
            rebuilt = fresh.restore_sample(key)
        assert_same(rebuilt, sample, f"sample {i} (epoch {epoch}, key {key!r})")
    assert encode_state(fresh) == before, "restore_sample changed the iteration state"
    return len(picks)


def encode_state(ds: sl.SavableDataset) -> bytes:
    """The pipeline's state as bytes (to compare two states)."""
    import msgspec

    from savable_loader.dataset.values import plain_dataset_state

    return msgspec.msgpack.encode(plain_dataset_state(ds.save_state()))
