"""The savable dataset contract: what every source and wrapper of a pipeline is.

* ``base``: :class:`SavableDataset` (``savable_loader.SavableDataset``), the names
  classes are saved under, configs and their fingerprints;
* ``values``: values inside dataset states, copied at snapshot time and converted to
  plain values and back;
* ``guards``: cheap checks of the contract's common mistakes;
* ``inline``: small default-collated batches stacked outside shared memory;
* ``checks``: a saved dataset configuration against the current one.

May import: ``config``, ``rng``, ``state``, ``stats``, ``errors``, ``_torch``.
"""

from savable_loader.dataset.base import SavableDataset, type_name, wrap_key

__all__ = ["SavableDataset", "type_name", "wrap_key"]
