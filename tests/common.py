"""Datasets and the shared resume-at-every-step helper used by the loader and wrapper tests.

``check_resume_everywhere(factory, epochs)`` takes the uninterrupted stream of ``epochs``
epochs as reference, then for every step k (0 .. end, plus the moments between epochs)
saves, encodes to bytes, decodes, restores into a fresh loader and checks that the
continuation is the reference's, bit for bit, epoch boundaries included.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

import savable_loader as sl
from savable_loader.state import decode, encode


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()


def assert_same(a: Any, b: Any, path: str = "item") -> None:
    """Bit-exact equality of nested tensors, arrays, NumPy scalars, lists, tuples, dicts and
    scalars: types (namedtuples, dict subclasses), dtypes (of NumPy scalars too, byte order
    included), shapes, dict key order and bits (NaN payloads, -0.0) must all match."""
    assert type(a) is type(b), f"{path}: {type(a).__qualname__} {a!r} vs {type(b).__qualname__} {b!r}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b) or _bits(a) == _bits(b), f"{path}: tensors differ\n{a}\n{b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: array {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        same = np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        assert same, f"{path}: arrays differ\n{a}\n{b}"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{path}: NumPy scalar of dtype {a.dtype} vs {b.dtype}"
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{path}: {a!r} vs {b!r}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def assert_streams(got: list[Any], want: list[Any], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} items, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same(a, b, f"{what}[{i}]")


def epochs_of(loader: Iterable[Any], epochs: int) -> list[list[Any]]:
    """The items of ``epochs`` consecutive ``iter(loader)`` calls."""
    return [list(loader) for _ in range(epochs)]


def _save_points(lengths: list[int]) -> list[tuple[int, bool]]:
    points = []
    total = sum(lengths)
    ends = set()
    acc = 0
    for n in lengths:
        acc += n
        ends.add(acc)
    for k in range(total + 1):
        points.append((k, False))
        if k in ends:
            points.append((k, True))  # after the epoch's StopIteration, before the next iter()
    return points


def check_resume_everywhere(
    factory: Callable[[], Any],
    epochs: int = 2,
    *,
    restore_factory: Callable[[], Any] | None = None,
    steps: Iterable[int] | None = None,
    reference: list[list[Any]] | None = None,
) -> int:
    """Save at every step (or ``steps``), restore into a fresh loader, compare. Returns
    the number of save points checked. ``reference``: the uninterrupted epochs, if the
    caller has them already (``epochs_of(factory(), epochs)``)."""
    if restore_factory is None:
        restore_factory = factory
    if reference is None:
        reference = epochs_of(factory(), epochs)
    lengths = [len(e) for e in reference]
    flat = [x for e in reference for x in e]
    assert flat, "the reference stream is empty"
    wanted = None if steps is None else set(steps)
    checked = 0
    for k, between in _save_points(lengths):
        if wanted is not None and k not in wanted:
            continue
        loader = factory()
        seen: list[Any] = []
        state = None
        live = None
        if k == 0 and not between:
            state = loader.save_state_rank()
        else:
            for _ in range(epochs):
                live = iter(loader)
                for item in live:
                    seen.append(item)
                    if len(seen) == k and not between:
                        state = loader.save_state_rank()
                        break
                if state is not None:
                    break
                if len(seen) == k and between:
                    live = None
                    state = loader.save_state_rank()
                    break
        assert state is not None, f"no save point at k={k}"
        again = loader.save_state_rank()
        assert encode(again) == encode(state), f"k={k}: saving twice without iterating gave different states"
        assert_streams(seen, flat[:k], f"k={k} prefix")
        del live, loader
        data = encode(state)
        fresh = restore_factory()
        fresh.restore_state_rank(decode(data))
        after = fresh.save_state_rank()
        assert after.position == state.position, f"k={k}: state right after restore differs"
        if restore_factory is factory:
            assert encode(after) == data, f"k={k}: state right after restore differs"
        # Which epoch and offset the save point is at: expected chunks of the remainder.
        acc, expected_chunks = 0, []
        for n in lengths:
            if acc + n > k:
                expected_chunks.append(acc + n - max(k, acc))
            acc += n
        got_chunks: list[list[Any]] = []
        for _ in range(len(expected_chunks)):
            got_chunks.append(list(fresh))
        assert [len(c) for c in got_chunks] == expected_chunks, (
            f"k={k} between={between}: epoch lengths after restore {[len(c) for c in got_chunks]}, "
            f"expected {expected_chunks}"
        )
        assert_streams([x for c in got_chunks for x in c], flat[k:], f"k={k} between={between} continuation")
        checked += 1
    return checked


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
