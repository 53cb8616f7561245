"""Datasets and the shared resume-at-every-step helper used by the loader and wrapper tests.

``check_resume_everywhere(factory, epochs)`` is the public checker,
:func:`savable_loader.testing.check_resume`: it takes the uninterrupted stream of
``epochs`` epochs as reference, then for every step k (0 .. end, plus the moments
between epochs) saves, encodes to bytes, decodes, restores into a fresh loader and
checks that the continuation is the reference's, bit for bit (``assert_same``: types,
dtypes, bits, dict order), epoch boundaries included. Saves may also be taken after
``break`` or an exception in the loop body (``variants``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

import savable_loader as sl
from savable_loader.testing import assert_same, assert_streams, check_resume, expected_chunks

__all__ = [
    "RandomMapDataset",
    "RangeSource",
    "assert_same",
    "assert_streams",
    "check_resume_everywhere",
    "epochs_of",
    "expected_chunks",
]


def epochs_of(loader: Iterable[Any], epochs: int) -> list[list[Any]]:
    """The items of ``epochs`` consecutive ``iter(loader)`` calls."""
    return [list(loader) for _ in range(epochs)]


def check_resume_everywhere(factory: Callable[[], Any], epochs: int = 2, **options: Any) -> int:
    """:func:`savable_loader.testing.check_resume` (the public checker), under the name
    the tests use; the number of save points checked."""
    return check_resume(factory, epochs, **options)


# -- datasets ---------------------------------------------------------------------------


class RandomMapDataset:
    """Map-style: sample i is (i, draws from random, numpy and torch global RNGs)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(
            [i, random.randint(0, 10**6), int(np.random.randint(0, 10**6)), int(torch.randint(0, 10**6, ()))]
        )


class RangeSource(sl.SavableDataset):
    """Savable source: the integers below ``n`` (worker w of W takes w, w+W, ...),
    each with a draw from the three global RNGs; optional per-sample delay. With
    ``keyed`` (the default) every sample has a restore key (its value)."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig, delay: float = 0.0, keyed: bool = True) -> None:
        super().__init__(worker_config)
        self.n = n
        self.delay = delay
        self.keyed = keyed
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        step = self.worker_config.workers_per_rank
        while self.pos < self.n:
            value = self.pos
            self.pos += step
            if self.delay:
                time.sleep(self.delay)
            if self.keyed:
                self.mark_sample(value)
            yield self._build(value)

    @staticmethod
    def _build(value: int) -> torch.Tensor:
        return torch.tensor(
            [value, random.randint(0, 10**6), int(np.random.randint(0, 10**6)), int(torch.randint(0, 10**6, ()))]
        )

    def restore_sample(self, key: Any) -> torch.Tensor:
        if not self.keyed:
            return super().restore_sample(key)
        self.mark_sample(key)
        return self._build(key)

    def restore_sample_blocker(self) -> str | None:
        return None if self.keyed else "RangeSource(keyed=False) gives no keys"

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def empty_numpy_gaussian_cache() -> None:
    """Drop NumPy's legacy cached Gaussian (``np.random.randn`` makes two and keeps one),
    as loading in the caller's process does at every ``next()`` (``rng.states``): a no-op
    swap of the global RandomState's bit generator empties it and keeps every word."""
    np.random.set_bit_generator(np.random.get_bit_generator())  # type: ignore[attr-defined]
