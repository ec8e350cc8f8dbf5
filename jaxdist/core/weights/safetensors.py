"""A header-based, memory-mapped safetensors reader, plus sharded-checkpoint indexes.

The format is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``), then the tensor bytes. Reading the
header ourselves and ``np.memmap``-ing the byte range is the fastest route and covers every dtype,
including BF16 and FP8 through ``ml_dtypes``, with no framework in between.
``safetensors.safe_open`` remains the independent reference in the tests.

Describing a file reads only its header; the data is mapped on the first tensor read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist.core.errors import WeightError
from jaxdist.core.weights.rawfile import map_fd
from jaxdist.core.weights.uri import WeightInfo

__all__ = ["INDEX_NAME", "SafetensorsFile", "find_checkpoint", "read_config", "read_index"]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"

# A header beyond this is not a real checkpoint; refuse it before allocating.
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


class SafetensorsFile:
    """One ``.safetensors`` file: the parsed header and a lazily created memory map.

    Args:
        path: real path of the file (already checked against the weight roots).

    Raises:
        WeightError: the file is missing, truncated, or its header is malformed.
    """

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        """``fd``: the file open already (:func:`~jaxdist.core.weights.uri.open_checked`); it is
        mapped and closed, and everything is read from that map. Without it, ``path`` is
        opened."""
        self.path = str(path)
        self._map: np.ndarray | None = None
        try:
            if fd is not None:
                self._map = mapped = map_fd(fd, self.path)
                size = len(mapped)

                def read(begin: int, end: int) -> bytes:
                    return bytes(mapped[begin:end])
            else:
                size = os.path.getsize(self.path)

                def read(begin: int, end: int) -> bytes:
                    with open(self.path, "rb") as f:
                        f.seek(begin)
                        return f.read(end - begin)
            head = read(0, 8)
            if len(head) < 8:
                raise self._bad(f"expected an 8-byte header length, found {len(head)} bytes")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise self._bad(f"header length {n} exceeds the file size {size}")
            header = json.loads(read(8, 8 + n))
        except OSError as exc:
            raise WeightError(f"safetensors file '{self.path}' could not be read: {exc}") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise self._bad(f"the header is not JSON ({exc})") from exc
        except RecursionError:
            raise self._bad("the header JSON is nested too deeply to parse") from None
        if not isinstance(header, dict):
            raise self._bad(f"the header is a {type(header).__name__}, expected an object")
        self._data_start = 8 + n
        data_len = size - self._data_start
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(
            isinstance(v, str) for v in metadata.values()
        ):
            raise self._bad(
                f"'__metadata__' must be an object of strings, found {_show(metadata)}"
            )
        self.metadata: dict[str, str] = metadata
        self._infos: dict[str, WeightInfo] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            self._infos[name] = self._parse_entry(name, entry, data_len)
        logger.debug("opened safetensors %s: %d tensors", self.path, len(self._infos))

    def _bad(self, what: str) -> WeightError:
        return WeightError(
            f"safetensors file '{self.path}' is malformed: {what}; re-download or re-save it"
        )

    def _parse_entry(self, name: str, entry: Any, data_len: int) -> WeightInfo:
        if not isinstance(entry, dict):
            raise self._bad(
                f"tensor '{name}': expected an object with dtype, shape and data_offsets, "
                f"found {_show(entry)}"
            )
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise self._bad(f"tensor '{name}': missing field {', '.join(map(repr, missing))}")
        dtype_name = entry["dtype"]
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise self._bad(
                f"tensor '{name}': unknown dtype {_show(dtype_name)} (supported: "
                f"{', '.join(_DTYPES)})"
            )
        shape = self._naturals(name, entry, "shape")
        offsets = self._naturals(name, entry, "data_offsets")
        if len(offsets) != 2:
            raise self._bad(
                f"tensor '{name}': 'data_offsets' must be [begin, end], found "
                f"{_show(list(offsets))}"
            )
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise self._bad(
                f"tensor '{name}' ({dtype.name} {shape}): expected {nbytes} bytes within "
                f"{data_len} data bytes, found offsets [{begin}, {end}]"
            )
        self._offsets[name] = (begin, end)
        return WeightInfo(name, shape, dtype.name, None, nbytes, self.path)

    def _naturals(self, name: str, entry: dict[str, Any], key: str) -> tuple[int, ...]:
        """``entry[key]`` as a tuple, which must be a list of non-negative JSON integers (a float
        such as ``1e999`` or ``2.0``, a bool or a string is refused, not converted)."""
        value = entry[key]
        if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
            raise self._bad(
                f"tensor '{name}': '{key}' must be a list of non-negative integers, found "
                f"{_show(value)}"
            )
        return tuple(value)

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._infos)

    def info(self, name: str) -> WeightInfo:
        """Header info of one tensor.

        Raises:
            WeightError: no tensor of that name.
        """
        info = self._infos.get(name)
        if info is None:
            from difflib import get_close_matches  # only on the error path

            close = get_close_matches(name, self._infos, n=3)
            hint = f"; close matches: {close}" if close else ""
            raise WeightError(
                f"tensor '{name}' not found in safetensors file '{self.path}' "
                f"({len(self._infos)} tensors){hint}; list them with describe_weights",
                code="NOT_FOUND",
            )
        return info

    def describe(self) -> dict[str, WeightInfo]:
        """Info of every tensor, from the header only."""
        return dict(self._infos)

    def stored_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes: a flat uint8 view of the memory map."""
        begin, end = self._offsets[self.info(name).name]
        if begin == end:
            return np.zeros(0, np.uint8)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[self._data_start + begin : self._data_start + end]

    def read(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype and shape, as a read-only memory-map view."""
        info = self.info(name)
        dtype = _dtype_by_name(info.dtype)
        return self.stored_bytes(name).view(dtype).reshape(info.shape)

    def close(self) -> None:
        """Drop the memory map; it closes once no array views of it remain."""
        self._map = None


def _show(value: Any, limit: int = 60) -> str:
    """A JSON value for an error message, shortened when long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _dtype_by_name(name: str) -> np.dtype[Any]:
    for dtype in _DTYPES.values():
        if dtype.name == name:
            return dtype
    raise WeightError(f"unsupported safetensors dtype {name!r}")


def read_index(path: str | os.PathLike[str], *, fd: int | None = None) -> dict[str, str]:
    """Read a sharded checkpoint's index: ``{tensor name: shard file name}``.

    Args:
        path: a ``model.safetensors.index.json`` (shard names are relative to its directory).

    Raises:
        WeightError: the file is not JSON or has no ``weight_map`` object of strings.
    """
    try:
        with open(fd if fd is not None else path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightError(f"safetensors index '{path}' could not be read: {exc}") from exc
    except RecursionError:
        raise WeightError(
            f"safetensors index '{path}' could not be read: its JSON is nested too deeply"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise WeightError(
            f"safetensors index '{path}': expected a 'weight_map' object mapping tensor names to "
            f"shard files, found {type(weight_map).__name__}"
        )
    return dict(weight_map)


def read_config(path: str | os.PathLike[str], *, fd: int | None = None) -> dict[str, Any]:
    """Read the ``config.json`` of a checkpoint (a JSON object, returned as is).

    Raises:
        WeightError: the file cannot be read, is not UTF-8 JSON, or is not a JSON object.
    """
    try:
        with open(fd if fd is not None else path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightError(
            f"checkpoint config '{path}' could not be read: {exc}; fix or remove the file"
        ) from exc
    except RecursionError:
        raise WeightError(
            f"checkpoint config '{path}' could not be read: its JSON is nested too deeply"
        ) from None
    if not isinstance(config, dict):
        raise WeightError(
            f"checkpoint config '{path}': expected a JSON object, found "
            f"{type(config).__name__}; fix or remove the file"
        )
    return config


def find_checkpoint(directory: Path) -> Path:
    """The file that stands for a checkpoint directory: its index if sharded, else its one file.

    Args:
        directory: a directory holding ``model.safetensors.index.json``, ``model.safetensors``, or
            exactly one ``*.safetensors`` file.

    Raises:
        WeightError: none of those, or several candidate files.
    """
    for name in (INDEX_NAME, "model.safetensors"):
        if (directory / name).is_file():
            return directory / name
    files = sorted(directory.glob("*.safetensors"))
    if len(files) == 1:
        return files[0]
    found = [f.name for f in files] or "no .safetensors files"
    raise WeightError(
        f"safetensors directory '{directory}': expected {INDEX_NAME}, model.safetensors or one "
        f"*.safetensors file, found {found}; name the file in the URI"
    )
