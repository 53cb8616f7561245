"""Random number generators: every seed formula and every generator capture, one place.

The public functions (:mod:`savable_loader.rng` is public) are those of ``seeding``:
derive seeds from counters, seed the three global generators, capture and restore
states. Private modules beside it:

* ``formulas``: every seed formula of the exact-resume contract, named;
* ``global_rngs``: which global generators a loader re-seeds per sample (``global_rngs=``);
* ``owned``: generators a map-style dataset owns, found per epoch, re-seeded per sample;
* ``states``: the three global generators through their public APIs only;
* ``code_refs``: what a dataset's code reaches besides its attributes.

May import: ``errors``.

Example::

    from savable_loader.rng import counter_seed, derive_seed, seed_global

    base = derive_seed(0, "sample", epoch)
    seed_global(counter_seed(base, position))
"""

from savable_loader.rng.seeding import (
    GLOBAL_RNG_NAMES,
    SEED_FORMULA,
    GlobalRngState,
    capture_generator,
    capture_global,
    counter_seed,
    counter_seeds,
    derive_seed,
    global_seeder,
    hash_seed,
    item_seed,
    numpy_word,
    preserve_global_rng,
    restore_generator,
    restore_global,
    seed_global,
)

__all__ = [
    "GLOBAL_RNG_NAMES",
    "GlobalRngState",
    "SEED_FORMULA",
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
