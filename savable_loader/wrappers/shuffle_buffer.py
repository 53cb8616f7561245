"""ShuffleBufferDataset: approximate shuffling of a stream through a buffer."""

from __future__ import annotations

import array
from collections.abc import Iterator
from typing import Any, cast

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, StateError
from savable_loader.rng.formulas import draw
from savable_loader.stats.timed import parts_of
from savable_loader.wrappers._held import check_held_mode, refetch, uses_keys
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["ShuffleBufferDataset"]

# A buffer of exact ints (int64 range) or exact floats is held packed, in an array.array:
# a snapshot then copies its memory instead of checking and encoding every sample (a
# list of 100k ints costs milliseconds at every snapshot, the array a few microseconds).
# Ints start 4 bytes wide and widen to 8 at the first that does not fit.
_TYPECODES = {int: ("i", "q") if array.array("i").itemsize == 4 else ("q",), float: ("d",)}
_ITEM_TYPES = {"i": int, "q": int, "d": float}


class ShuffleBufferDataset(BaseWrapperDataset):
    """Keeps ``size`` samples in a buffer and yields a random one as each new one arrives.

    The buffer's samples and its own counter-based RNG (a seed and a draw count) are
    part of the state. With ``buffer_state="auto"`` (the default), when the wrapped
    pipeline can rebuild samples from their keys (``can_restore_sample()``) and every
    buffered sample has one, the state holds the keys alone (``held="keys"``,
    ``buffer`` None) and a restore fetches every buffered sample again through
    ``restore_sample`` (re-mapped, its random draws from its key). Otherwise (a source
    whose read samples may be gone later, ``samples_may_vanish``, unless
    ``buffer_state="keys"``), with ``buffer_state="payload"``, or while the buffer is packed (below: a few bytes a sample,
    less than a key), the buffer is stored in the state itself, with the samples' restore
    keys (``keys`` is None until the wrapped pipeline gives a sample a key). Samples must
    not be modified in place after they are yielded (the state holds copies taken at
    snapshot time).

    Before yielding a sample the buffer calls ``mark_sample`` with the sample's key (None
    for a sample without one), so random draws above it follow from the key whether or
    not the pipeline can restore samples (the RNG rule of ``SavableDataset``).

    While every buffered sample is an ``int`` (within the 64-bit signed range) or every
    one a ``float``, the buffer is an ``array.array`` (typecode ``"i"``, widened to
    ``"q"`` at the first int beyond 32 bits, or ``"d"``), whose snapshot is one copy of
    its memory; the samples come out as the same ints and floats, bit for bit. Any other
    sample turns it into a list until the buffer is next empty.

    Example::

        ds = ShuffleBufferDataset(source, size=1000)
    """

    # ``ended``: the wrapped dataset has ended this epoch (the buffer drains). A restored
    # buffer then does not run the wrapped pipeline's end of stream a second time (the
    # end-of-stream rule of ``SavableDataset``).
    # ``held``: "keys" when the state's ``buffer`` is None and ``keys`` name the samples
    # (fetched again by the restored iterator), else "payload". ``buffer`` and ``held``
    # are properties over the live buffer (``_items``).
    _savable_fields = ("buffer", "keys", "seed", "draws", "ended", "held")
    _savable_optional = frozenset({"ended", "held"})

    def __init__(self, dataset: SavableDataset, size: int, *, buffer_state: str = "auto") -> None:
        super().__init__(dataset)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LoaderUsageError(f"ShuffleBufferDataset size must be a positive int, got {size!r}")
        check_held_mode("ShuffleBufferDataset", buffer_state)
        self.size = size
        self.buffer_state = buffer_state
        self._by_key: bool | None = None  # buffer_state "auto" decided (on first save)
        self.reset_state_own()

    def reset_state_own(self) -> None:
        # the buffered samples; None: a restored state named them by key, not fetched yet
        self._items: list[Any] | array.array[Any] | None = []
        # None while no buffered sample has a key (no list of Nones in every state of a
        # keyless pipeline); else the key of every buffered sample, None for keyless ones.
        self.keys: list[Any] | None = None
        self._keyless = 0  # buffered samples without a key while ``keys`` is a list
        self.seed = self.worker_config.epoch_seed()
        self.draws = 0
        self.ended = False

    def _keys_held(self) -> bool:
        if self._items is None:
            return True
        if self.keys is None or self._keyless or type(self._items) is not list or not self._items:
            return False
        if self._by_key is None:
            self._by_key = uses_keys(self.buffer_state, self.dataset)
        return self._by_key

    @property
    def buffer(self) -> list[Any] | array.array[Any] | None:
        """The buffered samples as the state holds them (None: named by ``keys``)."""
        return None if self._keys_held() else self._items

    @buffer.setter
    def buffer(self, value: list[Any] | array.array[Any] | None) -> None:
        self._items = value

    @property
    def held(self) -> str:
        """What the state holds of the buffer: ``"keys"`` (positions, fetched again at a
        restore) or ``"payload"`` (the samples themselves)."""
        return "keys" if self._keys_held() else "payload"

    @held.setter
    def held(self, value: str) -> None:
        # (what the state holds follows from ``buffer``: None when the keys name the samples)
        if (value == "keys") != (self._items is None):
            raise StateError(f"ShuffleBufferDataset state: held is {value!r} with a buffer of {type(self._items)}")

    def _fetch_restored(self) -> None:
        """Fetch the samples a restored state named by key (``held="keys"``)."""
        keys = list(self.keys or [])
        self._items = refetch(self.dataset, keys)
        self._keyless = 0

    def _pick(self) -> Any:
        buffer, keys = cast("list[Any] | array.array[Any]", self._items), self.keys  # (fetched by __iter__)
        i = draw(self.seed, self.draws) % len(buffer)
        self.draws += 1
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        key = None
        if keys is not None:
            keys[i], keys[-1] = keys[-1], keys[i]
            key = keys.pop()
            if key is None:
                self._keyless -= 1
        # The yielded sample is not (always) the one just pulled: re-seed for what follows
        # from its key (None: no key, no re-seed).
        self.mark_sample(key)
        return buffer.pop()

    def __iter__(self) -> Iterator[Any]:
        inner = self.dataset
        if self._items is None:
            self._fetch_restored()
        elif self.keys is not None:
            self._keyless = self.keys.count(None)
        if not self.ended:
            for part in parts_of(inner):  # (see stats/timed.py)
                for sample in part:
                    key = inner.sample_key
                    if key is not None and self.keys is None:
                        self.keys = [None] * len(self._items)  # type: ignore[arg-type]
                        self._keyless = len(self.keys)
                    self._append(sample)
                    if self.keys is not None:
                        self.keys.append(key)
                        if key is None:
                            self._keyless += 1
                    if len(self._items) >= self.size:  # type: ignore[arg-type]
                        yield self._pick()
            self.ended = True
        while self._items:
            yield self._pick()

    def _append(self, sample: Any) -> None:
        buffer = cast("list[Any] | array.array[Any]", self._items)  # (fetched by __iter__)
        if type(buffer) is array.array:
            if type(sample) is _ITEM_TYPES.get(buffer.typecode):
                try:
                    buffer.append(sample)
                    return
                except OverflowError:  # too wide for the typecode: a wider one, or a list
                    wider = _packed(buffer, sample)
                    if wider is not None:
                        self._items = wider
                        return
            buffer = self._items = buffer.tolist()  # another kind of sample: a list from now on
        elif not buffer:
            packed = _packed(buffer, sample)
            if packed is not None:
                self._items = packed
                return
        buffer.append(sample)

    def restore_sample(self, key: Any) -> Any:
        """The inner sample ``key`` names, re-seeded as when it left the buffer."""
        sample = self.dataset.restore_sample(key)
        self.mark_sample(key)
        return sample

    def config(self) -> dict[str, Any]:
        return {"size": self.size}


def _packed(items: list[Any] | array.array[Any], sample: Any) -> array.array[Any] | None:
    """``items`` and ``sample`` in the narrowest array.array that holds them exactly (None:
    none does); ``items`` are exact ints or floats of the same type as ``sample``."""
    codes = _TYPECODES.get(type(sample), ())
    start = codes.index(items.typecode) + 1 if isinstance(items, array.array) else 0
    for code in codes[start:]:
        packed = array.array(code, items)
        try:
            packed.append(sample)
        except OverflowError:
            continue
        return packed
    return None
