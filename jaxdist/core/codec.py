"""The tensor codec: the only code in jaxdist that turns tensors into bytes and back.

Transport, registry, benchmarks and tests all call this module; none writes a second codec.

A tensor travels as a ``jaxdist.v1.Tensor`` message: dtype enum, shape, and raw little-endian
C-order bytes. A tensor larger than ``chunk_bytes`` travels as several messages with the same
name, dtype and shape and increasing ``offset``; :class:`TensorAssembler` puts them back together.

Decoding an unchunked tensor is zero-copy: the array is a read-only ``np.frombuffer`` view of the
received ``bytes`` object. Chunked tensors are written once into one preallocated buffer.

The data plane also writes and reads ``Tensor`` messages in wire format directly
(:func:`tensor_pieces`, :func:`parse_tensor`): a tensor's bytes go from its numpy buffer into the
outgoing message in one copy, and come back as views of the received message, with no
intermediate protobuf objects (each of which costs a full copy of the data).

Example:
    >>> import numpy as np
    >>> from jaxdist.core import codec
    >>> msgs = codec.encode("x", np.arange(6, dtype=np.int32).reshape(2, 3))
    >>> codec.decode(msgs[0]).tolist()
    [[0, 1, 2], [3, 4, 5]]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from google.protobuf.message import DecodeError

from jaxdist.core import protowire
from jaxdist.core.errors import CodecError, LimitError
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_TENSORS",
    "DEFAULT_MAX_TENSOR_BYTES",
    "SUPPORTED_DTYPES",
    "TensorAssembler",
    "canonical_dtype",
    "chunk_of",
    "chunks",
    "decode",
    "decode_tensors",
    "dtype_from_name",
    "encode",
    "encode_tensors",
    "from_bytes",
    "group_chunks",
    "parse_tensor",
    "tensor_pieces",
    "to_bytes",
]

# 1 MiB chunks: on loopback, chunks of 2 to 16 MiB were no faster (docs/design.md, "Frames are
# hand-written protobuf"), and 1 MiB keeps every message far below gRPC's 4 MiB default limit.
DEFAULT_CHUNK_BYTES = 1 << 20

# What a TensorAssembler accepts unless told otherwise (the worker's defaults too): a peer's
# header declares a tensor's size, and the assembler allocates it on the first chunk.
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
DEFAULT_MAX_TENSORS = 256

# numpy's limits: at most 64 dims, and the product of the non-zero dims times the item size
# must fit an intp, even for an empty array (np.empty((0, 2**62, 4), np.uint8) is refused).
_MAX_RANK = 64
_MAX_ARRAY_BYTES = (1 << 63) - 1

_Enum = pb.DType  # a jaxdist.v1.DType value (an int on the wire)

_NP_BY_ENUM: dict[_Enum, np.dtype] = {
    pb.F32: np.dtype(np.float32),
    pb.F16: np.dtype(np.float16),
    pb.BF16: np.dtype(ml_dtypes.bfloat16),
    pb.F64: np.dtype(np.float64),
    pb.I8: np.dtype(np.int8),
    pb.I16: np.dtype(np.int16),
    pb.I32: np.dtype(np.int32),
    pb.I64: np.dtype(np.int64),
    pb.U8: np.dtype(np.uint8),
    pb.U16: np.dtype(np.uint16),
    pb.U32: np.dtype(np.uint32),
    pb.U64: np.dtype(np.uint64),
    pb.BOOL: np.dtype(np.bool_),
}
_ENUM_BY_NAME: dict[str, _Enum] = {dt.name: enum for enum, dt in _NP_BY_ENUM.items()}
_ALIASES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
            "bool_": "bool", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
            "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64"}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(_ENUM_BY_NAME)


def canonical_dtype(dtype: Any) -> str:
    """Return the canonical name (``"float32"``, ``"bfloat16"``, ...) of a dtype-like value.

    Raises:
        CodecError: the dtype is not one the wire format carries.
    """
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype.strip().lower(), dtype.strip().lower())
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError as exc:
            raise CodecError(f"unknown dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}") from exc
    if name not in _ENUM_BY_NAME:
        raise CodecError(f"unsupported dtype {dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return name


def dtype_from_name(name: str) -> np.dtype:
    """Return the numpy dtype for a canonical or alias dtype name (``"bf16"`` -> bfloat16)."""
    return _NP_BY_ENUM[_ENUM_BY_NAME[canonical_dtype(name)]]


_ENUM_BY_DTYPE: dict[np.dtype, _Enum] = {dt: enum for enum, dt in _NP_BY_ENUM.items()}


def _wire(name: str, array: Any) -> tuple[_Enum, list[int], memoryview]:
    """(dtype enum, shape, raw little-endian C-order bytes) of an array, copying only if needed."""
    arr = np.asarray(array)
    enum = _ENUM_BY_DTYPE.get(arr.dtype)
    if enum is None:
        try:
            canonical_dtype(arr.dtype)
        except CodecError as exc:
            raise CodecError(f"tensor {name!r}: {exc}") from None
        # A supported dtype in non-native byte order.
        arr = arr.astype(arr.dtype.newbyteorder("<"))
        enum = _ENUM_BY_DTYPE[arr.dtype.newbyteorder("=")]
    elif arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if not arr.flags.c_contiguous:
        # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
        arr = arr.copy(order="C")
    # Via uint8: bfloat16 has no buffer format of its own.
    return enum, list(arr.shape), arr.reshape(-1).view(np.uint8).data


Chunk = tuple[str, _Enum, list[int], memoryview, int, int]
"""One message's worth of a tensor: (name, dtype enum, shape, data view, offset, total bytes)."""


def chunks(name: str, array: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """Split one tensor into chunks of at most ``chunk_bytes`` of data (at least one chunk)."""
    if chunk_bytes <= 0:
        raise CodecError(f"chunk_bytes must be positive, got {chunk_bytes}")
    enum, shape, raw = _wire(name, array)
    total = raw.nbytes
    if total <= chunk_bytes:
        return [(name, enum, shape, raw, 0, total)]
    return [(name, enum, shape, raw[off:off + chunk_bytes], off, total)
            for off in range(0, total, chunk_bytes)]


def encode(name: str, array: Any, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[pb.Tensor]:
    """Encode one tensor as one message, or several when its data exceeds ``chunk_bytes``.

    Args:
        name: the tensor's name, carried in every chunk.
        array: anything ``np.asarray`` accepts (a ``jax.Array`` is copied to host here: this is the
            single point where device data becomes bytes).
        chunk_bytes: the largest ``data`` payload of one message.

    Returns:
        The messages, in offset order.

    Raises:
        CodecError: unsupported dtype or a non-positive chunk size.
    """
    return [pb.Tensor(name=n, dtype=e, shape=sh, data=d.tobytes(), offset=o, total_bytes=t)
            for n, e, sh, d, o, t in chunks(name, array, chunk_bytes=chunk_bytes)]


def _check(name: str, enum: _Enum, dims: Iterable[int], offset: int, total: int
           ) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, byte size) of a tensor header, checked against itself."""
    dtype = _NP_BY_ENUM.get(enum)
    if dtype is None:
        raise CodecError(f"tensor {name!r}: unknown dtype enum {enum}")
    shape = tuple(int(d) for d in dims)
    if len(shape) > _MAX_RANK:
        raise CodecError(f"tensor {name!r}: rank {len(shape)} is over the largest supported "
                         f"rank of {_MAX_RANK}")
    count = 1
    for d in shape:
        if d < 0:
            raise CodecError(f"tensor {name!r}: negative dimension in shape {shape}")
        count *= d
    nbytes = count * dtype.itemsize
    if nbytes > _MAX_ARRAY_BYTES or (
            count == 0 and _nonzero_bytes(shape, dtype) > _MAX_ARRAY_BYTES):
        raise CodecError(f"tensor {name!r}: shape {shape} of {dtype.name} is over numpy's "
                         f"largest array: its non-zero dims times the item size must be under "
                         f"2**63 bytes")
    if nbytes != total and not (total == 0 and offset == 0):
        raise CodecError(
            f"tensor {name!r}: shape {shape} of {dtype.name} needs {nbytes} bytes, "
            f"header says total_bytes={total}")
    return dtype, shape, nbytes


def _nonzero_bytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    """The size numpy checks for an empty shape: its non-zero dims times the item size."""
    n = dtype.itemsize
    for d in shape:
        n *= d or 1
    return n


def decode(msg: pb.Tensor) -> np.ndarray:
    """Decode one complete (unchunked) tensor message, zero-copy.

    The result is a read-only view of the message's bytes.

    Raises:
        CodecError: bad dtype, or the data length does not match shape and dtype, or the message
            is only a chunk (use :class:`TensorAssembler`).
    """
    dtype, shape, nbytes = _check(msg.name, msg.dtype, msg.shape, msg.offset, msg.total_bytes)
    data = msg.data
    if msg.offset != 0 or len(data) != nbytes:
        raise CodecError(
            f"tensor {msg.name!r}: expected {nbytes} bytes for shape {shape} of {dtype.name}, "
            f"found {len(data)} bytes at offset {msg.offset}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def group_chunks(tensors: Mapping[str, Any], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                 ) -> Iterator[list[Chunk]]:
    """Chunks of named tensors in groups of at most ~``chunk_bytes`` of data, one per message.

    Small tensors share a group; an empty mapping gives one empty group.
    """
    group: list[Chunk] = []
    size = 0
    for name, array in tensors.items():
        for chunk in chunks(name, array, chunk_bytes=chunk_bytes):
            n = chunk[3].nbytes
            if group and size + n > chunk_bytes:
                yield group
                group, size = [], 0
            group.append(chunk)
            size += n
    if group or not tensors:
        yield group


def encode_tensors(tensors: Mapping[str, Any], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
                   ) -> Iterator[list[pb.Tensor]]:
    """Like :func:`group_chunks`, as lists of ``Tensor`` messages."""
    for group in group_chunks(tensors, chunk_bytes=chunk_bytes):
        yield [pb.Tensor(name=n, dtype=e, shape=sh, data=d.tobytes(), offset=o, total_bytes=t)
               for n, e, sh, d, o, t in group]


_T = {f.name: f.number for f in pb.Tensor.DESCRIPTOR.fields}
_NAME, _DTYPE, _SHAPE, _DATA, _OFFSET, _TOTAL = (
    _T["name"], _T["dtype"], _T["shape"], _T["data"], _T["offset"], _T["total_bytes"])
_EMPTY = memoryview(b"")
# The encoded header of a tensor chunk, by everything it encodes: a stage sends the same names
# and shapes frame after frame, so each is serialized once (4 to 6 us a tensor, then ~1.3).
_HEADS: dict[tuple[Any, ...], bytes] = {}
_MAX_HEADS = 4096


def tensor_pieces(group: Iterable[Chunk], field: int) -> tuple[list[bytes | memoryview], int]:
    """Chunks in wire format, as the repeated ``Tensor`` field number ``field`` of a message.

    Returns ``(pieces, size)``: ``b"".join(pieces)`` is the encoding (``size`` bytes long); any
    protobuf reader parses it as those ``Tensor`` messages (``data`` comes last, which the
    format allows). The data pieces are views of the arrays, so joining them is the one copy of
    the data on the way out.
    """
    pieces: list[bytes | memoryview] = []
    size = 0
    for name, enum, shape, data, offset, total in group:
        n = data.nbytes
        key = (field, name, enum, *shape, -1, offset, total, n)  # -1: shape's end
        head = _HEADS.get(key)
        if head is None:
            head = pb.Tensor(name=name, dtype=enum, shape=shape, offset=offset,
                             total_bytes=total).SerializeToString()
            head += protowire.field_prefix(_DATA, n) if n else b""
            head = protowire.field_prefix(field, len(head) + n) + head
            if len(_HEADS) >= _MAX_HEADS:
                _HEADS.clear()
            _HEADS[key] = head
        pieces += (head, data) if n else (head,)
        size += len(head) + n
    return pieces, size


def parse_tensor(buf: memoryview, start: int, end: int) -> Chunk:
    """Read one ``Tensor`` message from ``buf[start:end]`` without copying its data.

    The chunk's data is a view of ``buf`` (it keeps the received bytes alive).

    Raises:
        CodecError: malformed bytes.
    """
    name, enum, data, offset, total = "", 0, _EMPTY, 0, 0
    shape: list[int] = []
    for field, wire_type, _, value, value_end in protowire.fields(buf, start, end):
        if field == _DATA and wire_type == protowire.LEN:
            data = buf[value:value_end]
        elif field == _NAME and wire_type == protowire.LEN:
            try:
                name = str(buf[value:value_end], "utf-8")
            except UnicodeDecodeError:
                raise CodecError("malformed tensor: name is not UTF-8") from None
        elif field == _SHAPE:
            if wire_type == protowire.LEN:  # packed, as proto3 writes it
                pos = value
                while pos < value_end:
                    d, pos = protowire.read_varint(buf, pos)
                    shape.append(d)
            elif wire_type == protowire.VARINT:
                shape.append(value)
        elif wire_type == protowire.VARINT:
            if field == _DTYPE:
                enum = value
            elif field == _OFFSET:
                offset = value
            elif field == _TOTAL:
                total = value
    # int64 travels as its 64-bit two's complement: a negative dim reads as a huge number.
    shape = [d - (1 << 64) if d >= 1 << 63 else d for d in shape]
    return name, enum, shape, data, offset, total  # type: ignore[return-value]


def chunk_of(msg: pb.Tensor) -> Chunk:
    """A parsed ``Tensor`` message as a chunk (reads ``data`` once: each read copies it)."""
    chunk = msg.name, msg.dtype, list(msg.shape), msg.data, msg.offset, msg.total_bytes
    return chunk  # type: ignore[return-value]


def _aligned_empty(name: str, nbytes: int) -> np.ndarray:
    """An uninitialized byte buffer on a 64-byte boundary. XLA:CPU uses such a host array in
    place; any other alignment costs a full copy per call (1.2 ms per 16 MiB here). Not zeroed:
    the assembler proves the chunks tile the tensor before it hands the buffer out.

    Raises:
        LimitError: the memory for tensor ``name`` cannot be allocated.
    """
    try:
        buf = np.empty(nbytes + 64, np.uint8)
    except (MemoryError, ValueError) as exc:
        raise LimitError(f"tensor {name!r}: cannot allocate {nbytes} bytes for it: {exc}") from None
    start = -buf.ctypes.data % 64
    return buf[start:start + nbytes]


class TensorAssembler:
    """Collects tensor messages (whole or chunked) and returns complete arrays.

    A chunked tensor's buffer is allocated, at the size its header declares, when its first
    chunk arrives: the limits bound what a peer can make this process allocate.

    Args:
        max_bytes: refuse a tensor whose declared size exceeds this (``None``: no limit).
        max_tensors: refuse more than this many distinct tensors (``None``: no limit).
    """

    def __init__(self, *, max_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES,
                 max_tensors: int | None = DEFAULT_MAX_TENSORS) -> None:
        self._max_bytes = max_bytes
        self._max_tensors = max_tensors
        self._done: dict[str, np.ndarray] = {}
        # name -> (dtype, shape, buffer, bytes received, [(offset, end) of each chunk])
        self._partial: dict[str, tuple[np.dtype, tuple[int, ...], np.ndarray, int,
                                       list[tuple[int, int]]]] = {}

    def add(self, msg: pb.Tensor) -> None:
        """Add one message. See :meth:`add_chunk`."""
        self.add_chunk(chunk_of(msg))

    def add_chunk(self, chunk: Chunk) -> None:
        """Add one chunk (from :func:`parse_tensor` or :func:`chunk_of`).

        Raises:
            CodecError: a malformed header, or inconsistent, overlapping or repeated chunks.
            LimitError: the tensor is over ``max_bytes``, one tensor too many arrived, or its
                buffer cannot be allocated.
        """
        name, enum, dims, data, offset, total = chunk
        if name in self._done:
            raise CodecError(f"tensor {name!r} received twice in one frame")
        dtype, shape, nbytes = _check(name, enum, dims, offset, total)
        if self._max_bytes is not None and nbytes > self._max_bytes:
            raise LimitError(f"tensor {name!r} is {nbytes} bytes, over the limit of "
                             f"{self._max_bytes} bytes per tensor")
        n = len(data)
        if name not in self._partial:
            if (self._max_tensors is not None
                    and len(self._done) + len(self._partial) >= self._max_tensors):
                raise LimitError(f"more than {self._max_tensors} tensors in one frame (the "
                                 f"limit); tensor {name!r} would be number "
                                 f"{len(self._done) + len(self._partial) + 1}")
            if offset == 0 and n == nbytes:
                self._done[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
                return
            self._partial[name] = (dtype, shape, _aligned_empty(name, nbytes), 0, [])
        pdtype, pshape, buf, got, spans = self._partial[name]
        if (pdtype, pshape) != (dtype, shape):
            raise CodecError(f"tensor {name!r}: chunk header {dtype.name}{list(shape)} differs from "
                             f"the first chunk's {pdtype.name}{list(pshape)}")
        end = offset + n
        if end > nbytes:
            raise CodecError(f"tensor {name!r}: chunk [{offset}, {end}) overruns {nbytes} bytes")
        buf[offset:end] = np.frombuffer(data, np.uint8)
        got += n
        spans.append((offset, end))
        if got > nbytes:
            raise CodecError(f"tensor {name!r}: received {got} bytes for a {nbytes}-byte tensor")
        if got < nbytes:
            self._partial[name] = (pdtype, pshape, buf, got, spans)
            return
        pos = 0
        for start, stop in sorted(spans):
            if start != pos:
                raise CodecError(f"tensor {name!r}: chunks overlap or leave a gap at byte {pos}")
            pos = stop
        del self._partial[name]
        self._done[name] = buf.view(dtype).reshape(shape)

    def extend(self, msgs: Iterable[pb.Tensor]) -> None:
        for msg in msgs:
            self.add(msg)

    def finish(self) -> dict[str, np.ndarray]:
        """Return the tensors, in arrival order. Raises CodecError if any is incomplete."""
        if self._partial:
            missing = ", ".join(f"{n!r} ({g}/{b.nbytes} bytes)"
                                for n, (_, _, b, g, _) in self._partial.items())
            raise CodecError(f"incomplete tensors at end of frame: {missing}")
        return dict(self._done)


def decode_tensors(msgs: Iterable[pb.Tensor], **limits: int | None) -> dict[str, np.ndarray]:
    """Decode a sequence of messages (whole or chunked) into named arrays.

    ``limits`` are :class:`TensorAssembler`'s (``max_bytes``, ``max_tensors``)."""
    asm = TensorAssembler(**limits)
    asm.extend(msgs)
    return asm.finish()


def to_bytes(name: str, array: Any) -> bytes:
    """Serialize one tensor to a self-describing byte string (a ``Tensor`` message)."""
    data: bytes = encode(name, array, chunk_bytes=1 << 62)[0].SerializeToString()
    return data


def from_bytes(data: bytes) -> tuple[str, np.ndarray]:
    """Inverse of :func:`to_bytes`. Raises CodecError on malformed bytes."""
    msg = pb.Tensor()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise CodecError(f"malformed tensor bytes ({len(data)} bytes): {exc}") from None
    return msg.name, decode(msg)
