"""Cheap, always-on checks of the dataset contract's common mistakes, which would
otherwise give a wrong resume and no error.

- At the first ``save_state()`` of each class in a process (:func:`check_first_save`):
  a :class:`~savable_loader.SavableDataset` held in an attribute (or a list, tuple or
  dict in one) but not returned by ``children()`` is a
  :class:`~savable_loader.errors.DatasetContractError` (its state would be left out);
  a random generator held (up to :data:`RNG_DEPTH` steps away) but not listed in
  ``_savable_fields`` is a :class:`~savable_loader.errors.UnsavedRngWarning` (its
  draws would not resume).
- :func:`exclusive`: two live iterations of one pipeline object in one process (two
  loaders with ``num_workers=0`` over the same object) share its fields and would each
  save the other's position: the second is a
  :class:`~savable_loader.errors.LoaderUsageError`.

Each check costs a walk of one object's attributes, once per class and process.

Example::

    check_first_save(dataset, SavableDataset)   # raises or warns on the first call for type(dataset)
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from savable_loader.errors import (
    DatasetContractError,
    LoaderUsageError,
    UnsavedRngWarning,
)
from savable_loader.rng.owned import _children, _ClassInfo, _is_rng, _walkable

__all__ = ["RNG_DEPTH", "check_first_save", "exclusive", "release"]

#: Steps from a dataset to a random generator it holds (``self.aug.rng`` is two).
RNG_DEPTH = 3

_checked: set[type] = set()
_live: dict[int, tuple[int, weakref.ref[Any], Any]] = {}
_live_lock = threading.Lock()


def check_first_save(dataset: Any, base: type) -> None:
    """Check ``dataset``'s class the first time one of its objects is saved here (``base``
    is :class:`~savable_loader.SavableDataset`, passed in: its module imports this one)."""
    cls = type(dataset)
    if cls in _checked:
        return
    _check_children(dataset, base)  # raises: the class is checked again at its next save
    _checked.add(cls)
    _warn_unsaved_rngs(dataset)


def _check_children(dataset: Any, base: type) -> None:
    kids = {id(c) for c in dataset.children()}
    for path, value in _attributes(dataset, "self", depth=2):
        if isinstance(value, base) and value is not dataset and id(value) not in kids:
            name = type(dataset).__name__
            raise DatasetContractError(
                f"{name} holds the SavableDataset {type(value).__name__} in {path.replace('self', name, 1)} but "
                f"{name}.children() does not return it: its state would not be saved. Return every wrapped "
                "dataset from children() (sl.wrappers.BaseWrapperDataset returns self.dataset)"
            )


def _warn_unsaved_rngs(dataset: Any) -> None:
    saved = set(dataset._savable_fields)
    name = type(dataset).__name__
    for path, _gen in _generators(dataset):
        top = path.split(".", 1)[1].split("[", 1)[0].split(".", 1)[0]
        if top not in saved:
            warnings.warn(
                f"{name} holds a random generator in {path.replace('self', name, 1)}, but {top!r} is not in "
                f"{name}._savable_fields: its draws will not resume exactly. List {top!r} in _savable_fields "
                "(generators are saved with their state) or draw from the global RNGs, which the loader re-seeds "
                "for every item",
                UnsavedRngWarning,
                stacklevel=4,
            )


def _attributes(obj: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of attributes and their list/tuple/dict items, ``depth`` deep."""
    classes: dict[type, _ClassInfo] = {}
    frontier = [(path, obj)]
    for _ in range(depth):
        nxt = []
        for p, o in frontier:
            try:
                kids = list(_children(p, o, classes))
            except Exception:  # noqa: BLE001, S112 - an object resisting inspection is not checked
                continue
            for sub, child in kids:
                yield sub, child
                if isinstance(child, (list, tuple, dict)) and p == path:
                    nxt.append((sub, child))
        frontier = nxt


def _generators(dataset: Any) -> list[tuple[str, Any]]:
    """Generators held by ``dataset`` (not through another dataset, savable or a plain
    torch one a source adapts, nor its worker_config), breadth first, up to
    :data:`RNG_DEPTH` steps."""
    from torch.utils.data import Dataset

    classes: dict[type, _ClassInfo] = {}
    found = []
    seen = {id(dataset), id(getattr(dataset, "worker_config", None))}
    frontier = [("self", dataset)]
    for _ in range(RNG_DEPTH):
        nxt = []
        for p, o in frontier:
            try:
                kids = list(_children(p, o, classes))
            except Exception:  # noqa: BLE001, S112
                continue
            for sub, child in kids:
                if id(child) in seen:
                    continue
                seen.add(id(child))
                if _is_rng(child):
                    found.append((sub, child))
                elif _walkable(child) and not isinstance(child, Dataset):
                    nxt.append((sub, child))
        frontier = nxt
    return found


def exclusive(items: Iterator[Any], dataset: Any, owner: Any) -> Iterator[Any]:
    """``items`` (an iteration of ``dataset`` run by ``owner``), refused if another live
    owner iterates the same object in this process."""
    _claim(dataset, owner)
    try:
        yield from items
    finally:
        release(dataset, owner)


def release(dataset: Any, owner: Any) -> None:
    """``owner``'s iteration of ``dataset`` is over (ended, or abandoned by the loader)."""
    with _live_lock:
        entry = _live.get(id(dataset))
        if entry is not None and entry[1]() is owner:
            del _live[id(dataset)]


def _claim(dataset: Any, owner: Any) -> None:
    for attempt in range(2):
        with _live_lock:
            entry = _live.get(id(dataset))
            other = None if entry is None or entry[0] != os.getpid() or entry[2] is not dataset else entry[1]()
            if other is None or other is owner:
                _live[id(dataset)] = (os.getpid(), weakref.ref(owner), dataset)
                return
        if attempt == 0:
            gc.collect()  # an abandoned iteration kept by a reference cycle ends here
    raise LoaderUsageError(
        f"the pipeline object {type(dataset).__name__} (id {id(dataset):#x}) is already being iterated by another "
        "loader in this process: two loaders over one pipeline object share its fields and would save each "
        "other's position. Build one pipeline object per loader"
    )
