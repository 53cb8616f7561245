"""Sources: where samples come from.

* ``ShardedFileDataset``: a folder of shards listed in a ``metadata.json``: ``.npy`` /
  ``.pt`` / ``.jsonl`` (``write_shards`` writes such a folder), WebDataset ``.tar`` and
  Parquet (``index_folder`` indexes a folder where it is), or a folder prepared by
  Megatron-Energon, MosaicML Streaming (MDS) or LitData, read unchanged
  (``read_metadata`` reads and checks the manifest). ``decode_sample`` and
  ``DEFAULT_DECODERS`` decode tar samples.
* ``IterableSource``: a user generator function with an explicit position.
* ``PollingSource``: a stream producers keep filling, read by index with ``fetch(info,
  index)`` (None: not there yet, polled again; ``END``: the epoch ends there).
* ``RedisStreamSource``: the entries of a Redis stream producers ``XADD`` to (``redis``
  is imported when it first reads; ``pip install 'savable_loader[redis]'``).
* ``TorchIterableSource``: a plain ``torch.utils.data.IterableDataset`` (the loader builds
  it for one; resumed from its ``state_dict()`` when it has one, by replay otherwise).

The index source of the drop-in path (``savable_loader.index.source``) is built by the
loader itself and is not part of the public API.

May import: ``dataset``, ``core``, ``config``, ``rng``, ``state``, ``storage``, ``errors``, ``_torch``.

Example::

    from savable_loader.sources import ShardedFileDataset, write_shards

    write_shards("data", [np.arange(10)] * 4)           # 4 shards of 10 samples
    ds = ShardedFileDataset("data", worker_config=wc)   # a savable pipeline source
"""

from savable_loader.sources.decoders import DEFAULT_DECODERS, decode_sample
from savable_loader.sources.indexing import index_folder
from savable_loader.sources.iterable import IterableSource, ReplayWarning, StreamInfo
from savable_loader.sources.polling import END, PollingSource
from savable_loader.sources.redis_stream import RedisStreamSource
from savable_loader.sources.sharded import ShardedFileDataset
from savable_loader.sources.shards.folder import read_metadata
from savable_loader.sources.shards.readers import open_shard, write_shards
from savable_loader.sources.torch_iterable import TorchIterableSource

__all__ = [
    "DEFAULT_DECODERS",
    "END",
    "IterableSource",
    "PollingSource",
    "RedisStreamSource",
    "ReplayWarning",
    "ShardedFileDataset",
    "StreamInfo",
    "TorchIterableSource",
    "decode_sample",
    "index_folder",
    "open_shard",
    "read_metadata",
    "write_shards",
]
