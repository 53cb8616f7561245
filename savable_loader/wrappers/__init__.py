"""Wrappers that compose savable pipelines, one per module.

Example::

    ds = sl.wrappers.BatchDataset(sl.wrappers.MapDataset(source, augment), batch_size=32)
"""

from savable_loader.wrappers.base import BaseWrapperDataset
from savable_loader.wrappers.batch import BatchDataset
from savable_loader.wrappers.filter import FilterDataset
from savable_loader.wrappers.limit import LimitDataset
from savable_loader.wrappers.map import MapDataset
from savable_loader.wrappers.repeat import RepeatDataset
from savable_loader.wrappers.shuffle_buffer import ShuffleBufferDataset

__all__ = [
    "BaseWrapperDataset",
    "BatchDataset",
    "FilterDataset",
    "LimitDataset",
    "MapDataset",
    "RepeatDataset",
    "ShuffleBufferDataset",
]
