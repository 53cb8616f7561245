"""Every seed formula of the exact-resume contract, named, in one place.

A resumed run draws the same numbers as the uninterrupted one because every random
stream is seeded from a formula of ``(seed, position)``; changing a formula (or the
namespace string it hashes) changes every stream, so states saved by earlier versions
would resume into other data. ``tests/rng/test_seeds.py`` pins each formula's output
(golden values): a refactor that changes one fails there.

The primitives are in :mod:`savable_loader.rng.seeding`: ``derive_seed(*parts)`` (a 64-bit hash
of the parts), ``counter_seed(base, i)`` (a fast 64-bit mix of a base and a counter) and
``item_seed(s)`` (the seed below ``2**63``).

A per-item seed ``s`` goes to the three global generators through ``rng.seed_global(s)``
(or the function ``rng.global_seeder(names)`` returns): Python's ``random`` and torch's
CPU RNG get ``s``, NumPy's global RNG gets ``rng.numpy_word(s)``, a word independent of
the low word torch's Mersenne Twister is seeded from. States and restore keys record this
as seed formula 3 (``rng.SEED_FORMULA``, ``LoaderConfig.seed_formula``,
``RestoreKey.seed_formula``). Generators a dataset owns (``rng.owned``) are seeded from
their own per-path bases, never from the same value as another generator.

Example::

    base = pipeline_base(seed, rank, worker, epoch)   # once per epoch
    seed_global(pipeline_item(base, index))           # before each item
"""

from __future__ import annotations

from collections.abc import Sequence

from savable_loader.rng.seeding import (
    counter_seed,
    counter_seeds,
    derive_seed,
    hash_seed,
    item_seed,
)

__all__ = [
    "NAMESPACES",
    "collate_seed",
    "datapipe_shuffle_seed",
    "draw",
    "feistel_key",
    "engine_generator_seed",
    "key_prefix",
    "key_seed",
    "key_seed_of",
    "owned_rng_base",
    "owned_stream_seed",
    "pcg_increment",
    "pipeline_base",
    "pipeline_item",
    "sample_base",
    "sample_item",
    "sample_items",
    "sampler_seed",
    "shard_order_seed",
    "shard_samples_seed",
    "torch_iterable_base",
    "torch_worker_info_seed",
    "undeclared_rngs_seed",
    "worker_epoch_seed",
    "worker_seed",
]

_MASK63 = (1 << 63) - 1

#: The namespace strings ``derive_seed`` hashes, each owned by the formula(s) below.
NAMESPACES = (
    "collate",
    "key",
    "owned-rng",
    "pcg-increment",
    "pcg-increment-low",
    "pipeline",
    "sample",
    "sampler",
    "shard-order",
    "shard-samples",
    "worker",
    "worker-epoch",
    "workers",
    "datapipe-shuffle",
    "torch-iterable",
    "torch-worker-info",
    "order",
    "undeclared-rngs",
)


# -- drop-in path (index source) ------------------------------------------------------


def feistel_key(seed: int, epoch: int) -> int:
    """The key of epoch ``epoch``'s Feistel order (``index.permutation.FeistelPermutation``)."""
    return derive_seed(seed, "order", epoch)


def sample_base(seed: int, salt: tuple[str | int, ...], epoch: int) -> int:
    """The per-epoch base of the sample seeds (``salt`` is ``("sample",)`` for the
    loader's own order, a sampler stream's salt otherwise)."""
    return derive_seed(seed, *salt, epoch)


def sample_item(base: int, position: int) -> int:
    """The global RNGs' seed before loading the sample at ``position`` of the epoch."""
    return item_seed(counter_seed(base, position))


def sample_items(base: int, positions: Sequence[int]) -> list[int]:
    """``[sample_item(base, p) for p in positions]``, computed a batch at a time."""
    return counter_seeds(base, positions, _MASK63)


def collate_seed(seed: int, epoch: int, position: int) -> int:
    """The global RNGs' seed before collating the batch that starts at ``position``."""
    return item_seed(derive_seed(seed, "collate", epoch, position))


def undeclared_rngs_seed(seed: int, epoch: int) -> int:
    """The seed of the global generators a loader's ``global_rngs=`` leaves out, in every
    batch of ``epoch`` (they are re-seeded only when something changed them)."""
    return item_seed(derive_seed(seed, "undeclared-rngs", epoch))


def owned_stream_seed(seed: int, salt: tuple[str | int, ...]) -> int:
    """The seed of the dataset-owned generators' streams: the loader's seed for its own
    order, salted like the global RNGs' for other streams."""
    return seed if salt == ("sample",) else derive_seed(seed, *salt)


def owned_rng_base(seed: int, epoch: int, path: str) -> int:
    """The per-epoch base of the generator a dataset holds at ``path``; its seed before
    sample ``position`` is ``counter_seed(base, position)``."""
    return derive_seed(seed, "owned-rng", epoch, path)


def pcg_increment(base: int) -> int:
    """The (odd, 128-bit) PCG stream increment of an owned PCG generator for an epoch."""
    return derive_seed(base, "pcg-increment") << 64 | derive_seed(base, "pcg-increment-low") | 1


def engine_generator_seed(seed: int, epoch: int) -> int:
    """The seed of torch's own DataLoader generator for ``epoch`` (worker base seeds)."""
    return item_seed(derive_seed(seed, "workers", epoch))


def sampler_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of the private RNG a user's sampler draws from in ``epoch``."""
    return derive_seed(seed, "sampler", rank, epoch)


# -- savable pipelines ----------------------------------------------------------------


def pipeline_base(seed: int, rank: int, worker: int, epoch: int) -> int:
    """The per-epoch base of a pipeline worker's item seeds."""
    return derive_seed(seed, "pipeline", rank, worker, epoch)


def pipeline_item(base: int, index: int) -> int:
    """The global RNGs' seed before a pipeline worker produces item ``index``."""
    return item_seed(counter_seed(base, index))


def key_seed(seed: int, epoch: int, repetitions: tuple[int, ...], type_name: str, key_text: str) -> int:
    """The global RNGs' seed when a dataset marks the sample of key ``key_text`` (JSON):
    ``derive_seed(seed, "key", epoch, *repetitions, type_name, key_text)``."""
    return key_seed_of(key_prefix(seed, epoch, repetitions, type_name), key_text.encode())


def key_prefix(seed: int, epoch: int, repetitions: tuple[int, ...], type_name: str) -> bytes:
    """What :func:`key_seed` hashes before the key's JSON text, made once per dataset
    class, epoch and pass (``SavableDataset.mark_sample`` keeps it)."""
    return "\x1f".join(str(p) for p in (seed, "key", epoch, *repetitions, type_name, "")).encode()


def key_seed_of(prefix: bytes, key_json: bytes) -> int:
    """:func:`key_seed` from a :func:`key_prefix` and the key's JSON as UTF-8 bytes (what
    ``msgspec.json.encode`` returns): the same value, without re-joining the parts."""
    return hash_seed(prefix + key_json)


def worker_seed(seed: int, rank: int, worker: int) -> int:
    """``WorkerConfig.worker_seed()``."""
    return derive_seed(seed, "worker", rank, worker)


def worker_epoch_seed(seed: int, rank: int, worker: int, epoch: int, repetitions: tuple[int, ...]) -> int:
    """``WorkerConfig.epoch_seed()``: per worker, epoch and ``RepeatDataset`` pass."""
    return derive_seed(seed, "worker-epoch", rank, worker, epoch, *repetitions)


def draw(seed: int, draws: int) -> int:
    """The ``draws``-th 64-bit draw of a wrapper's stream (shuffle buffer, blend)."""
    return counter_seed(seed, draws)


def shard_order_seed(seed: int, key: tuple[int | str, ...]) -> int:
    """The PCG64 seed of the shard order of a sharded source (``key``: epoch, passes)."""
    return derive_seed(seed, "shard-order", *key)


def shard_samples_seed(seed: int, key: tuple[int | str, ...], shard: int) -> int:
    """The PCG64 seed of the sample order inside ``shard``."""
    return derive_seed(seed, "shard-samples", *key, shard)


# -- plain torch IterableDatasets (sources/torch_iterable.py) --------------------------


def torch_iterable_base(seed: int, rank: int, worker: int, epoch: int, repetitions: tuple[int, ...]) -> int:
    """The per-epoch base of the item seeds of a plain IterableDataset's worker."""
    return derive_seed(seed, "torch-iterable", rank, worker, epoch, *repetitions)


def torch_worker_info_seed(seed: int, rank: int, worker: int, epoch: int, repetitions: tuple[int, ...]) -> int:
    """``get_worker_info().seed`` of a logical worker in an epoch (below 2**63, as torch's)."""
    return item_seed(derive_seed(seed, "torch-worker-info", rank, worker, epoch, *repetitions))


def datapipe_shuffle_seed(seed: int, epoch: int, repetitions: tuple[int, ...]) -> int:
    """The seed of the generator an IterDataPipe's shufflers share in an epoch."""
    return item_seed(derive_seed(seed, "datapipe-shuffle", epoch, *repetitions))
