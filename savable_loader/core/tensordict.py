"""TensorDict batches: detect, split along the batch dimension, and hold in a state.

``tensordict`` is optional and never imported here: an object can only be a tensor
collection (a ``TensorDictBase``, a ``@tensorclass`` instance, ``NonTensorData``) if
``tensordict`` is already in ``sys.modules``, so detection looks there first and costs
one dict lookup when it is not.

Splitting (``slice_collection``) is exact and deterministic:

* a ``TensorDict`` is rebuilt key by key (same key order, ``batch_size`` with its first
  dimension cut, same ``device`` and dimension names), each value split in turn;
* a ``LazyStackedTensorDict`` (``NonTensorStack`` included) stacked along dim 0 keeps the
  members ``start:stop``; stacked along another dim, each member is split;
* ``NonTensorData`` (one value for the whole batch) keeps its value;
* jagged nested tensors (``torch.nested``, ``layout=torch.jagged``, ragged dim 1), which
  torch cannot slice along dim 0, become a compact jagged tensor of rows ``start:stop``
  (values from 0, offsets from 0, no ``lengths``);
* other collections (tensorclasses, other ``TensorDictBase`` subclasses) use
  tensordict's own indexing, ``batch[start:stop]``.

A state holds a micro-batch rest that contains any of these as a tagged tree
(``encode_rest`` / ``decode_rest``) of plain values the state schema encodes: tensors,
lists, dicts, strings. Tensorclasses and other collection types are refused by name (a
state never names a class to import).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_convert

from savable_loader.errors import LoaderUsageError, StateError

__all__ = [
    "TAG",
    "collection_size",
    "compare",
    "contains_collection",
    "convert",
    "decode_rest",
    "encode_rest",
    "is_collection",
    "is_jagged",
    "ragged_dim",
    "slice_collection",
    "slice_jagged",
]

#: The key of a dict that holds a tagged tree in a state (the dict has no other key).
TAG = "__savable_tagged__"
_FORM = "tensordict/1"


def is_collection(obj: Any) -> bool:
    """True if ``obj`` is a tensordict tensor collection (never imports ``tensordict``)."""
    td = sys.modules.get("tensordict")
    return td is not None and not isinstance(obj, (torch.Tensor, dict, list, tuple)) and td.is_tensor_collection(obj)


def is_jagged(t: Any) -> bool:
    """True for a nested tensor of layout ``torch.jagged``."""
    return isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged


def collection_size(batch: Any, path: str) -> int:
    """The length of a tensor collection's batch dimension (dim 0 of ``batch_size``)."""
    sizes = batch.batch_size
    if len(sizes) == 0:
        raise LoaderUsageError(
            f"MicroBatchDataset: {path} is a {type(batch).__qualname__} with batch_size [] (no batch dimension "
            "to split); expected batch_size [N, ...]: build it with batch_size=[N], or stack samples "
            "(BatchDataset's default collate stacks TensorDicts)"
        )
    return int(sizes[0])


def ragged_dim(nt: Any) -> int:
    """The ragged dimension of a jagged nested tensor: the one whose size is a symbolic
    (nested) int in its public ``shape``."""
    return next(i for i, size in enumerate(nt.shape) if isinstance(size, torch.SymInt))


def slice_jagged(nt: Any, start: int, stop: int, path: str) -> Any:
    """Rows ``start:stop`` of a jagged nested tensor, compact (see the module docstring)."""
    ragged = ragged_dim(nt)
    if ragged != 1:
        raise LoaderUsageError(
            f"MicroBatchDataset: {path} is a jagged nested tensor ragged along dim {ragged}; expected the ragged "
            "dim 1 (the layout torch.nested.nested_tensor(..., layout=torch.jagged) builds)"
        )
    stop = min(stop, int(nt.shape[0]))
    values, offsets, lengths = nt.values(), nt.offsets(), nt.lengths()
    if lengths is None:
        lo, hi = int(offsets[start]), int(offsets[stop])
        part, new_offsets = values[lo:hi], offsets[start : stop + 1] - offsets[start]
    else:  # rows with holes between them: gather them
        rows = [values[int(offsets[i]) : int(offsets[i]) + int(lengths[i])] for i in range(start, stop)]
        part = torch.cat(rows) if rows else values[:0]
        new_offsets = torch.zeros(stop - start + 1, dtype=offsets.dtype)
        torch.cumsum(lengths[start:stop], 0, out=new_offsets[1:])
    return torch.nested.nested_tensor_from_jagged(part, new_offsets)


def _split_value(value: Any, start: int, stop: int, path: str) -> Any:
    if is_jagged(value):
        return slice_jagged(value, start, stop, path)
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise LoaderUsageError(
                f"MicroBatchDataset: {path} is a nested tensor of layout {value.layout}; expected layout torch.jagged"
            )
        return value[start:stop]
    return slice_collection(value, start, stop, path)


def slice_collection(batch: Any, start: int, stop: int, path: str) -> Any:
    """Samples ``start:stop`` of a tensor collection (see the module docstring)."""
    td = sys.modules["tensordict"]
    cls = type(batch)
    sizes = list(batch.batch_size)
    n = len(range(start, min(stop, collection_size(batch, path))))
    if cls is td.TensorDict:
        return td.TensorDict(
            {k: _split_value(batch.get(k), start, stop, f"{path}[{k!r}]") for k in batch.keys()},  # noqa: SIM118 (iterating walks dim 0)
            batch_size=[n, *sizes[1:]],
            device=batch.device,
            names=_names(batch),
        )
    if isinstance(batch, td.LazyStackedTensorDict):
        if batch.stack_dim == 0:
            members = batch.tensordicts[start:stop]
        else:
            members = [
                slice_collection(m, start, stop, f"{path}.tensordicts[{i}]") for i, m in enumerate(batch.tensordicts)
            ]
        return cls(*members, stack_dim=batch.stack_dim)
    if cls is td.NonTensorData:
        return td.NonTensorData(data=batch.data, batch_size=[n, *sizes[1:]], device=batch.device)
    try:
        return batch[start:stop]
    except Exception as e:
        raise LoaderUsageError(
            f"MicroBatchDataset: {path}, a {cls.__qualname__}, cannot be split along its batch dimension "
            f"({type(e).__name__}: {e})"
        ) from e


def _names(batch: Any) -> list[str | None] | None:
    names = list(batch.names)
    return names if any(n is not None for n in names) else None


# -- in a state -------------------------------------------------------------------------


def contains_collection(value: Any) -> bool:
    """True if ``value`` (a batch rest) needs the tagged form: it holds a tensor collection
    or a jagged tensor, or it is a dict keyed by ``TAG`` itself (which would read as one)."""
    if is_jagged(value) or is_collection(value):
        return True
    if type(value) is dict:
        return TAG in value or any(contains_collection(v) for v in value.values())
    if type(value) in (list, tuple):
        # a list of strings or numbers (a batch's names, ids) is looked at once, at C speed
        return not set(map(type, value)) <= _PLAIN and any(contains_collection(v) for v in value)
    return False


_PLAIN = frozenset({type(None), bool, int, float, str, bytes})


def encode_rest(value: Any, path: str) -> dict[str, Any]:
    """The tagged tree of a rest for which ``contains_collection`` is True."""
    return {TAG: [_FORM, _encode(value, path)]}


def _encode(value: Any, path: str) -> list[Any]:
    cls = type(value)
    if cls is dict:
        return ["dict", {k: _encode(v, f"{path}[{k!r}]") for k, v in value.items()}]
    if cls is list or cls is tuple:
        return [cls.__name__, [_encode(v, f"{path}[{i}]") for i, v in enumerate(value)]]
    if is_jagged(value):
        compact = slice_jagged(value, 0, int(value.shape[0]), path)
        return ["jagged", compact.values(), compact.offsets()]
    if not is_collection(value):
        return ["leaf", value]  # the state's own checks apply to it
    td = sys.modules["tensordict"]
    if value.device is not None and str(value.device) != "cpu":  # a restore could not put it back there
        raise StateError(
            f"state field {path} holds a {cls.__qualname__} on device {value.device}; a state holds CPU "
            "collections only (expected device None or cpu): micro-batch on the CPU and move batches after the loader"
        )
    if cls is td.TensorDict:
        device = None if value.device is None else str(value.device)
        keys = list(value.keys())
        items = [_encode(value.get(k), f"{path}[{k!r}]") for k in keys]
        return ["td", list(value.batch_size), device, _names(value), keys, items]
    if cls in (td.LazyStackedTensorDict, td.NonTensorStack):
        members = [_encode(m, f"{path}.tensordicts[{i}]") for i, m in enumerate(value.tensordicts)]
        return ["lazy", cls is td.NonTensorStack, value.stack_dim, members]
    if cls is td.NonTensorData:
        device = None if value.device is None else str(value.device)
        return ["nontensor", list(value.batch_size), device, _encode(value.data, f"{path}.data")]
    raise StateError(
        f"state field {path} holds a {cls.__qualname__}, which a state cannot give back identical (a state holds "
        "TensorDict, LazyStackedTensorDict, NonTensorData and NonTensorStack, nested, with tensors and jagged "
        "nested tensors: convert it with .to_tensordict(), or micro-batch whole batches)"
    )


def decode_rest(value: Any) -> Any:
    """The rest a tagged tree stands for; any other value as it is."""
    if type(value) is not dict or TAG not in value:
        return value
    tagged = value[TAG]
    if len(value) != 1 or not isinstance(tagged, list) or len(tagged) != 2 or tagged[0] != _FORM:
        raise StateError(f"MicroBatchDataset.rest: a tagged rest must be {{{TAG!r}: [{_FORM!r}, tree]}}")
    return _decode(tagged[1], "MicroBatchDataset.rest")


def _bad(path: str, node: Any) -> StateError:
    text = repr(node)
    return StateError(f"state field {path}: malformed tagged node {text[:200]}")


_OPTIONAL_STR = (str, type(None))
#: The types of the arguments of each kind of node.
_NODES: dict[str, tuple[Any, ...]] = {
    "dict": (dict,),
    "list": (list,),
    "tuple": (list,),
    "leaf": (object,),
    "jagged": (torch.Tensor, torch.Tensor),
    "td": (list, _OPTIONAL_STR, (list, type(None)), list, list),
    "lazy": (bool, int, list),
    "nontensor": (list, _OPTIONAL_STR, list),
}


def _decode(node: Any, path: str) -> Any:
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise _bad(path, node)
    kind, args = node[0], node[1:]
    want = _NODES.get(kind)
    if want is None or len(args) != len(want) or not all(isinstance(a, w) for a, w in zip(args, want)):
        raise _bad(path, node)
    if kind == "leaf":
        return args[0]
    if kind == "dict":
        return {k: _decode(v, f"{path}[{k!r}]") for k, v in args[0].items()}
    if kind in ("list", "tuple"):
        items = [_decode(v, f"{path}[{i}]") for i, v in enumerate(args[0])]
        return items if kind == "list" else tuple(items)
    try:
        return _decode_tensors(kind, args, path)
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as e:
        raise StateError(f"state field {path}: cannot rebuild a {kind} node ({type(e).__name__}: {e})") from e


def _decode_tensors(kind: str, args: list[Any], path: str) -> Any:
    if kind == "jagged":
        values, offsets = args
        if offsets.ndim != 1 or offsets.dtype != torch.int64 or not offsets.numel() or int(offsets[0]) != 0:
            raise StateError(f"state field {path}: jagged offsets must be a 1-D int64 tensor from 0")
        if values.ndim < 1 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != values.shape[0]:
            raise StateError(f"state field {path}: jagged offsets do not fit values of shape {tuple(values.shape)}")
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    import tensordict as td  # a state holds a collection: rebuilding it needs tensordict

    if kind == "td":
        sizes, device, names, keys, items = args
        if len(keys) != len(items) or not all(isinstance(k, str) for k in keys) or device not in (None, "cpu"):
            raise StateError(f"state field {path}: malformed TensorDict node (keys {keys!r}, device {device!r})")
        source = {k: _decode(v, f"{path}[{k!r}]") for k, v in zip(keys, items)}
        return td.TensorDict(source, batch_size=sizes, device=device, names=names)
    if kind == "lazy":
        non_tensor, stack_dim, members = args
        cls = td.NonTensorStack if non_tensor else td.LazyStackedTensorDict
        return cls(*(_decode(m, f"{path}.tensordicts[{i}]") for i, m in enumerate(members)), stack_dim=stack_dim)
    sizes, device, data = args
    if device not in (None, "cpu"):
        raise StateError(f"state field {path}: malformed NonTensorData node (device {device!r})")
    return td.NonTensorData(data=_decode(data, f"{path}.data"), batch_size=sizes, device=device)


# -- comparing (savable_loader.testing.assert_same) --------------------------------------


def compare(a: Any, b: Any, path: str, same: Callable[[Any, Any, str], None], fail: Callable[[str], None]) -> None:
    """Compare two tensor collections or two jagged tensors of the same type, leaf by leaf:
    ``same`` compares the parts, ``fail`` reports a difference. Jagged tensors compare
    their rows (dtype and shape included); collections their ``batch_size``, device,
    dimension names, keys in order and values; lazy stacks their stack dim and members;
    ``NonTensorData`` its value."""
    if is_jagged(a):
        if a.dtype != b.dtype or ragged_dim(a) != ragged_dim(b) or a.shape[0] != b.shape[0]:
            fail(f"{path}: jagged {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        for i, (x, y) in enumerate(zip(a.unbind(), b.unbind())):
            same(x, y, f"{path}[{i}]")
        return
    td = sys.modules["tensordict"]
    for what in ("batch_size", "device"):
        if getattr(a, what) != getattr(b, what):
            fail(f"{path}: {what} {getattr(a, what)} vs {getattr(b, what)}")
    if isinstance(a, td.LazyStackedTensorDict):
        if a.stack_dim != b.stack_dim or len(a.tensordicts) != len(b.tensordicts):
            fail(
                f"{path}: a lazy stack of {len(a.tensordicts)} along dim {a.stack_dim} vs "
                f"{len(b.tensordicts)} along dim {b.stack_dim}"
            )
        for i, (x, y) in enumerate(zip(a.tensordicts, b.tensordicts)):
            same(x, y, f"{path}.tensordicts[{i}]")
        return
    if type(a) is td.NonTensorData:
        same(a.data, b.data, f"{path}.data")
        return
    if _names(a) != _names(b) or list(a.keys()) != list(b.keys()):
        fail(f"{path}: names {_names(a)}, keys {list(a.keys())} vs names {_names(b)}, keys {list(b.keys())}")
    for k in a.keys():  # noqa: SIM118 (iterating a TensorDict walks its batch dim)
        same(a.get(k), b.get(k), f"{path}[{k!r}]")


def convert(data: Any) -> Any:
    """torch's ``default_convert`` (what a loader with ``batch_size=None`` applies to
    each item), except that tensor collections and jagged tensors pass as they are, inside
    dicts, lists and tuples too: torch's function iterates a ``TensorDict`` as a mapping,
    but iterating one walks its batch dimension, so it fails on any batched TensorDict."""
    if "tensordict" not in sys.modules or not contains_collection(data):  # (torch keeps jagged tensors as they are)
        return default_convert(data)
    if is_collection(data) or is_jagged(data):
        return data
    if type(data) is dict:
        return {k: convert(v) for k, v in data.items()}
    if type(data) is list:
        return [convert(v) for v in data]
    return tuple(convert(v) for v in data)  # contains_collection looks into nothing else
