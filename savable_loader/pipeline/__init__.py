"""The pipeline engine: savable pipelines run in worker processes, hosted and resized.

* ``engine``: the savable-pipeline path's bookkeeping in the main process
  (``PipelineMode``, an engine of :mod:`savable_loader.core.engine`).
* ``iterable``: a plain ``torch.utils.data.IterableDataset`` run as a savable pipeline
  over :class:`~savable_loader.sources.TorchIterableSource` (``IterableMode``).
* ``worker``: the worker side: snapshots attached to items, skip replay.
* ``hosting``: logical workers hosted by loading contexts.
* ``resize``: pipeline states carried to another world size.

The datasets themselves (:class:`~savable_loader.SavableDataset`) are the ``dataset``
package's; sources and wrappers stand on it, and this engine runs them.

May import: ``sources``, ``dataset``, ``core``, ``config``, ``rng``, ``state``, ``stats``, ``errors``, ``_torch``.
"""
