"""The checks both engines make when a state is restored or a restore key is rebuilt:
settings recorded in a state or a key against the loader's own.

Each raises :class:`~savable_loader.errors.ConfigMismatchError` (a state),
:class:`~savable_loader.errors.StateError` (a state of another seed formula or epoch order
than this version's: :func:`check_state_formulas`) or
:class:`~savable_loader.errors.RestoreKeyError` (a key) naming the field, the value found
and the value expected.

Example::

    check_batch_size(saved=64, current=32)          # fine: 32 divides 64
    check_key_setting("reseed", "batch", "sample")  # RestoreKeyError naming both
    check_state_formulas(state.config)              # StateError if seed_formula is not 3
"""

from __future__ import annotations

from typing import Any

from savable_loader.errors import ConfigMismatchError, RestoreKeyError, StateError
from savable_loader.rng.seeding import SEED_FORMULA
from savable_loader.state.schema import ORDER_ALGORITHM, LoaderConfig, RestoreKey

__all__ = [
    "check_batch_size",
    "check_global_rngs",
    "check_key_global_rngs",
    "check_key_int",
    "check_key_order",
    "check_key_seed_formula",
    "check_key_setting",
    "check_state_formulas",
]

#: What a state or key of another seed formula or epoch order than this version's is.
_UNRELEASED = "an unreleased version of savable-loader"


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


def check_state_formulas(config: LoaderConfig) -> None:
    """StateError naming the field, the value found and the value expected if a state
    records another per-item seed formula (``rng.SEED_FORMULA``) or epoch order
    (``state.schema.ORDER_ALGORITHM``) than the one this version has: such a state (the
    defaults of one written before the fields existed included) was written by an
    unreleased version, whose streams this version does not reproduce."""
    for name, found, expected, what in (
        ("seed_formula", config.seed_formula, SEED_FORMULA, "per-item seed formula"),
        ("order_algorithm", config.order_algorithm, ORDER_ALGORITHM, "epoch order"),
    ):
        if type(found) is not type(expected) or found != expected:
            raise StateError(
                f"config.{name} is {found!r}, expected {expected!r}: the state was written by {_UNRELEASED} "
                f"with another {what}, whose stream this version cannot continue exactly; resume it with the "
                "version that wrote it, or start the data afresh"
            )


def check_key_seed_formula(key: RestoreKey) -> None:
    """RestoreKeyError naming the field, the value found and the value expected unless
    ``key`` records this version's seed formula (a key without one was made before the
    field existed)."""
    _check_key_made_here("seed_formula", key.seed_formula, SEED_FORMULA, "per-item seed formula")


def check_key_order(key: RestoreKey) -> None:
    """RestoreKeyError naming the field, the value found and the value expected unless an
    ``"index"`` key of the loader's own order names this version's epoch order."""
    _check_key_made_here("order_algorithm", key.order_algorithm, ORDER_ALGORITHM, "epoch order")


def _check_key_made_here(name: str, found: Any, expected: Any, what: str) -> None:
    if type(found) is not type(expected) or found != expected:
        made = "before the field existed" if found is None else f"with another {what}"
        raise RestoreKeyError(
            f"key.{name} is {found!r}, expected {expected!r}: the key was made by {_UNRELEASED} {made}, "
            "whose samples this version cannot rebuild exactly"
        )


def check_key_int(name: str, value: Any, low: int = 0) -> None:
    """RestoreKeyError unless a key field is an int >= ``low`` (a key built in Python is
    not validated as a parsed one is)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RestoreKeyError(f"key.{name} is {value!r}, expected an int >= {low}")
