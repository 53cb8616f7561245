"""The state schema: msgspec Structs, keyword-only, versioned.

A loader's state for one data-parallel rank is a :class:`RankState`; a checkpoint of all
ranks gathered to one is a :class:`GlobalState` (``list[RankState]`` in the API). Only
msgspec and the standard library are imported here, so a state can be read and inspected
without torch.

Example::

    state = RankState(config=..., position=IndexPosition(epoch=0, consumed=64, dataset_len=1000))
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from savable_loader.errors import RestoreKeyError

__all__ = [
    "ARRAY_TYPECODES",
    "ORDER_ALGORITHM",
    "SCHEMA_VERSION",
    "ArrayValue",
    "DatasetState",
    "GlobalState",
    "IndexPosition",
    "IndexStage",
    "LoaderConfig",
    "PipelinePosition",
    "RankState",
    "RestoreKey",
    "SamplerState",
    "TupleValue",
    "WorkerState",
]

#: Version of the state schema this library writes. Bumped on any incompatible change;
#: older versions stay decodable (see tests/data/ for the kept fixtures).
SCHEMA_VERSION = 1

#: The epoch order every state this library writes records (``LoaderConfig.order_algorithm``)
#: and drop-in restore keys name: the keyed Feistel permutation of
#: ``savable_loader/index/permutation.py``, the only order this version has.
ORDER_ALGORITHM = "feistel-1"

#: Typecodes of Python ``array.array`` values an :class:`ArrayValue` may hold (library
#: ``"array"``), with their item sizes: those whose size is the same on every platform
#: (``"l"`` / ``"L"`` are 4 or 8 bytes, ``"u"`` / ``"w"`` hold text).
ARRAY_TYPECODES = {"b": 1, "B": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8, "f": 4, "d": 8}

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class ArrayValue:
    """A tensor, NumPy array, NumPy scalar or ``array.array`` inside a dataset state:
    library, dtype, shape, raw bytes.

    ``library`` is ``"torch"``, ``"numpy"``, ``"numpy-scalar"`` (a NumPy scalar such as
    ``np.float32(1.5)``, shape ``()``; dtypes ``"str"`` and ``"bytes"`` hold ``np.str_``
    as UTF-8 and ``np.bytes_`` as they are) or ``"array"`` (a Python ``array.array``:
    ``dtype`` is its typecode, one of :data:`ARRAY_TYPECODES`, shape ``(len,)``; a
    reader from before this library existed refuses such a state, naming it). Data is
    little-endian, except for NumPy dtypes written with a leading ``">"`` (big-endian
    arrays). Stored as a MessagePack
    extension (code 1), never as a pickle. A plain class rather than a Struct so that
    msgspec hands it to the codec's extension hook.

    Example::

        ArrayValue(library="numpy", dtype="int64", shape=(2,), data=np.arange(2).tobytes())
        ArrayValue(library="numpy-scalar", dtype="float32", shape=(), data=b"\x00\x00\xc0?")  # 1.5
        ArrayValue(library="array", dtype="q", shape=(2,), data=array.array("q", [7, -1]).tobytes())
    """

    __slots__ = ("data", "dtype", "library", "shape")

    def __init__(self, *, library: str, dtype: str, shape: tuple[int, ...], data: bytes) -> None:
        self.library = library
        self.dtype = dtype
        self.shape = tuple(shape)
        self.data = bytes(data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrayValue):
            return NotImplemented
        return (self.library, self.dtype, self.shape, self.data) == (
            other.library,
            other.dtype,
            other.shape,
            other.data,
        )

    def __hash__(self) -> int:
        return hash((self.library, self.dtype, self.shape, self.data))

    def __repr__(self) -> str:
        return f"ArrayValue(library={self.library!r}, dtype={self.dtype!r}, shape={self.shape}, {len(self.data)} bytes)"


class TupleValue:
    """A tuple inside a dataset state (MessagePack arrays decode as lists): its items.

    Stored as a MessagePack extension (code 2) whose payload is the MessagePack array of
    the items, so a tuple comes back as a tuple.

    Example::

        TupleValue([1, "a", [2, 3]])   # the state form of (1, "a", [2, 3])
    """

    __slots__ = ("items",)

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TupleValue):
            return NotImplemented
        return self.items == other.items

    __hash__ = None  # type: ignore[assignment]  # holds lists

    def __repr__(self) -> str:
        return f"TupleValue({self.items!r})"


class DatasetState(msgspec.Struct, kw_only=True):
    """One node of a pipeline's state tree, tagged with the class that made it.

    ``fields`` holds plain values (None, bool, int, float, str, bytes, lists, dicts,
    :class:`ArrayValue`, :class:`TupleValue`); ``children`` the states of the datasets
    this one wraps.

    Example::

        DatasetState(type="mymodule.Lines", fields={"pos": 12}, children=[])
    """

    type: str
    fields: dict[str, Any] = {}
    children: list[DatasetState] = []


class LoaderConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The configuration a state was saved under; a restore compares it field by field.

    Example::

        state = loader.save_state_rank()
        state.config.seed, state.config.num_workers, state.config.dataset_config
    """

    rank: NonNeg
    world_size: Positive
    num_workers: NonNeg
    seed: int
    batch_size: Positive | None
    shuffle: bool
    drop_last: bool
    dataset_fingerprint: str
    dataset_config: dict[str, Any] = {}
    #: Version of the per-item seed formula (``savable_loader.rng.SEED_FORMULA``, 3): the
    #: only one this version writes and restores. The default, 1, is what a state written
    #: before the field existed holds; a state of another formula was written by an
    #: unreleased version and is refused (``StateError``).
    seed_formula: Positive = 1
    #: Drop-in path: ``""`` when the loader builds the order itself, else the qualified
    #: class name of the sampler (or batch sampler) that decides it.
    sampler: str = ""
    #: Drop-in path: when the global (and dataset-owned) RNGs are re-seeded, ``"sample"``
    #: (before every sample; the default, and all earlier versions did) or ``"batch"``
    #: (before every batch's first sample: ``SavableDataLoader(reseed="batch")``).
    reseed: str = "sample"
    #: How the drop-in path orders an epoch: :data:`ORDER_ALGORITHM` (``"feistel-1"``, the
    #: constant-memory keyed bijection of ``savable_loader/index/permutation.py``), the
    #: only order this version has, which every state records (pipelines' too). The
    #: default, ``"numpy-permutation"``, is what a state written before the field existed
    #: holds; a state of another order was written by an unreleased version and is
    #: refused (``StateError``).
    order_algorithm: str = "numpy-permutation"
    #: The global RNGs re-seeded per sample, sorted (``SavableDataLoader(global_rngs=...)``;
    #: drop-in path: before every sample; pipelines and IterableDatasets: in ``mark_sample``
    #: and before every item); all three by default, as earlier versions did.
    global_rngs: list[str] = msgspec.field(default_factory=lambda: ["numpy", "random", "torch"])


class IndexStage(msgspec.Struct, kw_only=True, frozen=True):
    """A finished part of an epoch on the drop-in path, ended by a world-size change.

    ``consumed[r]`` samples of rank ``r``'s share had been yielded by the ``world_size``
    ranks when the state was saved.

    Example::

        IndexStage(world_size=4, consumed=[64, 64, 48, 48])   # 4 ranks, then a restore on 2
    """

    world_size: Positive
    consumed: list[NonNeg]


class SamplerState(msgspec.Struct, kw_only=True, frozen=True):
    """Drop-in path with a sampler of the user's: what decided its order when the epoch's
    iteration started, and a digest of the items consumed since.

    ``rngs`` maps attribute paths (``"sampler.generator"``) to the states of the random
    generators the sampler holds, ``epochs`` maps attribute paths to their ``epoch``
    values (``DistributedSampler.set_epoch``), ``state`` is the sampler's own
    ``state_dict()`` when it has one, and ``digest`` hashes the dataset indices consumed
    so far (a restore replays the sampler and compares). ``private_rng``: the sampler
    drew from the global RNGs, which the loader replaces by a stream seeded from
    ``(seed, epoch)`` around every draw. ``at_start``: recorded between epochs (the
    position is the start of ``epoch``): a restore puts the record back and starts the
    epoch as an uninterrupted run would.

    Example::

        SamplerState(rngs={"generator": {"kind": "torch", ...}}, digest="9f2c...")
    """

    rngs: dict[str, Any] = {}
    epochs: dict[str, int] = {}
    state: Any = None
    digest: str = ""
    private_rng: str = ""
    at_start: bool = False


class IndexPosition(msgspec.Struct, kw_only=True, frozen=True, tag="index"):
    """Drop-in path: ``consumed`` samples of this rank's share of ``epoch`` were yielded.

    ``stages`` is empty unless the epoch was resumed on another world size: then the
    rank's share is its part of the samples the earlier stages left (see
    ``savable_loader/core/elastic.py``). With a sampler of the user's, ``consumed`` counts the
    items drawn from it (indices, or batches of a batch sampler) and ``sampler`` holds
    what decided its order.

    Example::

        IndexPosition(epoch=1, consumed=224, dataset_len=250)
    """

    epoch: NonNeg
    consumed: NonNeg
    dataset_len: NonNeg
    stages: list[IndexStage] = []
    sampler: SamplerState | None = None


class WorkerState(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of a savable pipeline.

    ``index`` samples of the epoch were yielded from this worker. ``dataset`` is the
    pipeline state captured after ``snapshot_index`` samples (None: the epoch's start,
    ``snapshot_index`` 0); a restore puts it back and replays ``index - snapshot_index``
    samples (the skip offset). ``exhausted``: the worker had no more data this epoch
    (``dataset`` is then its state at the end of the epoch, when the pipeline carries
    state across epochs, else None).

    ``carried`` (with ``dataset`` None, pipelines with an ``EpochizeDataset``): the
    worker's pipeline state at the end of the previous epoch, which this epoch goes on
    from; the worker restores it and then starts the epoch, instead of replaying the
    earlier epochs. None: the epoch starts from scratch.

    Example::

        w = WorkerState(worker_id=0, index=10, snapshot_index=8, dataset=DatasetState(type="m.Lines"))
        w.skip   # 2
    """

    worker_id: NonNeg
    index: NonNeg
    snapshot_index: NonNeg
    dataset: DatasetState | None = None
    exhausted: bool = False
    carried: DatasetState | None = None

    @property
    def skip(self) -> int:
        """Samples to replay after restoring ``dataset``."""
        return self.index - self.snapshot_index


class PipelinePosition(msgspec.Struct, kw_only=True, frozen=True, tag="pipeline"):
    """Savable-pipeline path: per-worker states and the logical worker that yields next.

    ``workers`` holds one state per logical worker: as many as the ``num_workers`` the
    epoch started with (at least 1), which after a restore under another
    ``num_workers`` may differ from ``LoaderConfig.num_workers`` (the logical workers
    were then hosted by the loader's workers, see ``savable_loader/pipeline/hosting.py``);
    ``next_worker`` is then the lowest logical worker of the hosting worker that yields
    next.

    Example::

        position = loader.save_state_rank().position
        [w.skip for w in position.workers], position.next_worker
    """

    epoch: NonNeg
    next_worker: NonNeg
    workers: list[WorkerState]


class RankState(msgspec.Struct, kw_only=True, frozen=True, tag="rank", tag_field="kind"):
    """The whole state of one rank's loader.

    Example::

        state = loader.save_state_rank()
        state.epoch, state.position, state.config.world_size, state.schema_version
    """

    config: LoaderConfig
    position: IndexPosition | PipelinePosition
    schema_version: Positive = SCHEMA_VERSION
    library_version: str = ""

    @property
    def epoch(self) -> int:
        """The epoch in progress (or about to start) when the state was saved."""
        return self.position.epoch


class GlobalState(msgspec.Struct, kw_only=True, frozen=True, tag="global", tag_field="kind"):
    """The states of every data-parallel rank, ordered by rank.

    The API hands gathered states around as ``list[RankState]``; this is their encoded
    form. Example::

        data = encode([state0, state1])   # a GlobalState on the wire
        decode(data)                      # [state0, state1]
    """

    ranks: list[RankState]
    schema_version: Positive = SCHEMA_VERSION
    library_version: str = ""


class RestoreKey(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Names one batch a loader yielded, so that it can be rebuilt alone.

    Read it as ``loader.restore_key`` right after a batch, keep it (``str(key)`` is a
    line of JSON, ``RestoreKey.parse(text)`` reads it back) and hand it to
    ``loader.restore_sample(key)`` to get the same batch again, bit for bit, without
    iterating. ``kind`` is ``"index"`` (drop-in path: the batch's global sample
    ``positions`` in the epoch's order, as ``(start, stop, step)`` ranges) or
    ``"pipeline"`` (the logical ``worker``, its item ``index`` in the epoch and the
    pipeline's own ``sample`` key). ``seed`` and ``fingerprint`` (of the dataset
    configuration) let a loader refuse a key made by another one, as do the settings
    that decide which data a key names: ``shuffle`` and ``batched`` (``batch_size`` not
    None) for ``"index"`` keys, whose ``world_size`` bounds their positions;
    ``world_size`` and ``num_workers`` for ``"pipeline"`` keys (the sources split the data
    by them). Keys made before these fields existed have them None: an ``"index"`` key
    without ``shuffle`` is refused (it cannot tell which order it names), the others are
    checked as before. ``order_algorithm``: which shuffle the positions of an ``"index"``
    key of the loader's own order refer to, and ``seed_formula``: which per-item seeds the
    key's sample drew from; a key that names another order or formula than this
    version's (or, for ``seed_formula``, none) was made by an unreleased version and is
    refused.

    Example::

        key = RestoreKey.parse('{"kind":"index","seed":0,"fingerprint":"ab","epoch":1,"rank":0,'
                               '"positions":[[0,64,2]],"shuffle":true,"batched":true,"world_size":2}')
        key.sample_positions()  # [0, 2, 4, ..., 62]
    """

    kind: Literal["index", "pipeline"]
    seed: int
    fingerprint: str
    epoch: NonNeg
    rank: NonNeg
    positions: list[tuple[NonNeg, NonNeg, Positive]] = []
    worker: NonNeg = 0
    index: NonNeg = 0
    sample: Any = None
    shuffle: bool | None = None
    batched: bool | None = None
    world_size: Positive | None = None
    num_workers: NonNeg | None = None
    #: ``"index"`` keys of the loader's own order: the epoch order the positions refer to
    #: (:data:`ORDER_ALGORITHM`; see ``LoaderConfig.order_algorithm``). Keys of a sampler
    #: of the user's and pipeline keys leave the default out of ``str(key)``.
    order_algorithm: str = "numpy-permutation"
    #: ``"index"`` keys: ``LoaderConfig.reseed`` of the loader that made the key.
    reseed: str = "sample"
    #: ``LoaderConfig.global_rngs`` of the loader that made the key (the default, all
    #: three, is left out of ``str(key)``).
    global_rngs: tuple[str, ...] = ("numpy", "random", "torch")
    #: The seed formula of the loader that made the key (``LoaderConfig.seed_formula``):
    #: ``rng.SEED_FORMULA``. Keys made before the field existed have None; a key of
    #: another formula or none was made by an unreleased version and is refused.
    seed_formula: Positive | None = None

    def __str__(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def parse(cls, text: str | bytes) -> RestoreKey:
        """A key from ``str(key)`` (one line of JSON)."""
        try:
            return msgspec.json.decode(text, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
            if isinstance(text, (bytes, bytearray, memoryview)):
                text = bytes(text).decode("utf-8", "replace")
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise RestoreKeyError(f"not a restore key: {e} (got {shown!r})") from None

    def sample_positions(self) -> list[int]:
        """The global positions of an ``"index"`` key's samples, in batch order."""
        return [p for start, stop, step in self.positions for p in range(start, stop, step)]
