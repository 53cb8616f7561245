"""Check that a loader or a savable dataset resumes exactly: the test every pipeline
should pass.

:func:`check_resume` runs ``epochs`` epochs uninterrupted as the reference, then for
every step ``k`` (0, after each item, and between epochs: after an epoch's
``StopIteration``, before the next ``iter()``) it builds a fresh loader, iterates to
``k``, saves, encodes the state to bytes, decodes it, restores it into another fresh
loader and checks that what follows is the reference's rest, bit for bit (tensors,
arrays and scalars compared with their types), epoch boundaries included. A save at an
epoch's last item restores to that epoch's empty rest, then the next epoch; a save
between epochs restores to the next epoch.

The first difference raises :class:`ResumeMismatchError` (an ``AssertionError`` and a
:class:`~savable_loader.errors.SavableLoaderError`), naming the save point (step,
epoch, item within the epoch), the first differing item after it and where inside the
item the values differ.

Example::

    from savable_loader.testing import check_resume

    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
    check_resume(lambda: MyDataset(..., worker_config=wc), epochs=2)   # a savable dataset
    check_resume(lambda: sl.SavableDataLoader(data, batch_size=4, shuffle=True, seed=0))
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import numpy as np
import torch

from savable_loader.core.tensordict import compare, is_collection, is_jagged
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, ResumeMismatchError
from savable_loader.loader.dataloader import SavableDataLoader
from savable_loader.state import decode, encode

__all__ = ["ResumeMismatchError", "assert_same", "assert_streams", "check_resume"]

#: How a save is taken at a step: while the iterator is live, after ``break`` (the
#: iterator dropped), after an exception in the loop body.
VARIANTS = ("live", "break", "raise")


def assert_same(a: Any, b: Any, path: str = "item") -> None:
    """Raise :class:`ResumeMismatchError` unless ``a`` and ``b`` are bit-identical,
    nested: the same types at every level (a namedtuple is not a tuple, a dict subclass
    not a dict, ``1`` not ``1.0``), tensors and arrays of the same dtype and shape with
    the same values (or the same bits: NaNs of equal payloads match), NumPy scalars of
    the same dtype (byte order included) and bits, floats of the same bits (``-0.0`` is
    not ``0.0``), dicts with the same keys in the same order, ``tensordict`` collections
    with the same ``batch_size``, keys and leaves, jagged nested tensors row by row.
    ``path`` names the compared value in the message.

    Example::

        assert_same({"x": torch.ones(2)}, {"x": torch.ones(2)})
    """
    if type(a) is not type(b):
        _fail(f"{path}: {type(a).__qualname__} {a!r} vs {type(b).__qualname__} {b!r}")
    if is_jagged(a) or is_collection(a):  # tensordict collections, jagged nested tensors
        compare(a, b, path, assert_same, _fail)
    elif isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            _fail(f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        if not (torch.equal(a, b) or _bits(a) == _bits(b)):
            _fail(f"{path}: tensors differ\n{a}\n{b}")
    elif isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            _fail(f"{path}: array {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
        if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            _fail(f"{path}: arrays differ\n{a!r}\n{b!r}")
    elif isinstance(a, np.generic):
        if a.dtype != b.dtype:
            _fail(f"{path}: NumPy scalar of dtype {a.dtype} vs {b.dtype}")
        if np.asarray(a).tobytes() != np.asarray(b).tobytes():
            _fail(f"{path}: {a!r} vs {b!r}")
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            _fail(f"{path}: {a!r} vs {b!r}")
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        if list(a) != list(b):
            _fail(f"{path}: keys {list(a)} vs {list(b)}")
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            _fail(f"{path}: {a!r} vs {b!r}")
    elif a != b:
        _fail(f"{path}: {a!r} vs {b!r}")


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()


def assert_streams(got: list[Any], want: list[Any], what: str) -> None:
    """Raise :class:`ResumeMismatchError` unless the two lists hold bit-identical items
    (see :func:`assert_same`); the message names the first differing item.

    Example::

        assert_streams(list(resumed), reference[k:], "after the restore")
    """
    if len(got) != len(want):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if not _same(a, b)), min(len(got), len(want)))
        _fail(f"{what}: {len(got)} items, expected {len(want)} (first difference at item {first})")
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same(a, b, f"{what}[{i}]")


def check_resume(
    factory: Callable[[], Any],
    epochs: int = 2,
    *,
    restore_factory: Callable[[], Any] | None = None,
    steps: Iterable[int] | None = None,
    variants: Iterable[str] = ("live",),
    check_live_next_epoch: bool = True,
    reference: list[list[Any]] | None = None,
    max_batches: int | None = None,
) -> int:
    """Save at every step, restore into a fresh loader, compare with an uninterrupted
    run; the number of save points checked.

    ``factory`` returns a new :class:`~savable_loader.SavableDataLoader` (anything with
    ``save_state_rank``/``restore_state_rank``) or a new
    :class:`~savable_loader.SavableDataset`, which is put in a loader with
    ``batch_size=None`` and its own ``worker_config`` (its ``num_workers`` worker
    processes). Each call must build the same thing: same data, same seed.
    ``restore_factory`` builds the loaders states are restored into (default
    ``factory``). ``steps``: check only these save points (items yielded before the
    save). ``variants`` say how each save is taken: ``"live"`` (right after the item,
    the iterator live), ``"break"`` (``break``, the iterator dropped, then the save),
    ``"raise"`` (an exception in the loop body, then the save); all must restore to the
    same continuation, and after ``break``/``raise`` the live loader's next ``iter()``
    must start the next epoch, as torch's does (``check_live_next_epoch``).
    ``reference``: the uninterrupted run's epochs (lists of items), if the caller has
    them already (default: run ``factory()`` for ``epochs`` epochs).
    ``max_batches``: check only the first ``max_batches`` items of the run (an endless
    pipeline's epoch never ends): the reference stops there, saves are taken up to it
    and each resumed run is compared up to it.

    Raises :class:`ResumeMismatchError` at the first difference.

    Example::

        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        checked = check_resume(lambda: Lines(text, worker_config=wc), epochs=2, variants=("live", "break"))
        check_resume(lambda: endless_pipeline(wc), epochs=1, max_batches=50)   # a stream without end
    """
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise LoaderUsageError(f"variants {sorted(unknown)} are not among {list(VARIANTS)}")
    if max_batches is not None and (
        not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1
    ):
        raise LoaderUsageError(f"check_resume max_batches must be None or an int >= 1, got {max_batches!r}")
    make = _loader_factory(factory)
    remake = make if restore_factory is None else _loader_factory(restore_factory)
    cut = False  # the reference's last epoch was cut at max_batches (it goes on)
    if reference is None:
        uninterrupted = make()
        if max_batches is None:
            reference = [list(uninterrupted) for _ in range(epochs)]
        else:
            reference, cut = _first_items(uninterrupted, epochs, max_batches)
        del uninterrupted
    elif max_batches is not None:
        flat_reference = [x for e in reference for x in e]
        if len(flat_reference) > max_batches:
            reference, cut = _cut(reference, max_batches), True
    lengths = [len(e) for e in reference]
    flat = [x for e in reference for x in e]
    if not flat:
        _fail(f"the uninterrupted run of {epochs} epochs yielded nothing: nothing to check")
    wanted = None if steps is None else set(steps)
    checked = 0
    for k, between in _save_points(lengths, cut):
        if wanted is not None and k not in wanted:
            continue
        for variant in tuple(variants) if (k and not between) else ("live",):
            _check_point(
                make,
                remake,
                restore_factory is None,
                reference,
                lengths,
                flat,
                k,
                between,
                variant,
                check_live_next_epoch,
                cut,
            )
            checked += 1
    return checked


def _first_items(loader: Any, epochs: int, most: int) -> tuple[list[list[Any]], bool]:
    """The epochs of an uninterrupted run up to ``most`` items in all, and whether the
    last one was cut (it had more)."""
    out: list[list[Any]] = []
    for _ in range(epochs):
        it = iter(loader)
        items = list(itertools.islice(it, most))
        more = len(items) == most and next(it, _END) is not _END
        _close(it)
        out.append(items)
        most -= len(items)
        if more:
            return out, True
        if most == 0:
            break
    return out, False


def _cut(reference: list[list[Any]], most: int) -> list[list[Any]]:
    out = []
    for epoch in reference:
        out.append(epoch[:most])
        most -= len(out[-1])
        if most == 0:
            break
    return out


def _take(loader: Any, count: int, cut: bool) -> list[Any]:
    """An ``iter(loader)``'s items: all of them, or the first ``count`` of a cut epoch
    (the iteration then abandoned)."""
    if not cut:
        return list(loader)
    it = iter(loader)
    items = list(itertools.islice(it, count))
    _close(it)
    return items


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


_END = object()


# -- internals ------------------------------------------------------------------------


class _LoopBodyError(Exception):
    """Raised inside the loop body by the ``"raise"`` variant."""


def _fail(message: str) -> NoReturn:
    raise ResumeMismatchError(message)


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b)
    except ResumeMismatchError:
        return False
    return True


def _loader_factory(factory: Callable[[], Any]) -> Callable[[], Any]:
    def make() -> Any:
        built = factory()
        if isinstance(built, SavableDataset):
            return SavableDataLoader(built, batch_size=None, worker_config=built.worker_config)
        if not (hasattr(built, "save_state_rank") and hasattr(built, "restore_state_rank")):
            raise LoaderUsageError(
                f"check_resume's factory returned a {type(built).__name__}, expected a SavableDataLoader or a "
                "SavableDataset"
            )
        return built

    return make


def _save_points(lengths: list[int], cut: bool = False) -> list[tuple[int, bool]]:
    """``(k, between)``: after ``k`` items; ``between``: after the epoch's StopIteration
    (``cut``: the last epoch has none)."""
    ends = set()
    acc = 0
    for i, n in enumerate(lengths):
        acc += n
        if not (cut and i == len(lengths) - 1):
            ends.add(acc)
    points = []
    for k in range(sum(lengths) + 1):
        points.append((k, False))
        if k in ends:
            points.append((k, True))
    return points


def expected_chunks(lengths: list[int], k: int, between: bool) -> list[int]:
    """Items each ``iter()`` of a loader restored at save point ``k`` yields.

    ``between``: the save came after the epoch's StopIteration (the restored loader
    starts the next epoch). Otherwise the save came while the iteration that yielded the
    ``k``-th item was live (or abandoned): the restored loader's first ``iter()`` yields
    that epoch's rest, possibly nothing, then the following epochs.
    """
    if k == 0 and not between:
        return list(lengths)
    acc = 0
    if between:  # after the StopIteration of the first epoch that ends at k (empty ones too)
        for e, n in enumerate(lengths):
            acc += n
            if acc == k:
                return list(lengths[e + 1 :])
        raise LoaderUsageError(f"no epoch ends at save point {k} (epoch lengths {lengths})")
    for e, n in enumerate(lengths):
        if acc < k <= acc + n or (n == 0 and acc == k and not between):
            return ([] if between else [acc + n - k]) + list(lengths[e + 1 :])
        acc += n
    raise LoaderUsageError(f"no epoch holds save point {k} (epoch lengths {lengths})")


def _where(lengths: list[int], i: int) -> str:
    """``epoch e, item j`` of the ``i``-th item (0-based) of the whole run."""
    acc = 0
    for e, n in enumerate(lengths):
        if i < acc + n:
            return f"epoch {e}, item {i - acc}"
        acc += n
    return f"after the last epoch, item {i - acc}"


def _point_name(lengths: list[int], k: int, between: bool, variant: str) -> str:
    if k == 0 and not between:
        return "save at step 0 (before the first item)"
    if between:
        return f"save at step {k} (between epochs, after {_where(lengths, k - 1).split(',')[0]})"
    return f"save at step {k} ({variant}, after {_where(lengths, k - 1)})"


def _check_point(
    factory: Callable[[], Any],
    restore_factory: Callable[[], Any],
    same_factory: bool,
    reference: list[list[Any]],
    lengths: list[int],
    flat: list[Any],
    k: int,
    between: bool,
    variant: str,
    check_live_next_epoch: bool,
    cut: bool = False,
) -> None:
    name = _point_name(lengths, k, between, variant)
    epochs = len(lengths)
    last = epochs - 1  # with ``cut``, the epoch compared only up to its length here
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
    if state is None:
        _fail(f"{name}: the run yielded {len(seen)} items, fewer than the uninterrupted one")
    _compare(seen, flat[:k], lengths, 0, f"{name}: the items before the save")
    again = loader.save_state_rank()
    if encode(again) != encode(state):
        _fail(f"{name}: saving twice without iterating gave different states")
    if stopped_in >= 0 and check_live_next_epoch and stopped_in + 1 < epochs:
        start = sum(lengths[: stopped_in + 1])
        _compare(
            _take(loader, lengths[stopped_in + 1], cut and stopped_in + 1 == last),
            reference[stopped_in + 1],
            lengths,
            start,
            f"{name}: the live loader's next iter() (epoch {stopped_in + 1})",
        )
    del live, loader
    data = encode(state)
    fresh = restore_factory()
    fresh.restore_state_rank(decode(data))
    after = fresh.save_state_rank()
    if after.position != state.position or (same_factory and encode(after) != data):
        _fail(f"{name}: the state saved right after the restore differs from the restored one")
    chunks = expected_chunks(lengths, k, between)
    got = [_take(fresh, c, cut and j == len(chunks) - 1) for j, c in enumerate(chunks)]
    flat_got = [x for c in got for x in c]
    _compare(flat_got, flat[k:], lengths, k, f"{name}: the resumed run")
    if [len(c) for c in got] != chunks:
        _fail(f"{name}: the resumed run's iter() calls yielded {[len(c) for c in got]} items, expected {chunks}")


def _compare(got: list[Any], want: list[Any], lengths: list[int], offset: int, what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        try:
            assert_same(a, b)
        except ResumeMismatchError as e:
            _fail(f"{what}: item {offset + i} ({_where(lengths, offset + i)}) differs: {e}")
    if len(got) != len(want):
        i = offset + min(len(got), len(want))
        _fail(
            f"{what}: {len(got)} items, expected {len(want)} (the first missing or extra one is item {i}, "
            f"{_where(lengths, i)})"
        )
