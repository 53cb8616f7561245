"""Datasets and the shared resume-at-every-step helper used by the loader and wrapper tests.

``check_resume_everywhere(factory, epochs)`` takes the uninterrupted stream of ``epochs``
epochs as reference, then for every step k (0 .. end, plus the moments between epochs)
saves, encodes to bytes, decodes, restores into a fresh loader and checks that the
continuation is the reference's, bit for bit, epoch boundaries included: a save at an
epoch's last item restores to that epoch's empty rest, then the next epoch; a save after
the epoch's StopIteration restores to the next epoch. Saves may also be taken after
``break`` or an exception in the loop body (``variants``).
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


def expected_chunks(lengths: list[int], k: int, between: bool) -> list[int]:
    """Items each ``iter()`` of a loader restored at save point ``k`` yields.

    ``k`` items yielded; ``between``: the save came after the epoch's StopIteration (the
    restored loader starts the next epoch). Otherwise the save came while the iteration
    that yielded the ``k``-th item was live (or abandoned): the restored loader's first
    ``iter()`` yields that epoch's rest, possibly nothing (a save at the epoch's last
    batch), then the following epochs.
    """
    if k == 0 and not between:
        return list(lengths)
    acc = 0
    if between:  # after the StopIteration of the first epoch that ends at k (empty ones too)
        for e, n in enumerate(lengths):
            acc += n
            if acc == k:
                return list(lengths[e + 1 :])
        raise AssertionError(f"no epoch ends at save point {k}")
    for e, n in enumerate(lengths):
        if acc < k <= acc + n or (n == 0 and acc == k and not between):
            return ([] if between else [acc + n - k]) + list(lengths[e + 1 :])
        acc += n
    raise AssertionError(f"no epoch holds save point {k}")


class _LoopBodyError(Exception):
    """Raised inside a training loop body by check_resume_everywhere's "raise" variant."""


def check_resume_everywhere(
    factory: Callable[[], Any],
    epochs: int = 2,
    *,
    restore_factory: Callable[[], Any] | None = None,
    steps: Iterable[int] | None = None,
    variants: Iterable[str] = ("live",),
    check_live_next_epoch: bool = True,
    reference: list[list[Any]] | None = None,
) -> int:
    """Save at every step (or ``steps``), restore into a fresh loader, compare. Returns
    the number of save points checked.

    ``variants`` say how a save at step ``k`` is taken: ``"live"`` (while the iterator is
    live, right after the ``k``-th item, also at an epoch's last item), ``"break"``
    (``break`` out of the loop and drop the iterator, then save) and ``"raise"`` (an
    exception in the loop body leaves the loop, then save). All restore to the same
    continuation. After ``break``/``raise`` the live loader's next ``iter()`` must start
    the next epoch (``check_live_next_epoch``), as torch's does. ``reference``: the
    uninterrupted epochs, if the caller has them already (``epochs_of(factory(), epochs)``).
    """
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
        for variant in variants if (k and not between) else ("live",):
            _check_point(factory, restore_factory, reference, lengths, flat, k, between, variant,
                         check_live_next_epoch)
            checked += 1
    return checked


def _check_point(
    factory: Callable[[], Any], restore_factory: Callable[[], Any], reference: list[list[Any]], lengths: list[int],
    flat: list[Any], k: int, between: bool, variant: str, check_live_next_epoch: bool,
) -> None:
    epochs = len(lengths)
    loader = factory()
    seen: list[Any] = []
    state = None
    live = None
    stopped_in = -1  # the epoch whose iteration was left by break / raise
    if k == 0 and not between:
        state = loader.save_state_rank()
    else:
        for e in range(epochs):
            live = iter(loader)
            try:
                for item in live:
                    seen.append(item)
                    if len(seen) == k and not between:
                        if variant == "live":
                            state = loader.save_state_rank()
                        elif variant == "raise":
                            raise _LoopBodyError(k)
                        break
            except _LoopBodyError:
                pass
            if len(seen) == k and not between:
                if state is None:  # break / raise: the iterator is dropped, then the save
                    live = None
                    stopped_in = e
                    state = loader.save_state_rank()
                break
            if len(seen) == k and between:
                live = None
                state = loader.save_state_rank()
                break
    assert state is not None, f"no save point at k={k}"
    again = loader.save_state_rank()
    assert encode(again) == encode(state), f"k={k} {variant}: saving twice without iterating gave different states"
    assert_streams(seen, flat[:k], f"k={k} prefix")
    if stopped_in >= 0 and check_live_next_epoch and stopped_in + 1 < epochs:
        # the live loader's next iter() starts the next epoch, as torch's does
        assert_streams(list(loader), reference[stopped_in + 1], f"k={k} {variant}: live loader's next epoch")
    del live, loader
    data = encode(state)
    fresh = restore_factory()
    fresh.restore_state_rank(decode(data))
    after = fresh.save_state_rank()
    assert after.position == state.position, f"k={k}: state right after restore differs"
    if restore_factory is factory:
        assert encode(after) == data, f"k={k}: state right after restore differs"
    chunks = expected_chunks(lengths, k, between)
    got_chunks: list[list[Any]] = [list(fresh) for _ in chunks]
    assert [len(c) for c in got_chunks] == chunks, (
        f"k={k} between={between} {variant}: epoch lengths after restore {[len(c) for c in got_chunks]}, "
        f"expected {chunks}"
    )
    assert_streams([x for c in got_chunks for x in c], flat[k:], f"k={k} between={between} {variant} continuation")


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
