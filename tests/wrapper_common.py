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
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

import savable_loader as sl
import savable_loader._worker as worker_module

#: ``(num_workers, snapshot policy)`` for the resume-at-every-step tests.
RESUME_CASES = [
    pytest.param(0, "default", id="w0-default"),
    pytest.param(0, "every", id="w0-every"),
    pytest.param(2, "default", id="w2-default"),
    pytest.param(2, "every", id="w2-every"),
]


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
