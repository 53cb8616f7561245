"""Which global random generators a loader re-seeds per sample: all three, or those declared.

By default the loader re-seeds Python's ``random``, NumPy's global RNG and torch's CPU
RNG before every sample (drop-in path: and before the collate function; pipelines: in
``mark_sample`` and before every item), about 5.5 µs a sample in all: Python's
``random.seed`` alone is about 3 µs, NumPy's about 1.3 µs, torch's about 1 µs. A dataset
that draws from fewer of them can say so: ``SavableDataLoader(..., global_rngs=("torch",))``,
or ``global_rngs=()`` for one that draws from none (a reader, a tokenizer). Then:

* the generators listed are re-seeded exactly as by default, with the same seeds: a
  dataset that draws only from them yields the same data with or without the setting;
* a non-empty setting always includes ``"torch"`` (the cheapest to re-seed, and most
  transforms draw from it); ``()`` re-seeds none;
* the generators left out are not re-seeded per sample, and the loader checks that
  nothing drew from them: a draw raises :class:`UndeclaredRngError` for that batch (the
  drop-in path) or item (pipelines), naming the generator and the setting that fixes
  it. They are put in a fixed state (``rng.formulas.undeclared_rngs_seed`` of ``(seed,
  epoch)``; NumPy's global ``RandomState`` then runs on a PCG64 of the loader's, whose
  state is cheap to read) before a batch or item when anything changed them
  (:meth:`GlobalRngs.begin`), so that code that reads a generator without drawing
  (``torch.initial_seed()``) or draws and puts its state back (``torch.random.fork_rng``)
  sees the same state in every worker and after every restore. In the main process the
  caller's streams are set aside around each batch or item, as by default
  (``rng.states.CallerStreams``). The check goes through each generator's public API
  (``rng.states.FixedStates``): NumPy's ``get_state()`` of the PCG64 (with the cached
  Gaussian), torch's ``get_state()`` (with its cached normals), and for Python's the next
  two doubles of the fixed state drawn and compared (a draw moves the position; reading
  ``getstate()`` would cost ten times as much).

Never silently inexact: a batch either drew only from re-seeded generators (exact, as
by default) or raised. Draws outside batches and items (a ``worker_init_fn``, the main
process between batches) are not the data's and are not checked; ``worker_init_fn``
re-seeding NumPy (the classic recipe) is harmless. The setting is recorded in states and
restore keys (``LoaderConfig.global_rngs``, ``RestoreKey.global_rngs``); a restore or a
key under another setting is refused: code that reads a left-out generator without
drawing sees its fixed state, not the per-sample seed, so another setting can give other
data without a draw to see.

Example::

    guard = GlobalRngs(("torch",))
    guard.begin(seed=0, epoch=3)      # numpy and random in their fixed state
    guard.seed(s)                     # before each sample: torch only
    guard.check("the batch at positions 0..63 of epoch 3")   # UndeclaredRngError if drawn

    guard = GlobalRngs(())
    guard.begin(seed=0, epoch=0)      # all three in their fixed state
    guard.check("item 7 of worker 0 in epoch 0", "in the pipeline")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from savable_loader.errors import LoaderUsageError, UndeclaredRngError
from savable_loader.rng.formulas import undeclared_rngs_seed
from savable_loader.rng.seeding import GLOBAL_RNG_NAMES, global_seeder
from savable_loader.rng.states import FixedStates

__all__ = ["GlobalRngs", "global_rngs_setting"]

#: How an error names each generator.
_SHOWN = {"numpy": "NumPy's global RNG (np.random)", "random": "Python's random module", "torch": "torch's CPU RNG"}


def global_rngs_setting(value: Any) -> tuple[str, ...]:
    """``SavableDataLoader(global_rngs=...)`` as recorded: the sorted names, ``"torch"``
    included in any non-empty setting; None means all three, an empty collection none.
    ``LoaderUsageError`` for anything else.

    >>> global_rngs_setting(["random"])
    ('random', 'torch')
    >>> global_rngs_setting(None)
    ('numpy', 'random', 'torch')
    >>> global_rngs_setting(())
    ()
    """
    if value is None:
        return GLOBAL_RNG_NAMES
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in names):
        raise LoaderUsageError(
            f"global_rngs must be a tuple of names from {GLOBAL_RNG_NAMES} (the global generators the "
            f"dataset draws from), got {value!r}"
        )
    unknown = sorted(set(names) - set(GLOBAL_RNG_NAMES))
    if unknown:
        raise LoaderUsageError(
            f"global_rngs names {unknown}, expected names from {GLOBAL_RNG_NAMES} ('random' is Python's "
            "random module, 'numpy' NumPy's global RNG, 'torch' torch's CPU RNG)"
        )
    return tuple(sorted({*names, "torch"})) if names else ()


class GlobalRngs:
    """Re-seeds the declared global generators per sample and guards the others (see the
    module docstring). Process-local: made in the process that loads.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.undeclared = tuple(n for n in GLOBAL_RNG_NAMES if n not in names)
        #: seeds the declared generators (as ``seed_global(s)`` seeds each)
        self.seed: Callable[[int], None] = global_seeder(names)
        #: the generators left out, in the fixed state of a seed
        self._fixed_states = FixedStates(self.undeclared)
        #: ``(seed, epoch)`` whose fixed state the generators left out are in, while
        #: nothing is known to have changed them (None: put it in again)
        self._fixed: tuple[int, int] | None = None
        self._seeds: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (seed, epoch) -> the fixed state's seed

    def begin(self, seed: int, epoch: int) -> None:
        """Before a batch or item: the generators left out in the fixed state of
        ``(seed, epoch)``, put in every time (cheaper than looking first, and the check
        after it draws from Python's)."""
        if not self.undeclared:
            return
        key = (seed, epoch)  # (put in every time: cheaper than looking, and the look draws)
        if self._seeds[0] != key:
            self._seeds = (key, undeclared_rngs_seed(seed, epoch))
        self._fixed_states.put(self._seeds[1])
        self._fixed = key

    def explain(self, error: BaseException, batch: str) -> None:
        """Raise :class:`UndeclaredRngError` (from ``error``) if ``error`` is NumPy's
        refusal to re-seed its global RNG while it is left out (it runs on the fixed
        state's PCG64 then, which ``np.random.seed`` cannot re-seed); else nothing."""
        if "numpy" in self.names or not isinstance(error, TypeError) or "re-seed a MT19937" not in str(error):
            return
        fix = tuple(sorted({*self.names, "numpy"}))
        raise UndeclaredRngError(
            f"{batch} called np.random.seed(), but the loader's global_rngs={self.names!r} does not list 'numpy': "
            "NumPy's global RNG is held in a fixed state of the loader's while a sample is made, and its draws would "
            f"not resume exactly. Pass global_rngs={fix!r} (the loader then re-seeds it before every sample, and "
            "the dataset need not)"
        ) from error

    def check(self, batch: str | Callable[[], str], where: str = "in the dataset or the collate function") -> None:
        """After a batch or item: ``UndeclaredRngError`` if it drew from a generator left
        out (``batch`` and ``where`` say what drew, for the message; ``batch`` may be a
        function making the text, called only for an error)."""
        if self._fixed is None:
            return
        drawn = self._fixed_states.changed()
        if not drawn:
            return
        self._fixed = None
        if callable(batch):
            batch = batch()
        fix = tuple(sorted({*self.names, *drawn, "torch"}))
        raise UndeclaredRngError(
            f"{batch} drew from {' and '.join(_SHOWN[n] for n in drawn)} ({where}), but the loader's global_rngs={self.names!r} does not list {', '.join(map(repr, drawn))}: "
            f"the loader did not re-seed it, so these draws would not resume exactly. Pass global_rngs={fix!r} "
            "(or leave global_rngs out: all three are re-seeded before every sample)"
        )
