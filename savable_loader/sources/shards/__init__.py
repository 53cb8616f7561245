"""Shard folders: the manifest, the stores bytes come from, and one reader per format.

* ``manifest``: ``metadata.json`` (versions 1 and 2) or the manifest of a folder
  prepared by another tool; a leaf, which reads no shard.
* ``store`` / ``remote`` / ``held_file``: where the bytes come from (a local folder, an
  fsspec URL, a descriptor held open).
* ``readers``: the reader interface, ``open_shard`` and ``write_shards``; ``tar``,
  ``mds``, ``litdata``, ``parquet``, ``pt_layout``: one module per format.

May import: ``storage``, ``errors``; no module of sources outside this package.
"""
