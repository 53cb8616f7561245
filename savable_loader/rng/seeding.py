"""Random number generators: derive seeds from counters, capture and restore states.

Two ways keep random augmentations exact across a save and a restore:

* **derive from a counter** -- before producing sample ``i`` the loader re-seeds Python's
  ``random``, NumPy's global RNG and torch's CPU RNG from ``counter_seed(base, i)``,
  where ``base = derive_seed(seed, ...)`` is computed once per epoch or batch.
  The RNG state at any sample is then a function of its position and needs no snapshot.
* **capture / restore** -- :func:`capture_global` and :func:`restore_global` save and put
  back the three global RNGs (used to leave the caller's streams untouched when loading
  runs in the main process), and :func:`capture_generator` / :func:`restore_generator`
  turn a generator object held by a dataset into plain values for its state.

Example::

    seed = derive_seed(0, "sample", epoch, position)
    with preserve_global_rng():
        seed_global(seed)
        x = augment(sample)        # draws from random / numpy / torch
    # the caller's global RNG streams are as they were
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from savable_loader.errors import StateError
from savable_loader.rng.states import C_RANDOM_SEED, PY_RANDOM, CallerStreams

__all__ = [
    "GLOBAL_RNG_NAMES",
    "SEED_FORMULA",
    "GlobalRngState",
    "capture_generator",
    "capture_global",
    "counter_seed",
    "counter_seeds",
    "derive_seed",
    "global_seeder",
    "hash_seed",
    "item_seed",
    "numpy_word",
    "preserve_global_rng",
    "restore_generator",
    "restore_global",
    "seed_global",
]

_MASK64 = (1 << 64) - 1
_blake2b = hashlib.blake2b


def derive_seed(*parts: int | str) -> int:
    """A 64-bit seed that depends on every part (ints and strings), stable across runs.

    Example::

        derive_seed(0, "sample", 3, 17) != derive_seed(0, "sample", 3, 18)
    """
    return hash_seed("\x1f".join(str(p) for p in parts).encode())


def hash_seed(data: bytes) -> int:
    """The 64-bit seed :func:`derive_seed` makes of its parts joined with ``"\\x1f"``, as
    bytes (BLAKE2b, 8 bytes, little-endian): for a caller that keeps a joined prefix.

    Example::

        hash_seed(b"0\\x1fsample\\x1f3") == derive_seed(0, "sample", 3)
    """
    return int.from_bytes(_blake2b(data, digest_size=8).digest(), "little")


_GOLDEN = 0x9E3779B97F4A7C15


def counter_seed(base: int, counter: int) -> int:
    """A 64-bit seed for step ``counter`` of a stream whose seed is ``base`` (fast).

    SplitMix64 of ``base + (counter + 1) * golden ratio``: integer arithmetic only (about
    0.3 µs, where :func:`derive_seed` hashes a string in about 2.5 µs), identical in every
    process and run. Use it for per-sample seeds, with ``base`` from :func:`derive_seed`.

    Example::

        base = derive_seed(0, "sample", epoch)
        seed_global(counter_seed(base, position))
    """
    z = (base + (counter + 1) * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


_U64 = np.uint64
#: Below this many counters :func:`counter_seeds` loops in Python (NumPy's fixed cost
#: is larger than the loop's).
_VECTOR_FROM = 16


def counter_seeds(base: int, counters: Sequence[int], mask: int = _MASK64) -> list[int]:
    """``[counter_seed(base, c) & mask for c in counters]``, a batch at a time: NumPy's
    ``uint64`` arithmetic wraps modulo ``2**64`` as the masks of :func:`counter_seed` do,
    so the values are the same (about 0.15 µs a seed for a batch of 64, where a call per
    seed costs about 0.3 µs). Counters are ints in ``[0, 2**64)``.

    Example::

        counter_seeds(base, [3, 5]) == [counter_seed(base, 3), counter_seed(base, 5)]
    """
    if len(counters) < _VECTOR_FROM:
        return [counter_seed(base, c) & mask for c in counters]
    z = _U64(base) + (np.array(counters, dtype=_U64) + _U64(1)) * _U64(_GOLDEN)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    z ^= z >> _U64(31)
    if mask != _MASK64:
        z &= _U64(mask)
    out: list[int] = z.tolist()
    return out


#: The per-item seed formula every state and restore key records
#: (``LoaderConfig.seed_formula``, ``RestoreKey.seed_formula``), the only one this version
#: has: per-item seeds below ``2**63`` (:func:`item_seed`, so that ``torch.initial_seed()``
#: read inside a worker fits in an int64, as torch's own worker seeds do), and NumPy's
#: global RNG seeded from :func:`numpy_word`, a word independent of the low 32 bits torch's
#: CPU generator uses.
SEED_FORMULA = 3
_MASK63 = (1 << 63) - 1


def item_seed(seed: int) -> int:
    """A per-item seed (from :func:`counter_seed` or :func:`derive_seed`) below ``2**63``.

    Example::

        seed_global(item_seed(counter_seed(base, position)))   # torch.initial_seed() < 2**63
    """
    return seed & _MASK63


def numpy_word(seed: int) -> int:
    """The 32-bit seed NumPy's global RNG gets from the 64-bit ``seed``.

    torch's CPU generator seeds its Mersenne Twister from the low 32 bits of a seed
    (``init_genrand``), exactly as NumPy's legacy ``np.random.seed`` does with a 32-bit
    word: giving NumPy ``seed & 0xFFFFFFFF`` would make NumPy's global stream torch's,
    shifted by one draw (a NumPy crop offset and a torch flip correlated). NumPy gets the
    high word of ``seed * 0x9E3779B97F4A7C15 mod 2**64`` instead (Fibonacci hashing: one
    multiply and a shift, a few ns). The product's high word depends on all 64 bits of the
    seed (its own high word times an odd constant plus the carry of the low word), so for
    per-item seeds, which are hash outputs, it is unrelated to the low word torch uses; a
    plain ``seed >> 32`` would be too, but would give NumPy the same state for every seed
    below ``2**32``.

    Example::

        numpy_word(123456789123) == ((123456789123 * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 32
    """
    return (((seed & _MASK64) * _GOLDEN) & _MASK64) >> 32


# Python's module-level random functions are bound methods of one hidden instance; seeding
# it through the C method skips Random.seed's Python-level argument checks (~0.5 µs).
_PY_RANDOM: random.Random = PY_RANDOM
_PY_SEED = C_RANDOM_SEED
_NP_SEED = np.random.seed
_TORCH_SEED = torch.default_generator.manual_seed


def _seed_all(seed: int) -> None:
    """:func:`seed_global` (:func:`numpy_word` inlined)."""
    seed &= _MASK64
    _PY_SEED(_PY_RANDOM, seed)
    _PY_RANDOM.gauss_next = None  # type: ignore[attr-defined]
    _NP_SEED(((seed * _GOLDEN) & _MASK64) >> 32)
    _TORCH_SEED(seed)


def seed_global(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch's CPU RNG from one seed.

    Equivalent to ``random.seed(s); np.random.seed(numpy_word(s));
    torch.default_generator.manual_seed(s)`` with ``s = seed & (2**64 - 1)``: NumPy gets a
    word independent of the low word torch's Mersenne Twister is seeded from
    (:func:`numpy_word`), so the two draw unrelated streams. Uses
    ``torch.default_generator.manual_seed`` (about 1 µs) rather than ``torch.manual_seed``,
    which also seeds every accelerator (about 100 µs). About 7.5 µs in all, most of it
    Python's Mersenne Twister initialisation. Hot paths take :func:`global_seeder`'s
    function once instead.

    Example::

        seed_global(s)     # np.random and torch draw unrelated streams
    """
    _seed_all(seed)


#: The global generators by the name of the module they are drawn through, sorted.
GLOBAL_RNG_NAMES = ("numpy", "random", "torch")


def global_seeder(names: Collection[str]) -> Callable[[int], None]:
    """A function seeding the global generators in ``names`` (of :data:`GLOBAL_RNG_NAMES`)
    exactly as :func:`seed_global` seeds each of them, and leaving the others alone. The
    function is specialised to the names (no per-call branching): take it once, call it
    per sample.

    Example::

        seed_torch = global_seeder(("torch",))
        seed_torch(s)     # torch.default_generator.manual_seed(s & (2**64 - 1)), nothing else
        seed_all = global_seeder(GLOBAL_RNG_NAMES)   # seed_global, per call
    """
    if names == GLOBAL_RNG_NAMES:  # per batch: fast
        return _seed_all
    unknown = set(names) - set(GLOBAL_RNG_NAMES)
    if unknown:
        raise ValueError(f"unknown global generators {sorted(unknown)}, expected names of {GLOBAL_RNG_NAMES}")
    if set(names) == set(GLOBAL_RNG_NAMES):
        return _seed_all
    if names and set(names) == {"torch"}:  # the common declaration: one call

        def seed_torch(seed: int) -> None:
            _TORCH_SEED(seed & _MASK64)

        return seed_torch
    python, numpy, torch_ = "random" in names, "numpy" in names, "torch" in names

    def seed_some(seed: int) -> None:
        seed &= _MASK64
        if python:
            _PY_SEED(_PY_RANDOM, seed)
            _PY_RANDOM.gauss_next = None  # type: ignore[attr-defined]
        if numpy:
            _NP_SEED(((seed * _GOLDEN) & _MASK64) >> 32)
        if torch_:
            _TORCH_SEED(seed)

    return seed_some


@dataclass(frozen=True)
class GlobalRngState:
    """The states of Python ``random``, NumPy's global RNG and torch's CPU RNG.

    Example::

        state = capture_global()   # a GlobalRngState
        state.torch.dtype          # torch.uint8
    """

    python: Any
    numpy: Any
    torch: torch.Tensor


def capture_global() -> GlobalRngState:
    """Capture the three global RNG states of the calling process.

    Example::

        state = capture_global()
        first = torch.rand(())
        restore_global(state)
        assert torch.rand(()) == first
    """
    return GlobalRngState(random.getstate(), np.random.get_state(), torch.get_rng_state())


def restore_global(state: GlobalRngState) -> None:
    """Put back states taken by :func:`capture_global`.

    Example::

        state = capture_global()
        first = random.random()
        restore_global(state)
        assert random.random() == first
    """
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.torch)


class preserve_global_rng(CallerStreams):  # (lower case: a context manager used as a function)
    """Run a block without changing the caller's global RNG streams: torch's and Python's
    states are copied and put back, NumPy's bit generator is set aside while the block
    draws from one of the loader's (``rng.states.CallerStreams``; a cached legacy
    Gaussian of the caller's is dropped). A class rather than a generator function: the
    loader enters one per ``next()`` in the main process.

    Example::

        with preserve_global_rng():
            random.random()        # the caller's stream is where it was afterwards
    """

    __slots__ = ()


def capture_generator(gen: Any) -> dict[str, Any]:
    """A generator object's state as plain values (ints, strings, bytes, lists).

    Supports ``random.Random``, ``numpy.random.Generator``, ``numpy.random.RandomState``
    and ``torch.Generator``; raises :class:`StateError` for anything else.

    Example::

        capture_generator(random.Random(0))["kind"]   # 'python'
    """
    if isinstance(gen, random.Random):
        version, internal, gauss = gen.getstate()
        return {"kind": "python", "version": version, "internal": list(internal), "gauss": gauss}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy-generator", "state": _plain_bitgen(gen.bit_generator.state)}
    if isinstance(gen, np.random.RandomState):
        return {"kind": "numpy-randomstate", "state": _plain_bitgen(gen.get_state(legacy=False))}
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "device": str(gen.device), "state": gen.get_state().numpy().tobytes()}
    raise StateError(f"cannot capture the state of a {type(gen).__qualname__}: not a known RNG")


def restore_generator(gen: Any, plain: Any) -> None:
    """Put a state from :func:`capture_generator` back into ``gen`` (same kind).

    Example::

        gen = np.random.default_rng(0)
        plain = capture_generator(gen)
        first = gen.random()
        restore_generator(gen, plain)
        assert gen.random() == first
    """
    if not isinstance(plain, dict) or "kind" not in plain:
        raise StateError(f"RNG state must be a dict with a 'kind', got {type(plain).__name__}")
    kind = plain["kind"]
    expected = capture_kind(gen)
    if kind != expected:
        raise StateError(f"RNG state kind is {kind!r}, but the generator is a {expected!r}")
    try:
        if kind == "python":
            gen.setstate((plain["version"], tuple(plain["internal"]), plain["gauss"]))
        elif kind == "numpy-generator":
            gen.bit_generator.state = _live_bitgen(plain["state"])
        elif kind == "numpy-randomstate":
            gen.set_state(_live_bitgen(plain["state"]))
        else:
            if not isinstance(plain["state"], bytes):
                raise TypeError(f"torch RNG state must be bytes, got {type(plain['state']).__name__}")
            gen.set_state(torch.frombuffer(bytearray(plain["state"]), dtype=torch.uint8))
    except (AttributeError, IndexError, KeyError, OverflowError, TypeError, ValueError, RuntimeError) as e:
        raise StateError(f"invalid {kind} RNG state: {e}") from e


def capture_kind(gen: Any) -> str | None:
    """The ``kind`` :func:`capture_generator` gives ``gen``, or None if not an RNG."""
    if isinstance(gen, random.Random):
        return "python"
    if isinstance(gen, np.random.Generator):
        return "numpy-generator"
    if isinstance(gen, np.random.RandomState):
        return "numpy-randomstate"
    if isinstance(gen, torch.Generator):
        return "torch"
    return None


def _plain_bitgen(state: Mapping[str, Any]) -> dict[str, Any]:
    # NumPy bit-generator states hold ints wider than 64 bits and arrays: make them
    # strings and lists so MessagePack can carry them.
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _plain_bitgen(value)
        elif isinstance(value, np.ndarray):
            out[key] = {"__array__": value.dtype.str, "values": value.tolist()}
        elif isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
            out[key] = {"__bigint__": str(value)}
        elif isinstance(value, np.integer):
            out[key] = int(value)
        else:
            out[key] = value
    return out


def _live_bitgen(plain: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in plain.items():
        if isinstance(value, dict) and "__array__" in value:
            out[key] = np.asarray(value["values"], dtype=np.dtype(value["__array__"]))
        elif isinstance(value, dict) and "__bigint__" in value:
            out[key] = int(value["__bigint__"])
        elif isinstance(value, dict):
            out[key] = _live_bitgen(value)
        else:
            out[key] = value
    return out
