"""Decoders for the members of WebDataset tar samples, chosen by extension.

A tar sample is ``{"__key__": str, "<ext>": bytes, ...}``. ``ShardedFileDataset(...,
decode=True)`` decodes it with :data:`DEFAULT_DECODERS`; ``decode={...}`` takes your own
mapping (extensions missing from it stay bytes), for instance
``{**DEFAULT_DECODERS, "jpg": my_jpeg_decoder}``. A decoder is looked up by the whole
extension (``seg.png``), then by its last part (``png``). The same works after the
source, in a ``MapDataset(ds, decode_sample)``.

Pickles (``.pyd``, ``.pickle``) are not decoded: loading one can run code.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from savable_loader.errors import DataError

__all__ = ["DEFAULT_DECODERS", "decode_sample"]


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _int(data: bytes) -> int:
    return int(data.decode("utf-8").strip())


def _json(data: bytes) -> Any:
    return json.loads(data)


def _msgpack(data: bytes) -> Any:
    return msgspec.msgpack.decode(data)


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _torch(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _image(data: bytes) -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding images needs Pillow (pip install pillow); or leave them as bytes") from None
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


#: Extension -> decoder used by ``decode=True``: text and JSON, class labels as ints,
#: ``.npy`` (no pickles), ``.pt`` / ``.pth`` (``weights_only=True``), msgpack, and images
#: as loaded ``PIL.Image`` objects (needs Pillow).
DEFAULT_DECODERS: Mapping[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(("txt", "text", "transcript"), _text),
    **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "id"), _int),
    **dict.fromkeys(("json", "jsn"), _json),
    **dict.fromkeys(("mp", "msgpack"), _msgpack),
    "npy": _npy,
    **dict.fromkeys(("pt", "pth"), _torch),
    **dict.fromkeys(("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "webp", "bmp", "tif", "tiff", "gif"), _image),
}


def decode_sample(
    sample: Mapping[str, Any], decoders: Mapping[str, Callable[[bytes], Any]] = DEFAULT_DECODERS
) -> dict[str, Any]:
    """A copy of the tar sample ``sample`` with its bytes members decoded by extension.

    Example::

        ds = MapDataset(ShardedFileDataset("data/wds", wc), decode_sample)
        # {"__key__": "0001", "jpg": <PIL.Image>, "cls": 3, "json": {...}}
    """
    out: dict[str, Any] = {}
    for ext, value in sample.items():
        if isinstance(value, bytes) and not ext.startswith("__"):
            fn = decoders.get(ext) or decoders.get(ext.rsplit(".", 1)[-1])
            if fn is not None:
                value = fn(value)
        out[ext] = value
    return out
