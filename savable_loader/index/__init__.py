"""The index (drop-in) engine: map-style datasets, the loader's own order, users' samplers.

* ``engine``: ``IndexMode`` / ``OrderMode``, the bookkeeping of the drop-in path.
* ``sampler_engine``: the drop-in path with a sampler of the user's.
* ``source``: epochs of a map-style dataset as batch keys (built by the loader).
* ``samplers``: users' samplers made resumable, and the loader's own face.
* ``permutation``: the epoch order, a keyed bijection evaluated per position.
* ``rank_zero``: a rank's position derived from rank 0's state.

May import: ``dataset``, ``core``, ``config``, ``distributed``, ``rng``, ``state``, ``stats``, ``errors``, ``_torch``.
"""
