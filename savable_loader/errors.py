"""Exceptions raised by savable_loader.

Every error the library raises on purpose derives from :class:`SavableLoaderError`, so
``except savable_loader.errors.SavableLoaderError`` catches all of them::

    SavableLoaderError
    ├── StateError                  a state (bytes, file or object) is malformed or foreign
    │   ├── StateVersionError       written by a newer savable-loader: upgrade
    │   └── StateFileError          a state file cannot be written or read (names the path; an OSError)
    ├── ConfigMismatchError         restore under a configuration that cannot be honoured
    ├── LoaderUsageError            the loader was called in a way it does not support
    │   ├── UsageTypeError          an argument of the wrong type (also a TypeError)
    │   ├── DatasetContractError    a SavableDataset breaks its contract (say, an unlisted child)
    │   └── UndeclaredRngError      a batch drew from a global RNG that global_rngs= does not list
    ├── RestoreKeyError             a restore key cannot be rebuilt (foreign, malformed, unsupported)
    ├── DataError                   data on disk is malformed (shard metadata, shard files)
    │   ├── IntegrityError          a file's size or checksum differs from what its metadata says
    │   └── StreamTrimmedError      entries a stream reader needs were trimmed from the stream
    ├── ResumeMismatchError         savable_loader.testing.check_resume found a resumed run that differs
    ├── InternalError               an invariant of savable_loader itself broke: a bug, please report it
    ├── StorageError                a remote read failed (names the URL, byte range, attempts, last cause)
    │   └── RangeIgnoredError       the server answered a ranged read with other bytes (it ignores Range)
    ├── StreamTimeoutError          a stream source waited longer than its timeout for the next item
    └── WorkerError                 a worker process failed (names the worker)
        ├── WorkerDiedError         the worker process exited
        └── WorkerTimeoutError      the worker did not answer in time

Warnings: :class:`UnsavedRngWarning` (a dataset holds a random generator it does not save).

Example::

    try:
        loader.restore_state_rank(state)
    except ConfigMismatchError as e:
        print(e.field, e.saved, e.current)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigMismatchError",
    "DataError",
    "DatasetContractError",
    "IntegrityError",
    "InternalError",
    "LoaderUsageError",
    "RangeIgnoredError",
    "RestoreKeyError",
    "ResumeMismatchError",
    "SavableLoaderError",
    "StateError",
    "StateFileError",
    "StateVersionError",
    "StorageError",
    "StreamTimeoutError",
    "StreamTrimmedError",
    "UndeclaredRngError",
    "UnsavedRngWarning",
    "UsageTypeError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
]


class SavableLoaderError(Exception):
    """Base class of every error savable_loader raises on purpose.

    Example::

        try:
            loader.restore_state_rank(sl.state.load_file("loader.state"))
        except SavableLoaderError as e:
            print(f"cannot resume the data, starting over: {e}")
    """


class StateError(SavableLoaderError):
    """A state is malformed, truncated, corrupted or not a savable_loader state.

    Raised by :func:`savable_loader.state.decode`, :func:`savable_loader.state.load_file`
    and by restores handed an object of the wrong kind.

    Example::

        try:
            state = sl.state.load_file("loader.state")
        except StateError as e:   # missing, truncated, bad checksum, not a state
            print(e)              # names the file and the problem
    """


class StateVersionError(StateError):
    """The state was written with a newer schema version than this library knows.

    Example::

        try:
            state = sl.state.decode(data)
        except StateVersionError:
            raise SystemExit("this checkpoint needs a newer savable-loader: pip install -U savable-loader")
    """


class StateFileError(StateError, OSError):
    """A state file cannot be written or read: a missing or read-only folder, a folder
    where the file should be, a full disk.

    The message names the target path and the reason; ``path`` is the target and
    ``errno`` the operating system's error number (None if there was none). Also an
    ``OSError``, so ``except OSError`` around a save keeps working.

    Example::

        try:
            sl.state.save_file("ckpt/loader.state", state)
        except StateFileError as e:
            print(e)   # ckpt/loader.state: cannot save: the folder ckpt does not exist
    """

    def __init__(self, message: str, path: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno  # set after OSError.__init__: str(self) stays the message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.path, self.errno))


class ConfigMismatchError(SavableLoaderError):
    """A restore under a configuration the loader cannot honour.

    ``field`` names the configuration entry, ``saved`` is its value in the state and
    ``current`` its value in the loader being restored.

    Example::

        try:
            loader.restore_state_rank(state)
        except ConfigMismatchError as e:
            print(e.field, e.saved, e.current)   # e.g. seed 7 8
    """

    def __init__(self, field: str, saved: Any, current: Any, hint: str = "") -> None:
        self.field = field
        self.saved = saved
        self.current = current
        self.hint = hint
        message = f"cannot restore: {field} was {saved!r} when the state was saved, but is {current!r} now"
        if hint:
            message += f" ({hint})"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.saved, self.current, self.hint))


class LoaderUsageError(SavableLoaderError, ValueError):
    """An argument or a call sequence the loader does not support.

    Also a ``ValueError``. Example::

        SavableDataLoader(dataset, sampler=my_sampler)   # LoaderUsageError: says why and what to use
    """


class UsageTypeError(LoaderUsageError, TypeError):
    """An argument of the wrong type (a function expected, a value that has no plain
    form), or ``len()`` of something that has none. Also a ``TypeError``, as Python's.

    Example::

        sl.wrappers.MapDataset(source, fn=3)   # UsageTypeError: MapDataset fn must be callable, got 3
    """


class DatasetContractError(LoaderUsageError, NotImplementedError):
    """A :class:`~savable_loader.SavableDataset` breaks its contract in a way that would
    make a resume silently wrong; checked at the first save of each class.

    Also a ``NotImplementedError`` (a subclass that does not implement ``__iter__`` or
    ``config()`` raises it). Example: a wrapper holds its inner dataset but
    ``children()`` does not return it::

        class Bad(sl.SavableDataset):
            def __init__(self, inner):
                super().__init__(inner.worker_config)
                self.inner = inner          # children() returns () : DatasetContractError at the first save
    """


class UndeclaredRngError(LoaderUsageError):
    """A batch drew from a global random generator that the loader's ``global_rngs=``
    does not list: the loader did not re-seed that generator, so the draws would not
    resume exactly. Raised (in the main process, through torch's worker error) for the
    batch that drew; the message names the generator and the setting that fixes it.

    Example::

        loader = SavableDataLoader(ds, batch_size=8, global_rngs=("torch",))
        next(iter(loader))   # ds draws np.random.rand(): UndeclaredRngError, add "numpy"
    """


class UnsavedRngWarning(UserWarning):
    """A :class:`~savable_loader.SavableDataset` holds a random generator that is not
    listed in ``_savable_fields``: its draws will not resume exactly. Given once per
    class and process, at its first save.

    Example::

        class Noisy(sl.SavableDataset):
            _savable_fields = ("pos",)     # self.rng is missing: UnsavedRngWarning
    """


class RestoreKeyError(SavableLoaderError, ValueError):
    """A restore key cannot be turned back into its batch.

    The key is malformed, was made by a loader with another seed or dataset, or the
    pipeline holds a dataset that cannot rebuild samples (``can_restore_sample()`` is
    False; the message gives the reason).

    Example::

        try:
            batch = loader.restore_sample(RestoreKey.parse(line))
        except RestoreKeyError as e:
            print(e)
    """


class DataError(SavableLoaderError, ValueError):
    """The data a source reads is malformed: missing or invalid shard metadata, a shard
    whose length disagrees with it, an unreadable shard, a line that is not JSON.

    The message names the file (and the field or line).

    Also a ``ValueError``. Example::

        try:
            batch = next(it)
        except DataError as e:
            print(e)   # names the shard file and what is wrong with it
    """


class ResumeMismatchError(SavableLoaderError, AssertionError):
    """:func:`savable_loader.testing.check_resume` found a resumed run that differs from
    the uninterrupted one; the message names the save point and the first differing item.

    Also an ``AssertionError``, so test runners report it as a failed check. Example::

        try:
            check_resume(factory)
        except ResumeMismatchError as e:
            print(e)   # save at step 3 (live, after epoch 0, item 2): the resumed run: item 5 ... differs: ...
    """


class InternalError(SavableLoaderError, RuntimeError):
    """An invariant of savable_loader itself does not hold: a bug in the library, not in
    the caller's code. The message says which invariant; please report it.

    Also a ``RuntimeError``. Example::

        raise InternalError("worker 2 sent sample 7 after its end marker")
    """


class IntegrityError(DataError):
    """A file's size, SHA-256 or ETag differs from the value its metadata records: the
    file changed after the metadata was written, or the download is corrupted. Nothing of
    such a file is read.

    ``url`` is the file; ``field`` is ``"size"``, ``"sha256"`` or ``"etag"``; ``expected``
    is the metadata's value and ``found`` the file's. Also a ``DataError`` (and a
    ``ValueError``). Example::

        try:
            batch = next(it)
        except IntegrityError as e:
            print(e.field, e.expected, e.found)   # size 1048576 1049088
    """

    def __init__(
        self,
        message: str,
        url: str = "",
        field: str = "",
        expected: Any = None,
        found: Any = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.field = field
        self.expected = expected
        self.found = found

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.url, self.field, self.expected, self.found))


class StreamTrimmedError(DataError):
    """Entries a restore (or a running reader) needs were removed from the stream
    (``XTRIM``, ``XADD ... MAXLEN``, ``XDEL``): reading on would skip them.

    ``stream`` is the stream, ``needed`` the id the reader resumes after (it must still
    be in the stream), ``first`` the stream's first id now ("" when it is empty).
    Restore from a newer checkpoint (one taken after the trim), or accept the loss
    explicitly by starting a fresh loader. Example::

        try:
            batch = next(it)
        except StreamTrimmedError as e:
            print(e.stream, e.needed, e.first)
    """

    def __init__(self, message: str, stream: str = "", needed: str = "", first: str = "") -> None:
        super().__init__(message)
        self.stream = stream
        self.needed = needed
        self.first = first

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.stream, self.needed, self.first))


class StorageError(SavableLoaderError):
    """Reading from storage (a bucket, a web server, a cache) failed: every attempt of the
    retry policy failed, or the failure cannot be retried (a missing file, a refused
    permission).

    ``url`` is the file, ``byte_range`` the ``(start, end)`` bytes asked for (None for a
    whole file or a request that is not a read), ``attempts`` the attempts made and
    ``cause`` the last failure as text (also the exception's ``__cause__`` where the
    error was raised). A file that differs from its metadata is an
    :class:`IntegrityError` (a :class:`DataError`) instead. Only the message crosses a
    worker process: in the main process the error is re-raised as the same class with
    the worker's traceback in its message, and the attributes are empty there.

    Example::

        try:
            batch = next(it)
        except StorageError as e:
            print(e)   # s3://bucket/train/shard-00007.tar bytes [0, 16777216): 8 attempts in 41.3 s ...
    """

    def __init__(
        self,
        message: str,
        url: str = "",
        byte_range: tuple[int, int] | None = None,
        attempts: int = 0,
        cause: str = "",
    ) -> None:
        super().__init__(message)
        self.url = url
        self.byte_range = byte_range
        self.attempts = attempts
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.url, self.byte_range, self.attempts, self.cause))


class RangeIgnoredError(StorageError):
    """A ranged read came back with more bytes than asked for: the server ignores the
    ``Range`` header (Python's ``http.server`` does) and sent the whole file.

    Not retried: the server will do it again. Serve the files from a server that honours
    ``Range`` (nginx, a bucket), or let whole files be downloaded (the shard cache asks for
    ranges of at most ``chunk_bytes``). Example::

        try:
            storage.read_range("shard-00000.tar", 512, 1024)
        except RangeIgnoredError as e:
            print(e)   # http://host/data/shard-00000.tar bytes [512, 1024): the server sent 30720 bytes ...
    """


class StreamTimeoutError(SavableLoaderError, TimeoutError):
    """A stream source (one that waits for producers) waited longer than its ``timeout``
    for one item.

    ``rank`` is the data-parallel rank, ``position`` the item waited for (an index, an
    entry id), ``waited`` the seconds waited. Raised in the main process; the loader's
    workers are shut down. Like :class:`StorageError`, only the message crosses a worker
    process.

    Example::

        try:
            batch = next(it)
        except StreamTimeoutError as e:
            print(e)   # rank 1 waited 30.0 s for index 4711 of its stream (timeout=30.0) ...
    """

    def __init__(self, message: str, rank: int = -1, position: Any = None, waited: float = 0.0) -> None:
        super().__init__(message)
        self.rank = rank
        self.position = position
        self.waited = waited

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.rank, self.position, self.waited))


class WorkerError(SavableLoaderError, RuntimeError):
    """A worker process failed; ``worker_id`` is its logical id within this rank.

    Also a ``RuntimeError``. Example::

        try:
            batch = next(it)
        except WorkerError as e:
            print(f"worker {e.worker_id} failed: {e}")
    """

    def __init__(self, message: str, worker_id: int | None = None) -> None:
        self.worker_id = worker_id
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.worker_id))


class WorkerDiedError(WorkerError):
    """A worker process exited (killed, crashed) while the loader still needed it.

    Raised by the next loader call (``next``, ``save_state_rank``), never from a signal
    handler. Example::

        try:
            state = loader.save_state_rank()
        except WorkerDiedError as e:
            print(e.worker_id)   # the logical worker that died
    """


class WorkerTimeoutError(WorkerError):
    """A worker did not produce a sample within the loader's ``timeout=`` (a save never
    waits on a worker). Example::

        loader = SavableDataLoader(dataset, batch_size=8, num_workers=2, timeout=30)
    """
