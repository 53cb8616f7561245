"""State schema, encoding and files. Imports only msgspec and the standard library.

May import: ``errors``, ``_version`` (msgspec and the standard library; never torch).

Example::

    import savable_loader as sl
    sl.state.save_file("loader.state", loader.save_state_rank())
    loader.restore_state_rank(sl.state.load_file("loader.state"))
"""

from savable_loader.state.codec import decode, encode
from savable_loader.state.files import load_file, save_file
from savable_loader.state.schema import (
    SCHEMA_VERSION,
    ArrayValue,
    DatasetState,
    GlobalState,
    IndexPosition,
    IndexStage,
    LoaderConfig,
    PipelinePosition,
    RankState,
    RestoreKey,
    TupleValue,
    WorkerState,
)

__all__ = [
    "ArrayValue",
    "DatasetState",
    "GlobalState",
    "IndexPosition",
    "IndexStage",
    "LoaderConfig",
    "PipelinePosition",
    "RankState",
    "RestoreKey",
    "SCHEMA_VERSION",
    "TupleValue",
    "WorkerState",
    "decode",
    "encode",
    "load_file",
    "save_file",
]
