"""The index source of the drop-in path: epochs of a map-style dataset as batch keys.

For epoch ``e`` the global order is a permutation of ``range(len(dataset))`` drawn from
``(seed, e)`` (the identity without ``shuffle``): a keyed bijection evaluated position by
position, so that no part of the drop-in path holds O(len(dataset)) memory or spends
O(len(dataset)) time before a batch (``savable_loader/_permutation.py``). If the dataset
does not split evenly over ``world_size`` ranks, the order is padded by wrapping around
to its start (position ``p`` holds the sample of position ``p % N``), as
``torch.utils.data.DistributedSampler`` does, so every rank gets ``ceil(N / world_size)``
samples; rank ``r`` takes global positions ``r, r + W, r + 2W, ...``. The rank's share
is cut into batches; with ``drop_last`` the last, shorter batch is dropped. An epoch
resumed on another world size continues with the samples no rank had consumed
(``stages``, see ``savable_loader/_elastic.py``).

A sample is identified by its **position** in the epoch's global order. Before loading
it, the worker re-seeds Python ``random``, NumPy's and torch's global RNGs from
``counter_seed(derive_seed(seed, "sample", epoch), position)``, and the generators the
dataset owns the same way (``savable_loader/_owned_rng.py``); so the data of a sample does not depend on ``num_workers``,
the batch size or the world size, and a resume needs no RNG snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
from torch.utils.data import Dataset, Sampler, get_worker_info

from savable_loader._elastic import Share, epoch_length, rank_share, share_length
from savable_loader._owned_rng import OwnedRngs
from savable_loader._permutation import ORDER_FEISTEL, EpochOrder
from savable_loader.rng import counter_seed, derive_seed, preserve_global_rng, seed_global
from savable_loader.state.schema import IndexStage

__all__ = ["BatchKey", "IndexPlan", "IndexSampler", "IndexedDataset"]


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
    (:class:`~savable_loader._permutation.EpochOrder`; ``order_algorithm`` is
    ``"feistel-1"`` for new loaders, ``"numpy-permutation"`` after restoring a state of an
    earlier version), a rank's share is a ``range`` or, after a world-size change, a lazy
    :class:`~savable_loader._elastic.Share`, and batch keys are made a chunk of positions
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
        order_algorithm: str = ORDER_FEISTEL,
    ) -> None:
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.order_algorithm = order_algorithm
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

    def order(self, epoch: int, algorithm: str | None = None) -> EpochOrder:
        """The order of ``epoch`` (by default with this plan's ``order_algorithm``)."""
        algorithm = self.order_algorithm if algorithm is None else algorithm
        cached = self._order  # one read: the sampler and a restore_sample may race
        if cached is not None and cached.epoch == epoch and cached.algorithm == algorithm:
            return cached
        order = EpochOrder(algorithm, self.dataset_len, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        self._order = order
        return order

    def global_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in global order (not padded), materialised:
        O(N) memory, for tests and inspection only."""
        return self.order(epoch)(np.arange(self.dataset_len, dtype=np.int64))

    def key(self, epoch: int, positions: Any, algorithm: str | None = None) -> BatchKey:
        """The batch key of the global ``positions`` of ``epoch``."""
        positions = tuple(int(p) for p in positions)
        indices = self.order(epoch, algorithm)(np.asarray(positions, dtype=np.int64)).tolist()
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
    """The sampler torch's DataLoader iterates: batch keys of the loader's current plan.

    Example::

        sampler = IndexSampler(plan)
        sampler.epoch, sampler.start = 3, 4   # epoch 3 from this rank's 4th sample on
    """

    def __init__(self, plan: IndexPlan) -> None:
        self.plan = plan
        self.epoch = 0
        self.start = 0
        self.stages: tuple[IndexStage, ...] = ()

    def __iter__(self) -> Iterator[BatchKey]:
        return self.plan.batches(self.epoch, self.start, self.stages)

    def __len__(self) -> int:
        return self.plan.num_batches(self.stages)


class IndexedDataset(Dataset):
    """Wraps the user's map-style dataset: ``dataset[key]`` builds a whole batch.

    Each sample is loaded after re-seeding the global RNGs from ``(seed, epoch,
    position)``; the collate function runs after re-seeding from the batch's first
    position. In the main process (``num_workers=0``) the caller's RNG streams are saved
    and put back around the batch. Attribute lookups fall through to the user's dataset.

    Example::

        ds = IndexedDataset(my_dataset, seed=0, collate_fn=default_collate, batched=True)
        batch = ds[plan.key(0, [0, 1, 2, 3])]   # what a worker builds for these positions
    """

    def __init__(self, dataset: Any, seed: int, collate_fn: Callable[[Any], Any], batched: bool) -> None:
        self.dataset = dataset
        self.seed = seed
        self.collate_fn = collate_fn
        self.batched = batched

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> dict[str, Any]:
        # cloudpickle carries lambdas and local classes to spawn/forkserver workers.
        return {"payload": cloudpickle.dumps((self.dataset, self.seed, self.collate_fn, self.batched))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.dataset, self.seed, self.collate_fn, self.batched = cloudpickle.loads(state["payload"])

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "seed", "collate_fn", "batched"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def build(self, key: BatchKey) -> Any:
        """The batch (or sample, when unbatched) that ``key`` names."""
        samples = []
        base = self._sample_base(key.epoch)
        dataset = self.dataset
        owned = OwnedRngs.cached(self.__dict__, dataset, self.collate_fn, self.seed, key.epoch)
        for position, index in zip(key.positions, key.indices):
            seed_global(counter_seed(base, position))
            owned.seed_sample(position)
            samples.append(dataset[index])
        seed_global(derive_seed(self.seed, "collate", key.epoch, key.positions[0]))
        owned.seed_collate(key.positions[0])
        return self.collate_fn(samples if self.batched else samples[0])

    def _sample_base(self, epoch: int) -> int:
        cached = self.__dict__.get("_base")
        if cached is not None and cached[0] == epoch:
            return cached[1]
        base = derive_seed(self.seed, "sample", epoch)
        self.__dict__["_base"] = (epoch, base)
        return base

    def __getitem__(self, key: BatchKey) -> Any:
        if get_worker_info() is None:
            with preserve_global_rng():
                return self.build(key)
        return self.build(key)
