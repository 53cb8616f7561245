"""savable_loader: a checkpointable, multiprocess drop-in for torch.utils.data.DataLoader.

Saving costs microseconds, restoring continues the interrupted epoch bit for bit (worker
RNG included), on every data-parallel rank.

Example::

    import savable_loader as sl

    loader = sl.SavableDataLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=4)
    for batch in loader:
        ...
        sl.state.save_file("loader.state", loader.save_state_rank())

    loader = sl.SavableDataLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=4)
    loader.restore_state_rank(sl.state.load_file("loader.state"))

The top level holds what a user types: the loader, ``SavableDataset``, ``WorkerConfig``,
the base error and the errors users catch (``ConfigMismatchError``, ``DataError``,
``LoaderUsageError``, ``StateError``, ``WorkerError``) and the public packages. Every other
name lives in its package: each exception in ``savable_loader.errors``, ``RestoreKey`` and
the state schema in ``savable_loader.state``.

Names are imported lazily, so ``savable_loader.state`` (and ``python -m savable_loader
inspect``) work without importing torch. When torch is already imported, the loader class
is created at once: frameworks that record the arguments of ``DataLoader`` subclasses
(Lightning patches the ``__init__`` of every subclass that exists when it asks for a
loader) then record the user's own call, not the loader's internal one.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from savable_loader._version import __version__

__all__ = [
    "ConfigMismatchError",
    "DataError",
    "LoaderUsageError",
    "SavableDataLoader",
    "SavableDataset",
    "SavableLoaderError",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "__version__",
    "errors",
    "rng",
    "sources",
    "state",
    "stats",
    "storage",
    "testing",
    "wrappers",
]

_LAZY = {
    "ConfigMismatchError": "savable_loader.errors",
    "DataError": "savable_loader.errors",
    "LoaderUsageError": "savable_loader.errors",
    "SavableDataLoader": "savable_loader.loader.dataloader",
    "SavableDataset": "savable_loader.dataset.base",
    "SavableLoaderError": "savable_loader.errors",
    "StateError": "savable_loader.errors",
    "WorkerConfig": "savable_loader.config",
    "WorkerError": "savable_loader.errors",
}
_SUBMODULES = {"errors", "rng", "sources", "state", "stats", "storage", "testing", "wrappers"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"savable_loader.{name}")
    else:
        raise AttributeError(f"module 'savable_loader' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if "torch" in sys.modules:
    __getattr__("SavableDataLoader")


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from savable_loader import errors, rng, sources, state, stats, storage, testing, wrappers
    from savable_loader.config import WorkerConfig
    from savable_loader.dataset.base import SavableDataset
    from savable_loader.errors import (
        ConfigMismatchError,
        DataError,
        LoaderUsageError,
        SavableLoaderError,
        StateError,
        WorkerError,
    )
    from savable_loader.loader.dataloader import SavableDataLoader
