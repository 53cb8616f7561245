"""The public loader: :class:`SavableDataLoader` and what runs it in the main process.

* ``dataloader``: ``SavableDataLoader``, torch's ``DataLoader`` whose position is saved
  and restored; it drives one engine through :class:`~savable_loader.core.engine.Mode`.
* ``arguments``: torch's argument checks, with torch's messages, and ours.
* ``iterator``: the iterators ``iter(loader)`` returns, and the fates of iterations.
* ``failures``, ``feeder``, ``sigchld``, ``parent_watch``: worker processes that die,
  cannot pickle a sample, or outlive the main process, as errors of ours.

May import: ``pipeline``, ``index``, ``dataset``, ``core``, ``config``, ``distributed``, ``rng``, ``state``, ``stats``, ``errors``, ``_torch``, ``_version``.
"""

from savable_loader.loader.dataloader import SavableDataLoader

__all__ = ["SavableDataLoader"]
