"""Sources: where samples come from.

* ``ShardedFileDataset``: a folder of ``.npy`` / ``.pt`` / ``.jsonl`` shards listed in a
  ``metadata.json`` (``write_shards`` writes one, ``read_metadata`` checks one).
* ``IterableSource``: a user generator function with an explicit position.
* ``TorchIterableSource``: a plain ``torch.utils.data.IterableDataset`` (the loader builds
  it for one; resumed from its ``state_dict()`` when it has one, by replay otherwise).

The index source of the drop-in path (``savable_loader.sources.index``) is built by the
loader itself and is not part of the public API.

Example::

    from savable_loader.sources import ShardedFileDataset, write_shards

    write_shards("data", [np.arange(10)] * 4)           # 4 shards of 10 samples
    ds = ShardedFileDataset("data", worker_config=wc)   # a savable pipeline source
"""

from savable_loader.sources._shard_io import open_shard, read_metadata, write_shards
from savable_loader.sources.iterable import IterableSource, ReplayWarning, StreamInfo
from savable_loader.sources.sharded import ShardedFileDataset
from savable_loader.sources.torch_iterable import TorchIterableSource

__all__ = [
    "IterableSource",
    "ReplayWarning",
    "ShardedFileDataset",
    "StreamInfo",
    "TorchIterableSource",
    "open_shard",
    "read_metadata",
    "write_shards",
]
