"""``savable-loader inspect FILE [--json]``: summarise a state file without torch.

Reads a file written by :func:`savable_loader.state.save_file` (header, checksum, then
the MessagePack state), or raw encoded state bytes without the header, such as a value
of ``loader.state_dict()`` or the output of :func:`savable_loader.state.encode` written
to a file. Either holds one rank's state or the gathered states of all ranks.

:func:`summarize` builds one JSON-ready document (its keys are listed in
:data:`DOCUMENT_KEYS` and described in docs/debugging.md); :func:`render_text` turns it into the
human-readable summary. Struct fields this module does not know (added by a later
schema) are rendered generically, so the command keeps working as the schema grows.
Only the standard library, msgspec and :mod:`savable_loader.state` are imported.

Example::

    doc = summarize(read_state("ckpt/loader.state"), "ckpt/loader.state")
    print(render_text(doc))
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from savable_loader.errors import StateError
from savable_loader.state.codec import decode, encode_part
from savable_loader.state.files import FILE_FORMAT, MAGIC, load_file
from savable_loader.state.schema import ArrayValue, DatasetState, RankState, TupleValue, WorkerState

__all__ = ["DOCUMENT_KEYS", "FORMAT", "StateBlob", "read_state", "render_text", "summarize"]

#: Version of the ``--json`` document layout; bumped if a key changes meaning or goes away.
FORMAT = 1
#: Top-level keys of the ``--json`` document, always present.
DOCUMENT_KEYS = (
    "format",
    "file",
    "container",
    "file_size",
    "encoded_size",
    "kind",
    "schema_version",
    "library_version",
    "world_size",
    "num_ranks",
    "ranks",
)
_SHORT_STR = 48  # strings up to this length are shown in full in a dataset state outline
_WIDTH = 16  # label column of the text rendering
_MSGPACK_MAPS = {*range(0x80, 0x90), 0xDE, 0xDF}  # first byte of a MessagePack map
_HEADER_SIZE = len(MAGIC) + 4 + 8 + 32  # magic, format, payload length, BLAKE2b-256 (files.py)


class StateBlob(NamedTuple):
    """A state read from disk: the decoded state plus where and how it was stored."""

    state: RankState | list[RankState]
    container: str  # "state-file" (with header and checksum) or "raw" (MessagePack only)
    file_size: int
    payload: bytes  # the encoded (MessagePack) state


class _TopFields(msgspec.Struct):
    """Top-level fields that ``decode`` drops for a gathered state."""

    schema_version: int = 0
    library_version: str = ""


def read_state(path: str | os.PathLike[str]) -> StateBlob:
    """Read a state file or raw encoded state bytes; :class:`StateError` names what is wrong."""
    target = Path(path)
    try:
        if target.is_dir():
            raise StateError(f"{target}: is a directory, expected a state file")
        data = target.read_bytes()
    except FileNotFoundError as e:
        raise StateError(f"{target}: no such file") from e
    except OSError as e:
        raise StateError(f"{target}: cannot read: {e.strerror or e}") from e
    if not data:
        raise StateError(f"{target}: file is empty, expected a state file")
    if data[: len(MAGIC)] == MAGIC[: len(data)]:
        state = load_file(target)  # checks header, length and checksum; messages name the file
        return StateBlob(state, "state-file", len(data), data[_HEADER_SIZE:])
    try:
        state = decode(data)
    except StateError as e:
        raise StateError(f"{target}: {_not_a_state(data, e)}") from e
    return StateBlob(state, "raw", len(data), data)


def _not_a_state(data: bytes, error: StateError) -> str:
    if data[:4] == b"PK\x03\x04":
        return (
            "a zip archive (torch.save?), not a state file: write a state with "
            "savable_loader.state.save_file, or the bytes of a loader.state_dict() value"
        )
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            json.loads(data)
        except ValueError:
            pass
        else:
            return "a JSON file, not a state file (states are MessagePack)"
    reason = str(error).removeprefix("not a savable_loader state: ")
    if data[0] in _MSGPACK_MAPS:  # looks like raw encoded bytes, but they do not decode
        return f"raw encoded state bytes (no file header) that do not decode: {reason}"
    return (
        f"not a savable_loader state: neither a state file (magic {MAGIC!r}, found "
        f"{data[: len(MAGIC)]!r}) nor raw encoded state bytes ({reason})"
    )


# -- the document -------------------------------------------------------------------------


def summarize(blob: StateBlob, file: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``--json`` document for ``blob`` read from ``file`` (keys: :data:`DOCUMENT_KEYS`)."""
    top = msgspec.msgpack.decode(blob.payload, type=_TopFields, ext_hook=lambda code, data: None)
    ranks = blob.state if isinstance(blob.state, list) else [blob.state]
    return {
        "format": FORMAT,
        "file": str(file),
        "container": blob.container,
        "file_size": blob.file_size,
        "encoded_size": len(blob.payload),
        "kind": "global" if isinstance(blob.state, list) else "rank",
        "schema_version": top.schema_version,
        "library_version": top.library_version,
        "world_size": ranks[0].config.world_size if ranks else None,
        "num_ranks": len(ranks),
        "ranks": [_rank(r) for r in ranks],
    }


def _rank(state: RankState) -> dict[str, Any]:
    config, position = state.config, state.position
    out: dict[str, Any] = {
        "rank": config.rank,
        "path": _tag(position),
        "epoch": position.epoch,
        "num_workers": config.num_workers,
        "encoded_size": len(encode_part(state)),
        "schema_version": state.schema_version,
        "library_version": state.library_version,
        "config": _plain(config),
        "position": _plain(position),
    }
    known = {"config", "position", "schema_version", "library_version"}
    extra = {f: _plain(getattr(state, f)) for f in state.__struct_fields__ if f not in known}
    if extra:
        out["extra"] = extra
    return out


def _tag(obj: msgspec.Struct) -> Any:
    return obj.__struct_config__.tag


def _plain(value: Any) -> Any:
    """``value`` as JSON-ready builtins; dataset states become outlines, arrays summaries."""
    if isinstance(value, DatasetState):
        return _outline(value)
    if isinstance(value, ArrayValue):
        return _value(value)
    if isinstance(value, TupleValue):
        return [_plain(v) for v in value.items]
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        tag = _tag(value)
        if tag is not None:
            out[value.__struct_config__.tag_field or "type"] = tag
        out.update((f, _plain(getattr(value, f))) for f in value.__struct_fields__)
        if isinstance(value, WorkerState):
            out["skip"] = value.skip
            out["dataset_size"] = len(encode_part(value.dataset)) if value.dataset is not None else 0
            out["carried_size"] = len(encode_part(value.carried)) if value.carried is not None else 0
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return msgspec.to_builtins(value)


def _outline(node: DatasetState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": node.type,
        "size": len(encode_part(node)),
        "fields": {str(name): _value(v) for name, v in node.fields.items()},
        "children": [_outline(c) for c in node.children],
    }
    for f in node.__struct_fields__:
        if f not in out:
            out[f] = _plain(getattr(node, f))
    return out


def _value(value: Any) -> dict[str, Any]:
    """A short description of one dataset state field: its type, encoded size, a preview."""
    out: dict[str, Any] = {"type": type(value).__name__, "size": len(encode_part(value))}
    if isinstance(value, ArrayValue):
        out.update(type="array", library=value.library, dtype=value.dtype, shape=list(value.shape))
    elif value is None or isinstance(value, (bool, int, float)):
        out["value"] = value
    elif isinstance(value, str):
        out["length"] = len(value)
        if len(value) <= _SHORT_STR:
            out["value"] = value
    elif isinstance(value, (bytes, bytearray, dict)):
        out["length"] = len(value)
    elif isinstance(value, (list, tuple, TupleValue)):
        items = value.items if isinstance(value, TupleValue) else value
        if isinstance(value, TupleValue):
            out["type"] = "tuple"
        out["length"] = len(items)
        out["item_types"] = sorted({_item_type(v) for v in items})
    return out


def _item_type(value: Any) -> str:
    if isinstance(value, ArrayValue):
        return "array"
    if isinstance(value, TupleValue):
        return "tuple"
    return type(value).__name__


# -- text ---------------------------------------------------------------------------------


def render_text(doc: dict[str, Any]) -> str:
    """The human-readable summary of a :func:`summarize` document."""
    lines = [f"savable_loader state: {doc['file']}"]
    add = _adder(lines, "  ")
    if doc["container"] == "state-file":
        add("file", f"{doc['file_size']:,} bytes: state file format {FILE_FORMAT}, checksum ok")
    else:
        add("file", f"{doc['file_size']:,} bytes: raw encoded state (no file header, no checksum)")
    add("encoded state", f"{doc['encoded_size']:,} bytes of MessagePack")
    if doc["kind"] == "global":
        add("kind", f"global: the gathered states of {doc['num_ranks']} ranks")
    else:
        add("kind", "rank: one rank's state")
    add("schema version", f"{doc['schema_version']} (written by savable-loader {doc['library_version'] or '?'})")
    add("world size", doc["world_size"])
    add("ranks", ", ".join(str(r["rank"]) for r in doc["ranks"]) or "none")
    for rank in doc["ranks"]:
        lines.append("")
        _render_rank(lines, rank)
    return "\n".join(lines)


def _adder(lines: list[str], indent: str) -> Callable[[str, Any], None]:
    def add(label: str, value: Any) -> None:
        lines.append(f"{indent}{label:<{_WIDTH}}{value}")

    return add


def _render_rank(lines: list[str], rank: dict[str, Any]) -> None:
    lines.append(f"rank {rank['rank']} ({rank['encoded_size']:,} bytes encoded)")
    add = _adder(lines, "  ")
    position = dict(rank["position"])
    path = position.pop("type", rank["path"])
    add(
        "path",
        {"index": "index (drop-in, map-style dataset)", "pipeline": "pipeline (savable pipeline)"}.get(path, path),
    )
    add("epoch", position.pop("epoch", rank["epoch"]))
    add("workers", rank["num_workers"])
    if path == "index" and "consumed" in position:
        consumed, length = position.pop("consumed"), position.pop("dataset_len", "?")
        add("consumed", f"{consumed} samples of this rank's share of the epoch (dataset length {length})")
    workers = position.pop("workers", None) if path == "pipeline" else None
    if path == "pipeline" and "next_worker" in position:
        add("next worker", position.pop("next_worker"))
    for name, value in position.items():
        add(name.replace("_", " "), _compact(value))
    config = dict(rank["config"])
    config.pop("dataset_config", None)
    fingerprint = config.pop("dataset_fingerprint", None)
    add("config", " ".join(f"{k}={_compact(v)}" for k, v in config.items()))
    if fingerprint is not None:
        add("fingerprint", fingerprint)
    if rank["config"].get("dataset_config"):
        add("dataset config", _compact(rank["config"]["dataset_config"], limit=100))
    for name, value in rank.get("extra", {}).items():
        add(name.replace("_", " "), _compact(value))
    for worker in workers or []:
        _render_worker(lines, worker)


def _render_worker(lines: list[str], worker: dict[str, Any]) -> None:
    worker = dict(worker)
    wid, dataset = worker.pop("worker_id", "?"), worker.pop("dataset", None)
    index, snap, skip = worker.pop("index", "?"), worker.pop("snapshot_index", "?"), worker.pop("skip", "?")
    exhausted, size = worker.pop("exhausted", False), worker.pop("dataset_size", 0)
    carried, carried_size = worker.pop("carried", None), worker.pop("carried_size", 0)
    text = f"consumed {index}, snapshot at {snap} (skip {skip})"
    if exhausted:
        text += ", exhausted"
    text += "".join(f", {k}={_compact(v)}" for k, v in worker.items())
    if dataset is not None:
        text += f"; dataset state {size:,} bytes"
    elif carried is not None:
        text += f"; epoch start from the previous epoch's end state ({carried_size:,} bytes)"
    else:
        text += "; no dataset state (epoch start)"
    _adder(lines, "  ")(f"worker {wid}", text)
    if dataset is not None:
        _render_node(lines, dataset, "    ")
    elif carried is not None:
        _render_node(lines, carried, "    ")


def _render_node(lines: list[str], node: dict[str, Any], indent: str) -> None:
    extras = {k: v for k, v in node.items() if k not in ("type", "size", "fields", "children")}
    head = f"{indent}{node['type']} ({node['size']:,} B)"
    head += "".join(f" {k}={_compact(v)}" for k, v in extras.items())
    lines.append(head)
    for name, value in node["fields"].items():
        lines.append(f"{indent}  .{name}: {_describe(value)}")
    for child in node["children"]:
        _render_node(lines, child, indent + "  ")


def _describe(value: dict[str, Any]) -> str:
    kind, size = value["type"], f"{value['size']:,} B"
    if kind == "array":
        shape = ",".join(map(str, value["shape"]))
        return f"{value['library']} {value['dtype']}[{shape}] ({size})"
    if "value" in value:
        return f"{kind} {json.dumps(value['value'])} ({size})"
    if "length" in value:
        items = f" of {'|'.join(value['item_types'])}" if value.get("item_types") else ""
        return f"{kind}[{value['length']}]{items} ({size})"
    return f"{kind} ({size})"


def _compact(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} chars)"
    return text
