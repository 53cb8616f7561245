"""Sources: where samples come from.

* ``IndexedDataset`` / ``IndexSampler`` / ``IndexPlan``: the index source of the drop-in
  path (built by the loader itself).
* ``ShardedFileDataset``: a folder of ``.npy`` / ``.pt`` / ``.jsonl`` shards listed in a
  ``metadata.json`` (``write_shards`` writes one, ``read_metadata`` checks one).
* ``IterableSource``: a user generator function with an explicit position.

Example::

    from savable_loader.sources import ShardedFileDataset, write_shards

    write_shards("data", [np.arange(10)] * 4)           # 4 shards of 10 samples
    ds = ShardedFileDataset("data", worker_config=wc)   # a savable pipeline source
"""

from savable_loader.sources._metadata import read_metadata
from savable_loader.sources._shard_io import open_shard, write_shards
from savable_loader.sources.index import BatchKey, IndexedDataset, IndexPlan, IndexSampler
from savable_loader.sources.iterable import IterableSource, ReplayWarning, StreamInfo
from savable_loader.sources.sharded import ShardedFileDataset

__all__ = [
    "BatchKey",
    "IndexPlan",
    "IndexSampler",
    "IndexedDataset",
    "IterableSource",
    "ReplayWarning",
    "ShardedFileDataset",
    "StreamInfo",
    "open_shard",
    "read_metadata",
    "write_shards",
]
