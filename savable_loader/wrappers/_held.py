"""What a buffering wrapper's state holds: its samples, or their restore keys.

A wrapper that holds samples between iterations (``PackingDataset``'s documents,
``ShuffleBufferDataset``'s samples) saves either the samples themselves (the payload) or,
when the pipeline it wraps can build any sample again from its key
(``SavableDataset.can_restore_sample()``: a source with ``restore_sample``, and maps,
filters and the other wrappers above it that pass it on), only their keys; a restore then
fetches every held sample again through ``restore_sample``, which re-maps it and draws
its random numbers from its key as the first time. A state of keys is a few bytes per
sample where a payload is the sample itself (kilobytes of tokens), and a snapshot copies
keys only.

The protocol is the restore-key protocol every source and wrapper already has
(``mark_sample`` / ``restore_sample``, see ``savable_loader.dataset.base``): a dataset that
implements ``restore_sample`` promises to build the sample its key names, the same as
iteration built it, without changing its iteration state. A sample without a key (None)
cannot be fetched again: a buffer holding one saves payload. A source whose read samples
may be gone later (a producer's stream that is trimmed behind the reader:
``PollingSource``, ``RedisStreamSource``) sets ``samples_may_vanish = True``: "auto" then
saves payload, and ``buffer_state="keys"`` is the user's promise that what a buffer holds
stays readable.
"""

from __future__ import annotations

from typing import Any

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.rng.seeding import preserve_global_rng

__all__ = ["HELD_MODES", "check_held_mode", "refetch", "uses_keys"]

#: ``buffer_state=`` values: "auto" saves keys where the wrapped pipeline can fetch a sample
#: again by key and no source in it may lose what it has read (``samples_may_vanish``: a
#: producer's stream, which a ``trim`` or the producer empties behind the reader), payload
#: otherwise; "keys" saves keys wherever the pipeline can fetch a sample again (for such a
#: stream: only where nothing a buffer holds is dropped); "payload" always the samples.
HELD_MODES = ("auto", "keys", "payload")


def check_held_mode(owner: str, mode: Any) -> None:
    """LoaderUsageError naming ``owner`` unless ``mode`` is one of :data:`HELD_MODES`."""
    if mode not in HELD_MODES:
        raise LoaderUsageError(f"{owner} buffer_state must be one of {HELD_MODES}, got {mode!r}")


def uses_keys(mode: str, dataset: SavableDataset) -> bool:
    """True if a buffer over ``dataset`` with ``buffer_state=mode`` saves keys."""
    if mode == "payload" or not dataset.can_restore_sample():
        return False
    return mode == "keys" or not _may_vanish(dataset)


def _may_vanish(dataset: SavableDataset) -> bool:
    """True if a dataset of this pipeline declares that samples it has read may be gone
    later (a class attribute ``samples_may_vanish = True``)."""
    if getattr(type(dataset), "samples_may_vanish", False):
        return True
    return any(_may_vanish(child) for child in dataset.children())


def refetch(dataset: SavableDataset, keys: list[Any]) -> list[Any]:
    """The samples ``keys`` name, built again by ``dataset.restore_sample``, in the order of
    ``keys``. They are fetched in sorted key order where the keys compare (samples of one
    shard or row group together), and the caller's global RNG streams are left as they
    were (``restore_sample`` re-seeds them from each key)."""
    order = list(range(len(keys)))
    try:
        order.sort(key=keys.__getitem__)
    except TypeError:  # keys of mixed kinds: arrival order
        pass
    out: list[Any] = [None] * len(keys)
    with preserve_global_rng():
        for i in order:
            out[i] = dataset.restore_sample(keys[i])
    return out
