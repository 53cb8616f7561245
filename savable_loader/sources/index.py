"""The index source of the drop-in path: epochs of a map-style dataset as batch keys.

For epoch ``e`` the global order is a permutation of ``range(len(dataset))`` drawn from
``(seed, e)`` (the identity without ``shuffle``). If the dataset does not split evenly
over ``world_size`` ranks, the order is padded by wrapping around to its start, as
``torch.utils.data.DistributedSampler`` does, so every rank gets ``ceil(N / world_size)``
samples; rank ``r`` takes global positions ``r, r + W, r + 2W, ...``. The rank's share
is cut into batches; with ``drop_last`` the last, shorter batch is dropped. An epoch
resumed on another world size continues with the samples no rank had consumed
(``stages``, see ``savable_loader/_elastic.py``).

A sample is identified by its **position** in the epoch's global order. Before loading
it, the worker re-seeds Python ``random``, NumPy's and torch's global RNGs from
``item_seed(counter_seed(derive_seed(seed, "sample", epoch), position))`` (below
``2**63``; see ``savable_loader.rng.item_seed``), and the generators the dataset owns the
same way (``savable_loader/_owned_rng.py``); so the data of a sample does not depend on
``num_workers``, the batch size or the world size, and a resume needs no RNG snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
from torch.utils.data import Dataset, Sampler, get_worker_info

from savable_loader._elastic import epoch_length, rank_share, share_length
from savable_loader._owned_rng import OwnedRngs
from savable_loader.rng import (
    SEED_FORMULA,
    counter_seed,
    derive_seed,
    item_seed,
    preserve_global_rng,
    seed_global,
)
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

    Example::

        plan = IndexPlan(10, seed=0, shuffle=True, rank=1, world_size=2, batch_size=2, drop_last=False)
        [k.positions for k in plan.batches(epoch=0, start=0)]   # [(1, 3), (5, 7), (9,)]
    """

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
        self._cache: tuple[int, np.ndarray] | None = None
        self._shares: dict[Any, range | np.ndarray] = {}

    def share(self, stages: tuple[IndexStage, ...] = ()) -> range | np.ndarray:
        """This rank's global positions of an epoch (after ``stages``), in order."""
        if not stages:
            return rank_share(self.dataset_len, self.world_size, self.rank, ())
        key = tuple((s.world_size, tuple(s.consumed)) for s in stages)
        if key not in self._shares:
            self._shares = {key: rank_share(self.dataset_len, self.world_size, self.rank, stages)}
        return self._shares[key]

    def rank_len(self, stages: tuple[IndexStage, ...] = ()) -> int:
        """Samples of this rank's share of an epoch (after padding)."""
        if not stages:
            return share_length(self.dataset_len, self.world_size, self.rank, ())
        return len(self.share(stages))

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

    def global_order(self, epoch: int) -> np.ndarray:
        """The dataset indices of ``epoch`` in global order (not padded)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(derive_seed(self.seed, "permutation", epoch)))
            order = rng.permutation(self.dataset_len)
        else:
            order = np.arange(self.dataset_len)
        self._cache = (epoch, order)
        return order

    def key(self, epoch: int, positions: Any) -> BatchKey:
        """The batch key of the global ``positions`` of ``epoch``."""
        order = self.global_order(epoch)
        n = self.dataset_len
        positions = tuple(int(p) for p in positions)
        return BatchKey(epoch, positions, tuple(int(order[p % n]) for p in positions))

    def batches(self, epoch: int, start: int, stages: tuple[IndexStage, ...] = ()) -> Iterator[BatchKey]:
        """Batch keys of ``epoch`` from the ``start``-th sample of this rank on."""
        share = self.share(stages)
        end = self.epoch_len(stages)
        step = self.step
        for first in range(start, end, step):
            yield self.key(epoch, share[first : min(first + step, end)])


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
            raise RuntimeError("IndexSampler iterated without keys: only SavableDataLoader iterates it")
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
    call, after one re-seed from the first position. In the main process (``num_workers=0``) the
    caller's RNG streams are saved and put back around the batch. ``user_dataset`` is the
    user's dataset (in a worker: the worker's copy, which ``get_worker_info().dataset``
    shows).

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
        seed_formula: int = SEED_FORMULA,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.collate_fn = collate_fn
        self.batched = batched
        self.salt = salt
        self.seed_formula = seed_formula

    @property
    def user_dataset(self) -> Any:
        """The user's dataset (what ``loader.dataset`` and ``get_worker_info().dataset`` show)."""
        return self.dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> dict[str, Any]:
        # cloudpickle carries lambdas and local classes to spawn/forkserver workers.
        fields = (self.dataset, self.seed, self.collate_fn, self.batched, self.salt, self.seed_formula)
        return {"payload": cloudpickle.dumps(fields)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fields = cloudpickle.loads(state["payload"])
        self.dataset, self.seed, self.collate_fn, self.batched, self.salt, self.seed_formula = fields

    def build(self, key: BatchKey) -> Any:
        """The batch (or sample, when unbatched) that ``key`` names."""
        base = self._sample_base(key.epoch)
        dataset = self.dataset
        formula = self.seed_formula
        owned = OwnedRngs.cached(self.__dict__, dataset, self.collate_fn, self._owned_seed(), key.epoch)
        many = _own_getitems(dataset) if self.batched else None
        if many is not None:
            seed_global(item_seed(counter_seed(base, key.positions[0]), formula))
            owned.seed_sample(key.positions[0])
            samples = many(list(key.indices))
        else:
            samples = []
            for position, index in zip(key.positions, key.indices):
                seed_global(item_seed(counter_seed(base, position), formula))
                owned.seed_sample(position)
                samples.append(dataset[index])
        collate_seed = derive_seed(self.seed, "collate", key.epoch, key.positions[0])
        seed_global(item_seed(collate_seed, formula))
        owned.seed_collate(key.positions[0])
        return self.collate_fn(samples if self.batched else samples[0])

    def _owned_seed(self) -> int:
        """The seed of the owned generators' streams: the loader's seed for the loader's
        own (global) positions, salted like the global RNGs' for other streams."""
        return self.seed if self.salt == ("sample",) else derive_seed(self.seed, *self.salt)

    def _sample_base(self, epoch: int) -> int:
        cached = self.__dict__.get("_base")
        if cached is not None and cached[0] == (self.seed, epoch):
            return cached[1]
        base = derive_seed(self.seed, *self.salt, epoch)
        self.__dict__["_base"] = ((self.seed, epoch), base)
        return base

    def __getitem__(self, key: BatchKey) -> Any:
        if get_worker_info() is None:
            with preserve_global_rng():
                return self.build(key)
        return self.build(key)


def _own_getitems(dataset: Any) -> Callable[[list[Any]], Any] | None:
    """The dataset's batched ``__getitems__`` if its class defines one outside torch
    (torch's wrappers forward per sample: keep the per-sample seeds then)."""
    method = getattr(type(dataset), "__getitems__", None)
    if method is None or getattr(method, "__module__", "").startswith("torch.utils.data"):
        return None
    return dataset.__getitems__  # type: ignore[no-any-return]
