"""Wrappers that compose savable pipelines, one per module.

May import: ``dataset``, ``core``, ``config``, ``rng``, ``state``, ``stats``, ``errors``.

Example::

    ds = sl.wrappers.BatchDataset(sl.wrappers.MapDataset(source, augment), batch_size=32)
"""

from savable_loader.wrappers.base import BaseWrapperDataset
from savable_loader.wrappers.batch import BatchDataset
from savable_loader.wrappers.blend import BlendDataset
from savable_loader.wrappers.concat import ConcatDataset
from savable_loader.wrappers.epochize import EpochizeDataset, EpochizeReplayWarning
from savable_loader.wrappers.filter import FilterDataset
from savable_loader.wrappers.gc import GcDataset
from savable_loader.wrappers.group_batch import GroupBatchDataset
from savable_loader.wrappers.limit import LimitDataset
from savable_loader.wrappers.log_sample import LogSampleDataset
from savable_loader.wrappers.map import MapDataset
from savable_loader.wrappers.micro_batch import MicroBatchDataset
from savable_loader.wrappers.packing import PackingDataset
from savable_loader.wrappers.repeat import RepeatDataset
from savable_loader.wrappers.shuffle_buffer import ShuffleBufferDataset

__all__ = [
    "BaseWrapperDataset",
    "BatchDataset",
    "BlendDataset",
    "ConcatDataset",
    "EpochizeDataset",
    "EpochizeReplayWarning",
    "FilterDataset",
    "GcDataset",
    "GroupBatchDataset",
    "LimitDataset",
    "LogSampleDataset",
    "MapDataset",
    "MicroBatchDataset",
    "PackingDataset",
    "RepeatDataset",
    "ShuffleBufferDataset",
]
