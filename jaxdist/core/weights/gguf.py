"""A memory-mapped GGUF reader: tensor info, stored bytes, dequantized arrays and metadata.

The header (magic, version, key/value metadata, tensor infos) is parsed here with ``struct`` and
``np.frombuffer`` over an ``np.memmap`` of the file, in one pass; tensor data is never read until
asked for, and then as a zero-copy slice of the map. ``gguf.GGUFReader`` is not used because it
builds numpy objects per array element: for a 49k-entry tokenizer that makes opening take
seconds, on the coordinator and on every worker that binds. Every count, length and offset is
checked against the file size before it is used, so a corrupt or hostile file raises
:class:`WeightError`, never ``IndexError`` or ``MemoryError``. GGUF lists dims fastest-first
(``ne0`` first); everything here reports NumPy (row-major) order, i.e. reversed.

Dequantization uses :func:`jaxdist.core.quant.dequantize` for :data:`jaxdist.core.quant.PACKABLE_TYPES`.
The other GGML types that ``gguf.quants`` can decode (the IQ*, TQ*, MXFP4 families) are decoded by
``gguf.quants.dequantize`` on purpose: they are rare, their lookup-grid layouts are long, and the
reference implementation is exact. Such tensors can only be bound unpacked, because no in-graph
dequantizer exists for them.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from gguf import quants as gguf_quants

from jaxdist.core import quant
from jaxdist.core.errors import WeightError
from jaxdist.core.weights.rawfile import map_fd
from jaxdist.core.weights.uri import WeightInfo

__all__ = ["GGUFFile", "metadata"]

logger = logging.getLogger(__name__)

_T = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType

# GGML types stored as plain little-endian elements: type -> numpy dtype.
_PLAIN: dict[gguf.GGMLQuantizationType, np.dtype[Any]] = {
    _T.F32: np.dtype(np.float32),
    _T.F16: np.dtype(np.float16),
    _T.BF16: np.dtype(ml_dtypes.bfloat16),
    _T.F64: np.dtype(np.float64),
    _T.I8: np.dtype(np.int8),
    _T.I16: np.dtype(np.int16),
    _T.I32: np.dtype(np.int32),
    _T.I64: np.dtype(np.int64),
}

# GGUF scalar value types: type -> (struct for one value, numpy dtype for arrays of them).
_SCALARS: dict[int, tuple[struct.Struct, np.dtype[Any]]] = {
    _V.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    _V.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    _V.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    _V.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    _V.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    _V.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    _V.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    _V.BOOL: (struct.Struct("<?"), np.dtype(np.bool_)),
    _V.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    _V.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    _V.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_VERSIONS = (2, 3)  # v2 and v3 share one layout; v3 only added big-endian files
_MAX_NESTING = 8  # arrays of arrays: deeper is corrupt, and would exhaust the stack
# Fewest bytes an item can take, so a count is checked against the file before any loop or
# allocation: a KV (empty key, u32 type, u8 value), a tensor info (empty name, no dims, u32
# type, u64 offset), an array element that is a string (u64 length) or an array (u32 + u64).
_MIN_KV, _MIN_TENSOR, _MIN_STRING, _MIN_ARRAY = 13, 24, 8, 12
_EXPECT_TYPE = f"expected 0..{max(_V)} ({', '.join(t.name for t in _V)})"
_FIX = "expected a GGUF v2/v3 file (check the file is complete and really GGUF)"


@dataclass(frozen=True)
class _Tensor:
    """One tensor info from the header."""

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # NumPy order: the file's ne dims reversed
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class _Header:
    """The parsed header of a GGUF file."""

    version: int
    metadata: dict[str, Any]  # key -> str, int, float, bool or (nested) list of them
    tensors: dict[str, _Tensor]  # in file order
    alignment: int
    data_offset: int  # where the tensor data section starts (tensor offsets are relative to it)


class _Parser:
    """A cursor over the file's bytes; every read is checked against the end of the file."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str, fix: str = _FIX) -> WeightError:
        return WeightError(f"GGUF file '{self.path}' could not be read: {what}; {fix}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.error(
                f"truncated or corrupt header: reading {what} needs {n} bytes at offset "
                f"{self.pos}, but the file has only {self.size} bytes"
            )

    def read(self, fmt: struct.Struct, what: str) -> Any:
        self.need(fmt.size, what)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def string(self, what: str) -> str:
        n = self.read(_U64, f"the length of {what}")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} at offset {self.pos} is not valid UTF-8 "
                             f"({exc.reason})") from None
        self.pos += n
        return text

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in one pass (the tokenizer's tens of thousands of entries)."""
        self.need(count * _MIN_STRING, f"the {count} strings of {what}")
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        start = pos
        try:  # the hot loop: a length read past the end raises struct.error
            for _ in range(count):
                start = pos + 8
                pos = start + unpack(buf, pos)[0]
                if pos > size:
                    break
                append(bytes(buf[start:pos]).decode("utf-8"))
        except struct.error:
            self.pos = pos
            self.need(8, f"the length of {what}[{len(out)}]")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what}[{len(out)}] at offset {start} is not valid UTF-8 "
                             f"({exc.reason})") from None
        if len(out) < count:
            self.pos = start
            self.need(pos - start, f"{what}[{len(out)}]")
        self.pos = pos
        return out

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.read(scalar[0], what)
        if vtype == _V.STRING:
            return self.string(what)
        if vtype == _V.ARRAY:
            return self.array(what, depth)
        raise self.error(f"{what} has unknown value type {vtype}; {_EXPECT_TYPE}")

    def array(self, what: str, depth: int) -> list[Any]:
        if depth >= _MAX_NESTING:
            raise self.error(f"{what} nests arrays more than {_MAX_NESTING} deep")
        itype = self.read(_U32, f"the element type of {what}")
        count = self.read(_U64, f"the length of {what}")
        scalar = _SCALARS.get(itype)
        if scalar is not None:
            dtype = scalar[1]
            self.need(count * dtype.itemsize, f"the {count} {_V(itype).name} elements of {what}")
            values: list[Any] = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if itype == _V.STRING:
            return self.strings(count, what)
        if itype == _V.ARRAY:
            self.need(count * _MIN_ARRAY, f"the {count} arrays of {what}")
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.error(f"{what} has unknown element type {itype}; {_EXPECT_TYPE}")


def _parse_header(buf: memoryview, path: str) -> _Header:
    """Parse magic, version, metadata and tensor infos; check every tensor lies in the file.

    Raises:
        WeightError: the file is not GGUF, is big-endian, of an unsupported version, truncated
            or inconsistent; the message names the file, the field and the offset.
    """
    p = _Parser(buf, path)
    p.need(4, "the magic")
    magic = bytes(buf[:4])
    if magic != b"GGUF":
        raise p.error(f"bad magic {magic!r} at offset 0, expected b'GGUF'")
    p.pos = 4
    version = p.read(_U32, "the version")
    if version not in _VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in _VERSIONS:
            raise WeightError(
                f"GGUF file '{path}' is big-endian; expected little-endian, found the "
                f"opposite byte order; convert it with llama.cpp's gguf tools"
            )
        raise p.error(f"unsupported GGUF version {version}, expected one of {_VERSIONS}",
                      fix="convert the file with a current llama.cpp")
    tensor_count = p.read(_U64, "the tensor count")
    kv_count = p.read(_U64, "the key/value count")
    p.need(kv_count * _MIN_KV, f"{kv_count} key/value pairs")

    meta: dict[str, Any] = {}
    align_type = None
    for i in range(kv_count):
        key = p.string(f"the name of key #{i}")
        if key in meta:
            raise p.error(f"key '{key}' appears twice (the second time as key #{i})")
        vtype = p.read(_U32, f"the value type of key '{key}'")
        meta[key] = p.value(vtype, f"the value of key '{key}'")
        if key == gguf.Keys.General.ALIGNMENT:
            align_type = vtype
    alignment = meta.get(gguf.Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
    if align_type is not None and (
        align_type != _V.UINT32 or alignment <= 0 or alignment & (alignment - 1)
    ):
        raise p.error(f"'{gguf.Keys.General.ALIGNMENT}' is {alignment!r} "
                      f"({_V(align_type).name}), expected a UINT32 power of two")

    p.need(tensor_count * _MIN_TENSOR, f"{tensor_count} tensor infos")
    infos = []
    for i in range(tensor_count):
        name = p.string(f"the name of tensor #{i}")
        n_dims = p.read(_U32, f"the dimension count of tensor '{name}'")
        p.need(8 * n_dims, f"the {n_dims} dims of tensor '{name}'")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, p.pos)
        p.pos += 8 * n_dims
        raw_type = p.read(_U32, f"the GGML type of tensor '{name}'")
        offset = p.read(_U64, f"the data offset of tensor '{name}'")
        infos.append((name, dims, raw_type, offset))
    data_offset = -(-p.pos // alignment) * alignment

    tensors: dict[str, _Tensor] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise p.error(f"tensor '{name}' appears twice")
        tensors[name] = _tensor_info(p, name, dims, raw_type, data_offset + offset)
    return _Header(version, meta, tensors, alignment, data_offset)


def _tensor_info(p: _Parser, name: str, dims: tuple[int, ...], raw_type: int,
                 offset: int) -> _Tensor:
    try:
        ggml_type = _T(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise p.error(f"tensor '{name}' has unknown GGML type {raw_type}",
                      fix="the file may need a newer jaxdist/gguf, or be corrupt") from None
    shape = tuple(reversed(dims))
    if block > 1 and (not dims or dims[0] % block):
        raise p.error(f"tensor '{name}' ({ggml_type.name}, shape {shape}) has rows of "
                      f"{dims[0] if dims else 0} elements, expected a multiple of the "
                      f"{ggml_type.name} block size {block}")
    nbytes = math.prod(dims) // block * type_size
    if offset + nbytes > p.size:
        raise p.error(f"tensor '{name}' ({ggml_type.name}, shape {shape}) needs bytes "
                      f"[{offset}, {offset + nbytes}), but the file has only {p.size} bytes")
    return _Tensor(name, ggml_type, shape, offset, nbytes)


class GGUFFile:
    """One open (memory-mapped) GGUF file.

    Args:
        path: real path of the ``.gguf`` file (already checked against the weight roots).

    Raises:
        WeightError: the file cannot be opened, is not GGUF, is big-endian, truncated or corrupt.
    """

    def __init__(self, path: str | os.PathLike[str], *, fd: int | None = None) -> None:
        """``fd``: the file open already (:func:`~jaxdist.core.weights.uri.open_checked`); it is
        mapped and closed. Without it, ``path`` is opened."""
        self.path = str(path)
        try:
            if fd is not None:
                self._map: np.ndarray = map_fd(fd, self.path)
            else:
                empty = os.path.getsize(self.path) == 0  # np.memmap refuses empty files
                self._map = (np.zeros(0, np.uint8) if empty
                             else np.memmap(self.path, dtype=np.uint8, mode="r"))
        except (OSError, ValueError) as exc:
            raise WeightError(f"GGUF file '{self.path}' could not be read: {exc}; {_FIX}") from exc
        self._header = _parse_header(self._map.data, self.path)
        self._tensors = self._header.tensors
        logger.debug("opened GGUF v%d %s: %d tensors, %d keys", self._header.version, self.path,
                     len(self._tensors), len(self._header.metadata))

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._tensors)

    def _tensor(self, name: str) -> _Tensor:
        t = self._tensors.get(name)
        if t is None:
            from difflib import get_close_matches  # noqa: PLC0415 - only on the error path

            close = get_close_matches(name, self._tensors, n=3)
            hint = f"; close matches: {close}" if close else ""
            raise WeightError(
                f"tensor '{name}' not found in GGUF file '{self.path}' "
                f"({len(self._tensors)} tensors){hint}; list them with describe_weights",
                code="NOT_FOUND",
            )
        return t

    def info(self, name: str) -> WeightInfo:
        """Shape (NumPy order), dtype, quant type and size of one tensor, from the header."""
        t = self._tensor(name)
        plain = _PLAIN.get(t.ggml_type)
        return WeightInfo(
            name=name,
            shape=t.shape,
            dtype=plain.name if plain is not None else "float32",
            quant=None if plain is not None else t.ggml_type.name,
            nbytes=t.nbytes,
            path=self.path,
        )

    def describe(self) -> dict[str, WeightInfo]:
        """Info of every tensor, in file order, without reading tensor data."""
        return {name: self.info(name) for name in self._tensors}

    def stored_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored in the file: a flat uint8 view of the memory map."""
        t = self._tensor(name)
        return self._map[t.offset : t.offset + t.nbytes]

    def read(self, name: str) -> np.ndarray:
        """The tensor in NumPy order: plain types in their stored dtype (a memory-map view),
        quantized types dequantized to float32.

        Raises:
            WeightError: the type cannot be dequantized, or the data is inconsistent.
        """
        info = self.info(name)
        if info.quant is None:
            return self.stored_bytes(name).view(np.dtype(info.dtype)).reshape(info.shape)
        raw = self.stored_bytes(name)
        if info.quant in quant.PACKABLE_TYPES:
            logger.debug("dequantizing %s (%s) with jaxdist.core.quant", name, info.quant)
            out: np.ndarray = quant.dequantize(raw, info.quant, info.shape)
            return out
        logger.debug("dequantizing %s (%s) with gguf.quants (no in-graph path)", name, info.quant)
        try:
            rows = raw.reshape(quant.packed_shape(info.quant, info.shape))
            out = gguf_quants.dequantize(rows, _T.__members__[info.quant])
        except NotImplementedError as exc:
            raise WeightError(
                f"tensor '{name}' in '{self.path}' has GGML type {info.quant}, which neither "
                f"jaxdist.core.quant ({', '.join(quant.PACKABLE_TYPES)}) nor gguf.quants can "
                f"dequantize; requantize the model to a supported type"
            ) from exc
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def metadata(self) -> dict[str, Any]:
        """GGUF key/value metadata: strings decoded, arrays as lists, scalars as Python values."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._header.metadata.items()}

    def close(self) -> None:
        """Drop the map; it closes once no array views of it remain."""
        self._tensors = {}
        self._map = np.zeros(0, np.uint8)


def metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (architecture, hyperparameters, tokenizer).

    This opens ``path`` directly, without weight-root checks: it is meant for the coordinator
    reading a model it holds. Workers go through :meth:`jaxdist.core.weights.WeightCache.metadata`.

    Args:
        path: a ``.gguf`` file.

    Returns:
        ``{key: value}``, e.g. ``{"general.architecture": "llama", "llama.block_count": 30, ...}``.

    Raises:
        WeightError: the file is missing or not GGUF.

    Example:
        >>> meta = metadata("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> meta["general.architecture"]                          # doctest: +SKIP
        'llama'
    """
    if not Path(path).is_file():
        raise WeightError(f"GGUF file '{path}' not found; expected an existing .gguf file",
                          code="NOT_FOUND")
    return GGUFFile(path).metadata()
