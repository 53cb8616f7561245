"""The three global random generators, reached through their public APIs only.

Python's ``random``, NumPy's legacy global ``RandomState`` (behind ``np.random.rand``
and friends) and torch's CPU generator are process-wide. The loader re-seeds them per
sample, holds the ones ``global_rngs=`` leaves out in a fixed state, and, when it loads
in the caller's process (``num_workers=0``), keeps the caller's own streams out of the
way. Everything here goes through what each library documents:

* torch: ``torch.default_generator.get_state()`` / ``set_state()`` (about 1 µs each);
* Python: ``random.getstate()`` / ``setstate()`` (``getstate`` about 9 µs: it builds 625
  integers; ``setstate`` about 3), seeding through the C base class's ``seed`` (skips
  ``Random.seed``'s Python-level checks). Between two blocks the caller's state is read
  by drawing, not by ``getstate`` (:func:`caller_python_state`): the state put back last
  and its next two 32-bit outputs are kept; two draws equal to those say the caller did
  not draw since, and otherwise the state before the draws is worked out from the one
  after them;
* NumPy: ``np.random.get_bit_generator()`` / ``set_bit_generator()`` (NumPy >= 1.25):
  the caller's bit generator is **set aside**, not copied, and the loader draws from a
  bit generator of its own meanwhile. Reading a Mersenne Twister's state through
  NumPy's API costs about 25 µs, swapping bit generators well under 1 µs. A swap starts
  the legacy ``RandomState`` with no cached Gaussian (``np.random.randn`` makes them in
  pairs and keeps the second): the caller's cached one, if any, is dropped when the
  loader loads in its process. This is the same at every ``next()`` of an
  uninterrupted and of a resumed run, so a resumed training loop still draws exactly
  what the uninterrupted one drew; only the comparison with a run without the loader
  shows it (``docs/concepts.md``, "The caller's random streams").

No library's memory is read or written, and nothing here depends on a torch, NumPy or
CPython release beyond those APIs.

Example::

    with CallerStreams():          # the caller's three streams set aside
        seed_global(s)             # the loader's own draws
    # the caller's streams are as they were (NumPy's cached Gaussian aside)
"""

from __future__ import annotations

import _random
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from savable_loader.errors import InternalError

__all__ = [
    "C_RANDOM_SEED",
    "NUMPY_GLOBAL",
    "PY_RANDOM",
    "CallerStreams",
    "FixedStates",
    "loader_bit_generator",
    "look_numpy",
]

#: The hidden ``random.Random`` behind Python's module-level random functions.
PY_RANDOM: random.Random = random.random.__self__  # type: ignore[attr-defined]
#: The legacy ``RandomState`` behind NumPy's module-level random functions.
NUMPY_GLOBAL: np.random.RandomState = np.random.random_sample.__self__  # type: ignore[attr-defined]
#: ``seed`` of ``random.Random``'s C base class: the same seeding, without ``Random.seed``'s
#: Python-level argument checks (about 0.5 µs less; the seeding itself costs several µs).
C_RANDOM_SEED: Callable[..., None] = _random.Random.seed
#: ``getstate``/``setstate`` of that C base class: the words and position (``random.Random``'s
#: own add its version and ``gauss_next``, handled beside them here).
_PY_GETSTATE: Callable[[random.Random], Any] = _random.Random.getstate
_PY_SETSTATE: Callable[[random.Random, Any], None] = _random.Random.setstate

_TORCH = torch.default_generator
_MASK64 = (1 << 64) - 1
try:
    _get_bit_generator: Callable[[], Any] = np.random.get_bit_generator  # type: ignore[attr-defined]
    _set_bit_generator: Callable[[Any], None] = np.random.set_bit_generator  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - NumPy < 1.25 (pyproject.toml asks for 1.25)
    raise ImportError(
        f"savable_loader needs NumPy >= 1.25 (np.random.get_bit_generator), found NumPy {np.__version__}"
    ) from None

#: The bit generators the loader swaps into NumPy's global ``RandomState`` while it loads
#: in the caller's process, one per nesting depth (made on first use), and the depth now.
_LOADER_MT: list[np.random.MT19937] = []
_DEPTH = [0]


def loader_bit_generator(depth: int = 0) -> np.random.MT19937:
    """This process's Mersenne Twister that NumPy's global functions draw from inside a
    :class:`CallerStreams` block nested ``depth`` deep (re-seeded by ``np.random.seed`` as
    the caller's would be, so the draws are those of a worker process)."""
    while len(_LOADER_MT) <= depth:
        _LOADER_MT.append(np.random.MT19937(len(_LOADER_MT)))
    return _LOADER_MT[depth]


# -- the caller's Python stream, read by drawing --------------------------------------

#: The caller's Python state put back last by an outermost :class:`CallerStreams` block,
#: and the next two 32-bit outputs a generator in that state gives (None: nothing kept).
_KEPT: list[Any] = [None, 0, 0]
_HELPER = random.Random()
_N = 624  # words of the Mersenne Twister's state
_UPPER, _LOWER, _MATRIX_A = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x9908B0DF)


def _untwist(words: tuple[int, ...]) -> tuple[int, ...]:
    """The words of the Mersenne Twister's state before the twist that made ``words``.

    The twist makes each new word from old words ``k``, ``k + 1`` and ``k + 397``
    (new words where those were replaced already, as CPython's twist runs in place), so
    it can be run backwards: all of the old words come back except the low 31 bits of
    word 0, which the twist never reads (it takes that word's top bit) and no draw after
    it outputs; they come back as 0, which is what ``seed()`` leaves there."""
    new = np.array(words, dtype=np.uint32)

    def before(z: np.ndarray) -> np.ndarray:
        # z = (y >> 1) ^ (MATRIX_A if y is odd): the top bit of z is y's low bit
        odd = z >> np.uint32(31)
        return ((z ^ (odd * _MATRIX_A)) << np.uint32(1)) | odd

    y = np.empty(_N, dtype=np.uint32)  # y[k] = (old[k] & UPPER) | (old[k + 1] & LOWER)
    y[227:] = before(new[227:] ^ new[: _N - 227])  # words 227.. read new words 0..396
    old = np.zeros(_N, dtype=np.uint32)
    old[228:] = (y[228:] & _UPPER) | (y[227:-1] & _LOWER)
    y[:227] = before(new[:227] ^ old[397:])  # words 0..226 read old words 397..623
    old[1:228] = (y[1:228] & _UPPER) | (y[:227] & _LOWER)
    old[0] = y[0] & _UPPER
    return tuple(old.tolist())


def _before_draws(after: tuple[int, ...], drawn: int) -> tuple[int, ...]:
    """The state (``getstate`` of the C base class: 624 words and the position) of a
    Python generator ``drawn`` 32-bit outputs before state ``after``.

    Without a twist among the draws the words are the same and the position ``drawn``
    lower. A position of ``drawn`` or less after them means a twist came first (a
    position of 0, which only ``setstate`` makes, gives the same outputs as the position
    at the end of the untwisted words: both output the twisted words next)."""
    position = after[_N]
    if position > drawn:
        return (*after[:_N], position - drawn)
    return (*_untwist(after[:_N]), _N - (drawn - position))


def caller_python_state() -> Any:
    """The state of Python's global generator as the caller left it, read between two
    outermost blocks: when the state put back last is kept, by drawing two 32-bit
    outputs and comparing them with its own (equal: the caller did not draw; the
    chance that a moved stream gives the same 64 bits is 2**-64), else by ``getstate``
    and stepping back over the draws. About 0.2 µs when the caller did not draw, against
    about 9 µs for ``getstate``. The draws move the generator: the block puts a state
    back at its end in any case."""
    kept, first, second = _KEPT
    if kept is None:
        return _PY_GETSTATE(PY_RANDOM)
    if PY_RANDOM.getrandbits(32) != first:
        return _before_draws(_PY_GETSTATE(PY_RANDOM), 1)
    if PY_RANDOM.getrandbits(32) != second:
        return _before_draws(_PY_GETSTATE(PY_RANDOM), 2)
    return kept


def _keep(state: Any) -> None:
    """Keep ``state`` (just put back by an outermost block) and its next two outputs."""
    if _KEPT[0] is not state:
        _PY_SETSTATE(_HELPER, state)
        _KEPT[:] = [state, _HELPER.getrandbits(32), _HELPER.getrandbits(32)]


class CallerStreams:
    """Set the caller's three global streams aside for a block, and put them back after
    it: torch's and Python's states are copied (``get_state``; Python's read by
    :func:`caller_python_state` for an outermost block, ``getstate`` inside another),
    NumPy's bit generator is swapped for :func:`loader_bit_generator` (see the module
    docstring for its cached Gaussian). A class (not a generator function): the loader
    enters one per ``next()`` when it loads in the caller's process. A block inside a
    block sets the outer block's streams aside in the same way (another bit generator of
    the loader's).

    Example::

        with CallerStreams():
            random.seed(0); np.random.seed(0); torch.manual_seed(0)
        # the caller's streams go on where they were
    """

    __slots__ = ("_gauss", "_numpy", "_python", "_torch")

    def __enter__(self) -> None:
        depth = _DEPTH[0]
        # (what random.getstate() returns beside its version; read by drawing when outermost)
        self._python = caller_python_state() if depth == 0 else _PY_GETSTATE(PY_RANDOM)
        self._gauss = PY_RANDOM.gauss_next  # type: ignore[attr-defined]
        self._torch = _TORCH.get_state()
        self._numpy = _get_bit_generator()
        _set_bit_generator(_LOADER_MT[depth] if depth < len(_LOADER_MT) else loader_bit_generator(depth))
        _DEPTH[0] = depth + 1

    def __exit__(self, *exc: object) -> None:
        depth = _DEPTH[0] = _DEPTH[0] - 1
        _PY_SETSTATE(PY_RANDOM, self._python)
        PY_RANDOM.gauss_next = self._gauss  # type: ignore[attr-defined]
        _TORCH.set_state(self._torch)
        _set_bit_generator(self._numpy)
        if depth == 0:
            _keep(self._python)


# -- looking at a generator ----------------------------------------------------------


def look_numpy(fixed: Any = None) -> Any:
    """The state of the bit generator NumPy's global ``RandomState`` runs on while that is
    ``fixed`` (the PCG64 of :class:`FixedStates`, about 1 µs), else which one it runs on
    (another bit generator swapped in is a change)."""
    bit = _get_bit_generator()
    if bit is not fixed:
        return False, id(bit)
    return True, bit.state


# -- the fixed state of the generators global_rngs= leaves out ---------------------------


class FixedStates:
    """Puts the global generators ``names`` (of ``"numpy"``, ``"random"``, ``"torch"``) in
    the fixed state of a seed, and tells whether anything drew from them since.

    * torch's CPU generator: the state ``manual_seed(seed)`` gives, put back with
      ``set_state``; the check compares ``get_state()``'s bytes (cached normals included).
    * Python's ``random``: the state ``seed(seed)`` then one 32-bit draw gives, put back
      with ``setstate``; the check draws the next two doubles and compares them with the
      fixed state's (and ``gauss_next`` with None). Any draw moves the position, after
      which the next two outputs of a Mersenne Twister differ from these (a 106-bit
      coincidence); reading the state (``getstate``, 625 integers) would cost ten times
      as much. The check draws, so :meth:`put` comes before every use.
    * NumPy's global ``RandomState``: given a PCG64 of this object's in the state the seed
      makes (a Mersenne Twister's state costs about 25 µs to read through NumPy's API, a
      PCG64's about 1 µs); the check compares the PCG64's state, and that the
      ``RandomState`` still runs on it. (The swap empties the cached Gaussian, so a
      Gaussian taken during an item was made from the PCG64, which moved it.)

    Code that reads a generator without drawing (``torch.initial_seed``,
    ``torch.random.fork_rng``, ``np.random.get_state``) sees the same state in every worker
    and after every restore.

    Example::

        fixed = FixedStates(("numpy", "random"))
        fixed.put(1234)          # both in the fixed state of seed 1234
        ...                      # an item that must not draw from them
        fixed.changed()          # ["random"] if it drew from Python's random
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._python, self._numpy, self._torch = "random" in names, "numpy" in names, "torch" in names
        self._seed: int | None = None
        self._python_state: Any = None
        self._python_next: tuple[float, float] = (0.0, 0.0)
        self._bit: np.random.PCG64 | None = None
        self._bit_state: Any = None
        self._numpy_look: Any = None
        self._torch_state: torch.Tensor | None = None
        self._torch_bytes = b""

    def put(self, seed: int) -> None:
        """Put the generators in the fixed state of ``seed`` (made once per seed)."""
        seed &= _MASK64
        if seed != self._seed:
            self._make(seed)
        if self._python:
            _PY_SETSTATE(PY_RANDOM, self._python_state)
            PY_RANDOM.gauss_next = None  # type: ignore[attr-defined]
        if self._torch:
            _TORCH.set_state(self._torch_state)  # type: ignore[arg-type]
        if self._numpy:
            bit = self._bit
            if bit is None:  # pragma: no cover - made with the seed
                raise InternalError("FixedStates lost its bit generator")
            bit.state = self._bit_state  # (about 1 µs: anything may have drawn from it since)
            _set_bit_generator(bit)  # (which also empties the cached Gaussian)

    def _make(self, seed: int) -> None:
        if self._python:
            gen = random.Random()
            C_RANDOM_SEED(gen, seed)
            gen.getrandbits(32)  # (the next draws then need no new block of words)
            self._python_state = _PY_GETSTATE(gen)
            self._python_next = (gen.random(), gen.random())
        if self._torch:
            self._torch_state = torch.Generator().manual_seed(seed).get_state()
            self._torch_bytes = self._torch_state.numpy().tobytes()
        if self._numpy:
            self._bit = np.random.PCG64(seed)
            self._bit_state = self._bit.state
            held = _get_bit_generator()
            _set_bit_generator(self._bit)
            self._numpy_look = look_numpy(self._bit)
            _set_bit_generator(held)
        self._seed = seed

    def changed(self) -> list[str]:
        """The names of the generators drawn from (or otherwise moved) since the last
        :meth:`put`, sorted. Draws from Python's generator to tell."""
        if self._seed is None:
            raise InternalError("FixedStates.changed before put")
        changed = []
        if self._numpy and look_numpy(self._bit) != self._numpy_look:
            changed.append("numpy")
        if self._python and (
            PY_RANDOM.gauss_next is not None  # type: ignore[attr-defined]
            or (PY_RANDOM.random(), PY_RANDOM.random()) != self._python_next
        ):
            changed.append("random")
        if self._torch and _TORCH.get_state().numpy().tobytes() != self._torch_bytes:
            changed.append("torch")
        return changed
