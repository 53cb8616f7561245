"""Sources: where samples come from (the index source of the drop-in path, for now)."""

from savable_loader.sources.index import BatchKey, IndexedDataset, IndexPlan, IndexSampler

__all__ = ["BatchKey", "IndexPlan", "IndexSampler", "IndexedDataset"]
