"""Storage: where a dataset's files live (a local folder or any fsspec URL), a whole-file
cache shared by the processes of a node, exact prefetch, and one retry policy.

* :class:`Storage`: files under a URL, opened as local files (``open``), prefetched in
  the background (``prefetch``), or read in part (``read_range``).
* :class:`FileRef`: a file and what its metadata says (size, SHA-256, ETag).
* :class:`RetryPolicy`: backoff with jitter, a timeout per attempt, a deadline per
  request; :func:`transient_reason` says which failures it retries.
* :class:`ShardCache` / :class:`CachedFile`: the cache folder and a file held in it.

Importing this package imports no backend (not even fsspec): a filesystem is opened on
first use in each process. ``pip install 'savable_loader[s3]'`` (or ``[gcs]``,
``[azure]``, ``[hf]``, ``[http]``) installs a backend.

May import: ``errors``.

Example::

    from savable_loader.storage import FileRef, RetryPolicy, Storage

    storage = Storage("s3://bucket/train", storage_options={"profile": "training"},
                      cache_dir="/local/cache", cache_bytes=100 * 2**30, retry=RetryPolicy(deadline=30))
    with storage.open(FileRef("shard-00000.tar", size=1073741824)) as cached:
        tar = tarfile.open(cached.path)
"""

from savable_loader.storage.cache import CachedFile, ShardCache, cache_key
from savable_loader.storage.remote import Remote
from savable_loader.storage.retry import RetryPolicy, ShortRead, transient_reason
from savable_loader.storage.store import FileRef, Storage, default_cache_dir

__all__ = [
    "CachedFile",
    "FileRef",
    "Remote",
    "RetryPolicy",
    "ShardCache",
    "ShortRead",
    "Storage",
    "cache_key",
    "default_cache_dir",
    "transient_reason",
]
