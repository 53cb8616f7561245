"""What both engines share: the engine interface, elastic arithmetic, framework facts.

* ``engine``: :class:`Mode` (one per loader) and :class:`Iteration` (one per ``iter()``),
  the interface the index and the pipeline engines implement and the loader drives.
* ``elastic``: a saved position carried to another world size or batch size.
* ``frameworks``: what the loader knows of the training frameworks that drive it.
* ``tensordict``: TensorDict batches, detected, split and held in a state.
* ``checks``: settings recorded in a state or a restore key against the loader's own.
* ``shutdown``: the loader's shutdown Event, as a worker process sees it.

May import: ``errors``, ``rng``, ``state``.
"""
