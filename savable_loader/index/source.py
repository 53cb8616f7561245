"""The index source of the drop-in path: epochs of a map-style dataset as batch keys.

For epoch ``e`` the global order is a permutation of ``range(len(dataset))`` drawn from
``(seed, e)`` (the identity without ``shuffle``): a keyed bijection evaluated position by
position, so that no part of the drop-in path holds O(len(dataset)) memory or spends
O(len(dataset)) time before a batch (``savable_loader/index/permutation.py``). If the dataset
does not split evenly over ``world_size`` ranks, the order is padded by wrapping around
to its start (position ``p`` holds the sample of position ``p % N``), as
``torch.utils.data.DistributedSampler`` does, so every rank gets ``ceil(N / world_size)``
samples; rank ``r`` takes global positions ``r, r + W, r + 2W, ...``. The rank's share
is cut into batches; with ``drop_last`` the last, shorter batch is dropped. An epoch
resumed on another world size continues with the samples no rank had consumed
(``stages``, see ``savable_loader/core/elastic.py``).

A sample is identified by its **position** in the epoch's global order. Before loading
it, the worker re-seeds Python ``random``, NumPy's and torch's global RNGs from
``item_seed(counter_seed(derive_seed(seed, "sample", epoch), position))`` (below
``2**63``; see ``savable_loader.rng.seeding.item_seed``), and the generators the dataset owns the
same way (``savable_loader/rng/owned.py``); so the data of a sample does not depend on
``num_workers``, the batch size or the world size, and a resume needs no RNG snapshot.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
from torch.utils.data import Dataset, Sampler, get_worker_info

from savable_loader._torch.internals import worker_seed_setter
from savable_loader.core.elastic import Share, epoch_length, rank_share, share_length
from savable_loader.errors import LoaderUsageError
from savable_loader.index.permutation import EpochOrder
from savable_loader.rng.formulas import collate_seed, owned_stream_seed, sample_base, sample_item, sample_items
from savable_loader.rng.global_rngs import GlobalRngs
from savable_loader.rng.owned import OwnedRngs
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, global_seeder, preserve_global_rng
from savable_loader.state.schema import IndexStage
from savable_loader.stats.clock import StageTime, WorkerReport

__all__ = ["BatchKey", "IndexPlan", "IndexSampler", "IndexedDataset", "own_getitems"]


@dataclass(frozen=True)
class BatchKey:
    """Everything a worker needs to build one batch: epoch and (position, index) pairs.

    Example::

        BatchKey(epoch=0, positions=(0, 2), indices=(17, 4))   # dataset[17], dataset[4]
    """

    epoch: int
    positions: tuple[int, ...]
    indices: tuple[int, ...]


class IndexPlan:
    """The per-epoch order of one rank's samples and its cutting into batches.

    Nothing here grows with the dataset: the order is evaluated per position
    (:class:`~savable_loader.index.permutation.EpochOrder`), a rank's share is a ``range`` or, after a world-size change, a lazy
    :class:`~savable_loader.core.elastic.Share`, and batch keys are made a chunk of positions
    at a time (one batch first, then doubling up to ``CHUNK``).

    Example::

        plan = IndexPlan(10, seed=0, shuffle=True, rank=1, world_size=2, batch_size=2, drop_last=False)
        [k.positions for k in plan.batches(epoch=0, start=0)]   # [(1, 3), (5, 7), (9,)]
    """

    #: Positions whose dataset indices are computed together (one vectorised call).
    CHUNK = 4096

    def __init__(
        self,
        dataset_len: int,
        *,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        batch_size: int | None,
        drop_last: bool,
    ) -> None:
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._order: EpochOrder | None = None

    def share(self, stages: tuple[IndexStage, ...] = ()) -> range | Share:
        """This rank's global positions of an epoch (after ``stages``), in order (lazy)."""
        return rank_share(self.dataset_len, self.world_size, self.rank, stages)

    def rank_len(self, stages: tuple[IndexStage, ...] = ()) -> int:
        """Samples of this rank's share of an epoch (after padding)."""
        return share_length(self.dataset_len, self.world_size, self.rank, stages)

    @property
    def step(self) -> int:
        """Samples per yielded item (the batch size, or 1 when unbatched)."""
        return self.batch_size or 1

    def epoch_len(self, stages: tuple[IndexStage, ...] = ()) -> int:
        """Samples this rank yields in a whole epoch (``drop_last`` applied).

        After a world-size change the ranks' shares may differ by one sample; with
        ``drop_last`` every rank then stops at the same number of full batches (that of
        the smallest share), so all ranks take the same number of steps.
        """
        if self.drop_last or not stages:
            return epoch_length(self.dataset_len, self.world_size, self.rank, stages, self.batch_size, self.drop_last)
        return self.rank_len(stages)

    def num_batches(self, stages: tuple[IndexStage, ...] = ()) -> int:
        """Items (batches) this rank yields in a whole epoch."""
        return math.ceil(self.epoch_len(stages) / self.step)

    def order(self, epoch: int) -> EpochOrder:
        """The order of ``epoch``."""
        cached = self._order  # one read: the sampler and a restore_sample may race
        if cached is not None and cached.epoch == epoch:
            return cached
        order = EpochOrder(self.dataset_len, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        self._order = order
        return order

    def global_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in global order (not padded), materialised:
        O(N) memory, for tests and inspection only."""
        return self.order(epoch)(np.arange(self.dataset_len, dtype=np.int64))

    def key(self, epoch: int, positions: Any) -> BatchKey:
        """The batch key of the global ``positions`` of ``epoch``."""
        positions = tuple(int(p) for p in positions)
        indices = self.order(epoch)(np.asarray(positions, dtype=np.int64)).tolist()
        return BatchKey(epoch, positions, tuple(indices))

    def batches(self, epoch: int, start: int, stages: tuple[IndexStage, ...] = ()) -> Iterator[BatchKey]:
        """Batch keys of ``epoch`` from the ``start``-th sample of this rank on."""
        share = self.share(stages)
        end = self.epoch_len(stages)
        step = self.step
        most = max(step, self.CHUNK // step * step)  # whole batches (start is a batch boundary)
        chunk = step  # the first batch comes at once; chunks double up to `most`
        order = self.order(epoch)
        first = start
        while first < end:
            last = min(first + chunk, end)
            part = share[first:last]
            positions = np.arange(part.start, part.stop, part.step) if isinstance(part, range) else np.asarray(part)
            pos = positions.tolist()
            idx = order(positions).tolist()
            for b in range(0, last - first, step):
                yield BatchKey(epoch, tuple(pos[b : b + step]), tuple(idx[b : b + step]))
            first, chunk = last, min(2 * chunk, most)


class IndexSampler(Sampler[BatchKey]):
    """The sampler torch's DataLoader iterates on the drop-in path: the batch keys of the
    iteration the loader started last.

    The loader hands it each iteration's keys (``feed``) right before torch's iterator
    asks for them (torch's multiprocessing iterator calls ``iter()`` twice while it is
    built, and uses the second); several iterations may each hold their own key iterator.

    Example::

        sampler = IndexSampler()
        sampler.feed(plan.batches(epoch=3, start=4))   # epoch 3 from this rank's 4th sample on
        keys = iter(sampler)                           # what torch's iterator draws from
    """

    def __init__(self) -> None:
        self._next: Iterator[BatchKey] | None = None

    def feed(self, keys: Iterator[BatchKey]) -> None:
        """The keys the next ``iter(sampler)`` returns."""
        self._next = keys

    def __iter__(self) -> Iterator[BatchKey]:
        if self._next is None:
            raise LoaderUsageError("IndexSampler iterated without keys: only SavableDataLoader iterates it")
        return self._next


class IndexedDataset(Dataset):
    """Wraps the user's map-style dataset: ``dataset[key]`` builds a whole batch.

    Each sample is loaded after re-seeding the global RNGs from ``item_seed(counter_seed(
    base, position))`` with ``base = derive_seed(seed, *salt, epoch)`` (the loader's own
    order: ``salt=("sample",)`` and global positions; a sampler of the user's:
    ``("sampler-sample", rank)`` and positions in the sampler's stream); the collate
    function runs after re-seeding from the batch's first position. A dataset with
    ``__getitems__`` of its own (as torch's fetcher uses it; not torch's ``Subset`` or
    ``StackDataset`` forwarding, which index per sample) gets the whole batch in one
    call, after one re-seed from the first position; with ``reseed="batch"`` every dataset
    does (one re-seed before the batch's first sample, the samples then drawing in turn:
    for samples of a few microseconds, where re-seeding three generators per sample would
    cost as much as the sample). In the main process (``num_workers=0``) the
    caller's RNG streams are saved and put back around the batch. ``user_dataset`` is the
    user's dataset (in a worker: the worker's copy, which ``get_worker_info().dataset``
    shows). With ``timing`` each batch travels as ``(batch, report)`` (a plain tuple, the
    cheapest to pickle; the engine's ``on_item`` hands the report on), the report giving
    the time spent in the dataset (re-seeding included) and in the collate function.

    Example::

        ds = IndexedDataset(my_dataset, seed=0, collate_fn=default_collate, batched=True)
        batch = ds[plan.key(0, [0, 1, 2, 3])]   # what a worker builds for these positions
    """

    def __init__(
        self,
        dataset: Any,
        seed: int,
        collate_fn: Callable[[Any], Any],
        batched: bool,
        *,
        salt: tuple[int | str, ...] = ("sample",),
        reseed: str = "sample",
        global_rngs: tuple[str, ...] = GLOBAL_RNG_NAMES,
        timing: bool = False,
    ) -> None:
        self.dataset = dataset
        self.timing = timing
        self.seed = seed
        self.collate_fn = collate_fn
        self.batched = batched
        self.salt = salt
        self.reseed = reseed
        self.global_rngs = global_rngs

    @property
    def user_dataset(self) -> Any:
        """The user's dataset (what ``loader.dataset`` and ``get_worker_info().dataset`` show)."""
        return self.dataset

    def __len__(self) -> int:
        return len(self.dataset)

    #: What crosses to a spawn/forkserver worker (process-local caches stay behind).
    _FIELDS = ("dataset", "seed", "collate_fn", "batched", "salt", "reseed", "global_rngs", "timing")

    def __getstate__(self) -> dict[str, Any]:
        # cloudpickle carries lambdas and local classes to spawn/forkserver workers.
        return {"payload": cloudpickle.dumps(tuple(getattr(self, name) for name in self._FIELDS))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in zip(self._FIELDS, cloudpickle.loads(state["payload"]), strict=True):
            setattr(self, name, value)

    def build(self, key: BatchKey) -> Any:
        """The batch (or sample, when unbatched) that ``key`` names."""
        try:
            return self._build_looking(key)
        except TypeError as e:  # np.random.seed() while NumPy is left out: say what to declare
            guard = self._guard()
            if guard is not None:
                guard.explain(e, f"the batch from position {key.positions[0]} of epoch {key.epoch}")
            raise

    def _build_looking(self, key: BatchKey) -> Any:
        owned = OwnedRngs.cached(self.__dict__, self.dataset, self.collate_fn, self._owned_seed(), key.epoch)
        batch = self._build(key, owned)
        fresh = owned.look_again(self.dataset, self.collate_fn)
        if fresh is not None:  # a generator made on first use: build the batch with it re-seeded
            OwnedRngs.replace_cached(self.__dict__, fresh)
            if fresh.built == 1:
                batch = self._build(key, fresh)
        return batch

    def _build(self, key: BatchKey, owned: OwnedRngs) -> Any:
        base = self._sample_base(key.epoch)
        dataset = self.dataset
        many = own_getitems(dataset) if self.batched else None
        guard = self._guard()
        reseed = global_seeder(GLOBAL_RNG_NAMES) if guard is None else guard.seed
        set_info_seed = worker_seed_setter()
        if set_info_seed is not None:  # in a worker: get_worker_info().seed follows torch.initial_seed()
            reseed = _both(reseed, set_info_seed)
        if guard is not None:  # the generators left out in their fixed state for this batch
            guard.begin(self.seed, key.epoch)
        if many is not None or self.reseed == "batch":
            reseed(sample_item(base, key.positions[0]))
            owned.seed_sample(key.positions[0])
            samples = many(list(key.indices)) if many is not None else [dataset[index] for index in key.indices]
        else:
            samples = []
            seeds = sample_items(base, key.positions)
            if owned.has_sample_generators:
                for seed, position, index in zip(seeds, key.positions, key.indices):
                    reseed(seed)
                    owned.seed_sample(position)
                    samples.append(dataset[index])
            else:  # the common case: nothing but the global RNGs to re-seed
                for seed, index in zip(seeds, key.indices):
                    reseed(seed)
                    samples.append(dataset[index])
        reseed(collate_seed(self.seed, key.epoch, key.positions[0]))
        owned.seed_collate(key.positions[0])
        if not self.timing:
            batch = self.collate_fn(samples if self.batched else samples[0])
        else:
            collating = time.perf_counter()
            batch = self.collate_fn(samples if self.batched else samples[0])
            self.__dict__["_collated"] = time.perf_counter() - collating
        if guard is not None:
            guard.check(
                f"the batch of {len(key.positions)} sample(s) from position {key.positions[0]} of epoch {key.epoch}"
            )
        return batch

    def _guard(self) -> GlobalRngs | None:
        """This process's :class:`GlobalRngs` for the setting (None: all three, the default)."""
        if self.global_rngs == GLOBAL_RNG_NAMES:
            return None
        where = (os.getpid(), self.global_rngs)
        cached = self.__dict__.get("_global_rngs")
        if cached is None or cached[0] != where:
            cached = (where, GlobalRngs(self.global_rngs))
            self.__dict__["_global_rngs"] = cached
        guard: GlobalRngs = cached[1]
        return guard

    def _owned_seed(self) -> int:
        """The seed of the owned generators' streams: the loader's seed for the loader's
        own (global) positions, salted like the global RNGs' for other streams."""
        return owned_stream_seed(self.seed, tuple(self.salt))

    def _sample_base(self, epoch: int) -> int:
        cached = self.__dict__.get("_base")
        if cached is not None and cached[0] == (self.seed, epoch):
            return cached[1]
        base = sample_base(self.seed, tuple(self.salt), epoch)
        self.__dict__["_base"] = ((self.seed, epoch), base)
        return base

    def __getitem__(self, key: BatchKey) -> Any:
        info = get_worker_info()
        if info is None:
            with preserve_global_rng():
                return self._timed(key, -1) if self.timing else self.build(key)
        return self._timed(key, info.id) if self.timing else self.build(key)

    def _timed(self, key: BatchKey, worker: int) -> tuple[Any, WorkerReport]:
        """``(self[key], its report)`` (``worker``: -1 in the main process)."""
        begun = time.perf_counter()
        self.__dict__["_collated"] = 0.0
        batch = self.build(key)
        done = time.perf_counter()
        collated: float = self.__dict__["_collated"]
        n = len(key.positions)
        stages: tuple[StageTime, ...] = (
            (type(self.dataset).__name__, done - begun - collated, n, True),
            ("collate", collated, 1, False),
        )
        return batch, (worker, done, 1, done - begun, n, stages)

    def rebuild(self, key: BatchKey) -> Any:
        """``self[key]`` in the calling process, the caller's RNG streams left as they were."""
        with preserve_global_rng():
            return self.build(key)


def _both(first: Callable[[int], None], second: Callable[[int], None]) -> Callable[[int], None]:
    def both(seed: int) -> None:
        first(seed)
        second(seed)

    return both


def own_getitems(dataset: Any) -> Callable[[list[Any]], Any] | None:
    """The dataset's batched ``__getitems__`` if its class defines one outside torch
    (torch's wrappers forward per sample: keep the per-sample seeds then)."""
    method = getattr(type(dataset), "__getitems__", None)
    if method is None or getattr(method, "__module__", "").startswith("torch.utils.data"):
        return None
    return dataset.__getitems__
