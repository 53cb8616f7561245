"""The checks both engines make when a state is restored or a restore key is rebuilt:
settings recorded in a state or a key against the loader's own.

Each raises :class:`~savable_loader.errors.ConfigMismatchError` (a state) or
:class:`~savable_loader.errors.RestoreKeyError` (a key) naming the field, the value found
and the value expected.

Example::

    check_batch_size(saved=64, current=32)          # fine: 32 divides 64
    check_key_setting("reseed", "batch", "sample")  # RestoreKeyError naming both
"""

from __future__ import annotations

from typing import Any

from savable_loader.errors import ConfigMismatchError, RestoreKeyError
from savable_loader.rng.seeding import SEED_FORMULAS
from savable_loader.state.schema import LoaderConfig, RestoreKey

__all__ = [
    "check_batch_size",
    "check_global_rngs",
    "check_key_global_rngs",
    "check_key_int",
    "check_key_setting",
    "key_seed_formula",
]


def check_batch_size(saved: int | None, current: int | None) -> None:
    """A restore may keep the batch size or divide it (drop-in: the same sample order)."""
    if saved == current:
        return
    if saved is None or current is None or current > saved or saved % current:
        raise ConfigMismatchError(
            "batch_size", saved, current, "a restore may keep the batch size or use one that divides it"
        )


def check_key_setting(name: str, in_key: Any, current: Any, hint: str = "") -> None:
    """RestoreKeyError naming the setting and both values if a key (made after the setting
    was recorded: ``in_key`` is not None) was made under another one."""
    if in_key is not None and in_key != current:
        raise RestoreKeyError(
            f"key.{name} is {in_key!r}, this loader's {name} is {current!r}: the key names data of a loader "
            f"built with another {name}{f' ({hint})' if hint else ''}"
        )


def check_global_rngs(saved: LoaderConfig, current: LoaderConfig) -> None:
    """ConfigMismatchError if the state was saved by a loader re-seeding other global RNGs
    (``SavableDataLoader(global_rngs=...)``): a generator left out is not re-seeded but
    held in a fixed state, which code that reads it (``torch.initial_seed()``) or draws
    and puts it back (``torch.random.fork_rng``) sees without the per-item check seeing
    a draw, so another setting can give other data."""
    recorded: Any = saved.global_rngs  # a list of names, or what a hostile state holds
    found = tuple(recorded) if isinstance(recorded, (list, tuple)) else recorded
    if found != tuple(current.global_rngs):
        raise ConfigMismatchError(
            "global_rngs",
            found,
            tuple(current.global_rngs),
            f"the state was saved by a loader that re-seeds other global RNGs: build the loader with global_rngs={found!r}",
        )


def check_key_global_rngs(key: RestoreKey, names: tuple[str, ...]) -> None:
    """RestoreKeyError if ``key`` was made by a loader re-seeding other global RNGs than
    ``names`` (see :func:`check_global_rngs`)."""
    in_key = key.global_rngs
    check_key_setting(
        "global_rngs",
        tuple(in_key) if isinstance(in_key, (list, tuple)) else in_key,
        names,
        "it re-seeds other global RNGs before each sample",
    )


def key_seed_formula(key: RestoreKey, current: int) -> int:
    """The seed formula ``key``'s sample is rebuilt under: the key's own (RestoreKeyError
    naming the field if it is not one this version knows). A key made before
    ``RestoreKey.seed_formula`` existed is rebuilt as earlier versions rebuilt it: under
    the loader's formula ``current`` if that is 1 or 2 (a loader restored from such a
    state), else 2 (the formula every earlier fresh loader used)."""
    found = key.seed_formula
    if found is None:
        return min(current, 2)
    if type(found) is not int or found not in SEED_FORMULAS:
        raise RestoreKeyError(
            f"key.seed_formula is {found!r}, expected one of {list(SEED_FORMULAS)} (or absent: a key made before "
            "the field existed, formula 2); a newer savable-loader may know it"
        )
    return found


def check_key_int(name: str, value: Any, low: int = 0) -> None:
    """RestoreKeyError unless a key field is an int >= ``low`` (a key built in Python is
    not validated as a parsed one is)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RestoreKeyError(f"key.{name} is {value!r}, expected an int >= {low}")
