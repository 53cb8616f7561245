"""Loaders whose datasets draw from NumPy's and torch's global RNGs side by side, one per
loading path (drop-in with the loader's order or a sampler of the user's drawing from
NumPy, savable pipeline with and without restore keys, plain IterableDataset), for the
seed-formula tests (``tests/rng/test_seed_formula.py``).

Every item is ``[value, numpy word x3, torch word x3]`` (ints below ``2**31``): under the
seed formula (3) the NumPy and torch words of an item are unrelated (formulas of
unreleased versions made them one Mersenne Twister stream shifted by one draw).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec
import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler, get_worker_info

import savable_loader as sl

__all__ = ["DRAWS", "FACTORIES", "digest", "draws", "make", "recording"]

#: Words drawn from each generator per item.
DRAWS = 3
N = 12


def draws(value: int) -> list[int]:
    """``value``, then ``DRAWS`` words from NumPy's global RNG and ``DRAWS`` from torch's."""
    return [value, *np.random.randint(0, 2**31, DRAWS).tolist(), *torch.randint(0, 2**31, (DRAWS,)).tolist()]


class TwoStreamsMap:
    """Map-style: sample i draws from NumPy's and torch's global RNGs."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> list[int]:
        return draws(i)


class TwoStreamsSource(sl.SavableDataset):
    """Savable source of ``range(N)`` split across workers; with ``keyed`` each sample is
    marked with its value (the draws then follow the key's seed), else the per-item seed."""

    _savable_fields = ("pos",)

    def __init__(self, worker_config: sl.WorkerConfig, keyed: bool) -> None:
        super().__init__(worker_config)
        self.keyed = keyed
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        while self.pos < N:
            value = self.pos
            self.pos += self.worker_config.workers_per_rank
            if self.keyed:
                self.mark_sample(value)
            yield draws(value)

    def restore_sample(self, key: Any) -> list[int]:
        self.mark_sample(key)
        return draws(key)

    def restore_sample_blocker(self) -> str | None:
        return None if self.keyed else "unkeyed"

    def config(self) -> dict[str, Any]:
        return {"n": N, "keyed": self.keyed}


class TwoStreamsIterable(IterableDataset):
    """A plain IterableDataset, sharded by worker."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, N, workers):
            yield draws(i)


class NumpyOrder(Sampler):
    """A sampler of the user's drawing its order from NumPy's global RNG (the loader runs
    it on a private stream of all three global RNGs, seeded per epoch)."""

    def __len__(self) -> int:
        return N

    def __iter__(self):
        return iter(np.random.permutation(N).tolist())


def _plain(items: Any) -> Any:
    return items


def make(path: str, num_workers: int = 0) -> sl.SavableDataLoader:
    """A fresh loader of ``path`` (one of :data:`FACTORIES`)."""
    context = "fork" if num_workers else None
    if path in ("dropin", "sampler", "iterable"):
        dataset: Any = TwoStreamsIterable() if path == "iterable" else TwoStreamsMap()
        order: dict[str, Any] = {"sampler": NumpyOrder()} if path == "sampler" else {"shuffle": path == "dropin"}
        return sl.SavableDataLoader(
            dataset,
            batch_size=None if path == "iterable" else 2,
            collate_fn=_plain,
            num_workers=num_workers,
            seed=5,
            multiprocessing_context=context,
            **order,
        )
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=5)
    source = TwoStreamsSource(wc, keyed=path == "pipeline-keyed")
    return sl.SavableDataLoader(
        source, batch_size=None, collate_fn=_plain, worker_config=wc, multiprocessing_context=context
    )


FACTORIES = ("dropin", "sampler", "pipeline", "pipeline-keyed", "iterable")


def recording(state: sl.state.RankState, **config: Any) -> sl.state.RankState:
    """``state`` with its ``LoaderConfig`` fields replaced (``seed_formula=2``: as a state
    of an unreleased version's formula would record it)."""
    return msgspec.structs.replace(state, config=msgspec.structs.replace(state.config, **config))


def digest(items: Any) -> str:
    """A short digest of a stream of plain items."""
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:24]
