"""GGML block dequantizers, written once for both NumPy and ``jax.numpy``.

A GGUF tensor is stored as a sequence of fixed-size blocks along its last (fastest) axis. Each
function below turns ``(n_blocks, block_bytes)`` uint8 into ``(n_blocks, block_elems)`` float32
using only operations that ``numpy`` and ``jax.numpy`` share (slicing, reshape, bit ops,
``astype``), so the same code serves two callers:

* bind time: ``dequantize(blocks, "Q4_1", shape)`` with ``xp=numpy`` on memory-mapped file data;
* the "packed" path: weights are bound as raw uint8 blocks and an exported JAX graph calls
  ``dequantize(blocks, "Q4_1", shape, xp=jax.numpy)``, saving device memory at a per-call cost.

The bit layouts follow llama.cpp's ``ggml-quants.c``; ``gguf.quants`` (the reference used in
``tests/test_quant.py``) implements the same layouts independently. Arithmetic is done in float32 in
the same order as the reference, so results agree bit for bit.

Example:
    >>> import numpy as np
    >>> blocks = np.zeros((4, 18), np.uint8)            # 4 rows of one Q4_0 block each
    >>> dequantize(blocks, "Q4_0", (4, 32)).shape
    (4, 32)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxdist.core.errors import WeightError

__all__ = ["PACKABLE_TYPES", "block_layout", "dequantize", "dequantize_rows", "packed_shape"]

logger = logging.getLogger(__name__)

QK_K = 256  # elements per K-quant super-block

# Bind-time (NumPy) dequantization works on this many blocks at a time, bounding the float32
# temporaries to a few tens of MB for multi-GB tensors.
_NUMPY_CHUNK_BLOCKS = 1 << 16


def block_layout(qtype: str) -> tuple[int, int]:
    """Return ``(block_elems, block_bytes)`` of a GGML type.

    Args:
        qtype: a GGML type name such as ``"Q4_1"`` or ``"F16"``.

    Raises:
        WeightError: ``qtype`` is not a GGML type name.
    """
    try:
        block_elems, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    except KeyError:
        known = ", ".join(t.name for t in GGMLQuantizationType)
        raise WeightError(
            f"unknown GGML type {qtype!r}: expected one of {known}"
        ) from None
    return int(block_elems), int(block_bytes)


def packed_shape(qtype: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of a tensor's packed bytes: ``shape`` with its last dim replaced by bytes per row.

    Args:
        qtype: the GGML storage type, e.g. ``"Q8_0"``.
        shape: the logical element shape in NumPy (row-major) order.

    Raises:
        WeightError: the last dim is not a whole number of blocks.
    """
    block_elems, block_bytes = block_layout(qtype)
    dims = tuple(int(d) for d in shape) or (1,)
    if dims[-1] % block_elems:
        raise WeightError(
            f"{qtype} tensor of shape {tuple(shape)}: the last dim {dims[-1]} is not a multiple of "
            f"the {qtype} block size {block_elems}; the file is corrupt or the shape is wrong"
        )
    return (*dims[:-1], dims[-1] // block_elems * block_bytes)


# ---------------------------------------------------------------------------------------------
# primitives shared by numpy and jax.numpy


def _bitcast(x: Any, dtype: Any, xp: ModuleType) -> Any:
    """Reinterpret the trailing byte axis of uint8 ``x`` (size ``itemsize``) as one ``dtype``."""
    if xp is np:
        return np.ascontiguousarray(x).view(dtype)[..., 0]
    import jax  # noqa: PLC0415 - jax is only needed on the in-graph path

    # Little-endian bytes assembled into an unsigned word first, then bitcast at the same
    # width: a narrowing uint8 -> float16 bitcast breaks shape refinement with symbolic dims.
    width = x.shape[-1]
    word = {2: xp.uint16, 4: xp.uint32}[width]
    u = x[..., 0].astype(word)
    for i in range(1, width):
        u = u | (x[..., i].astype(word) << (8 * i))
    return jax.lax.bitcast_convert_type(u, dtype)


def _f16(x: Any, xp: ModuleType) -> Any:
    """Little-endian f16 bytes ``(n, 2)`` -> float32 ``(n, 1)``."""
    return _bitcast(x, xp.float16, xp).astype(xp.float32)[:, None]


def _int8(x: Any, xp: ModuleType) -> Any:
    """uint8 holding two's-complement int8 -> float32, without relying on wrapping casts."""
    f = x.astype(xp.float32)
    return xp.where(x >= 128, f - 256.0, f)


def _shifts(values: Sequence[int], ndim: int, axis: int, xp: ModuleType) -> Any:
    """A uint8 vector of shift amounts, broadcastable along ``axis`` of an ``ndim`` array."""
    shape = [1] * ndim
    shape[axis] = len(values)
    return xp.asarray(np.array(values, np.uint8).reshape(shape))


def _nibbles(qs: Any, n: int, groups: int, width: int, xp: ModuleType) -> Any:
    """Split bytes ``(n, groups*width)`` into low then high nibbles: ``(n, groups, 2, width)``."""
    q = qs.reshape((n, groups, 1, width)) >> _shifts([0, 4], 4, 2, xp)
    return q & 0x0F


def _bits(qh: Any, n: int, groups: int, width: int, nbits: int, xp: ModuleType) -> Any:
    """Unpack the ``nbits``-bit fields of ``(n, groups*width)`` bytes.

    Returns ``(n, groups, 8//nbits, width)``: field ``k`` of each byte (bits ``k*nbits`` up)
    lands at index ``k`` of axis 2.
    """
    q = qh.reshape((n, groups, 1, width)) >> _shifts(range(0, 8, nbits), 4, 2, xp)
    return q & ((1 << nbits) - 1)


def _qh_bits32(qh: Any, n: int, xp: ModuleType) -> Any:
    """Four bytes of per-element high bits -> ``(n, 32)``.

    Bit ``i`` is bit ``i%8`` of byte ``i//8`` (a little-endian uint32), with no uint32 needed.
    """
    bits = qh.reshape((n, 4, 1)) >> _shifts(range(8), 3, 2, xp)
    return (bits & 1).reshape((n, 32))


# ---------------------------------------------------------------------------------------------
# one function per type: (n_blocks, block_bytes) uint8 -> (n_blocks, block_elems) float32


def _f32(b: Any, xp: ModuleType) -> Any:
    return _bitcast(b.reshape((b.shape[0], -1, 4)), xp.float32, xp)


def _f16_plain(b: Any, xp: ModuleType) -> Any:
    return _bitcast(b.reshape((b.shape[0], -1, 2)), xp.float16, xp).astype(xp.float32)


def _bf16(b: Any, xp: ModuleType) -> Any:
    bf16 = ml_dtypes.bfloat16 if xp is np else xp.bfloat16
    return _bitcast(b.reshape((b.shape[0], -1, 2)), bf16, xp).astype(xp.float32)


def _q8_0(b: Any, xp: ModuleType) -> Any:
    return _int8(b[:, 2:], xp) * _f16(b[:, :2], xp)


def _q4_0(b: Any, xp: ModuleType) -> Any:
    n = b.shape[0]
    q = _nibbles(b[:, 2:], n, 1, 16, xp).reshape((n, 32)).astype(xp.float32) - 8.0
    return _f16(b[:, :2], xp) * q


def _q4_1(b: Any, xp: ModuleType) -> Any:
    n = b.shape[0]
    q = _nibbles(b[:, 4:], n, 1, 16, xp).reshape((n, 32)).astype(xp.float32)
    return _f16(b[:, :2], xp) * q + _f16(b[:, 2:4], xp)


def _q5(qh: Any, qs: Any, xp: ModuleType) -> Any:
    n = qs.shape[0]
    low = _nibbles(qs, n, 1, 16, xp).reshape((n, 32))
    return (low | (_qh_bits32(qh, n, xp) << 4)).astype(xp.float32)


def _q5_0(b: Any, xp: ModuleType) -> Any:
    return _f16(b[:, :2], xp) * (_q5(b[:, 2:6], b[:, 6:], xp) - 16.0)


def _q5_1(b: Any, xp: ModuleType) -> Any:
    return _f16(b[:, :2], xp) * _q5(b[:, 4:8], b[:, 8:], xp) + _f16(b[:, 2:4], xp)


def _q2_k(b: Any, xp: ModuleType) -> Any:
    # scales[16] (low nibble: scale, high: min) | qs[64] (2-bit) | d f16 | dmin f16
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16(b[:, 80:82], xp) * (sc & 0x0F).astype(xp.float32)).reshape((n, 16, 1))
    ml = (_f16(b[:, 82:84], xp) * (sc >> 4).astype(xp.float32)).reshape((n, 16, 1))
    q = _bits(b[:, 16:80], n, 2, 32, 2, xp).reshape((n, 16, 16)).astype(xp.float32)
    return (dl * q - ml).reshape((n, QK_K))


def _q3_k(b: Any, xp: ModuleType) -> Any:
    # hmask[32] | qs[64] (low 2 bits) | scales[12] (16 x 6-bit, packed) | d f16
    n = b.shape[0]
    scales = b[:, 96:108]
    low = _nibbles(scales[:, :8], n, 1, 8, xp).reshape((n, 16))
    high = _bits(scales[:, 8:], n, 1, 4, 2, xp).reshape((n, 16))
    sc = (low | (high << 4)).astype(xp.float32) - 32.0
    dl = (_f16(b[:, 108:110], xp) * sc).reshape((n, 16, 1))
    ql = _bits(b[:, 32:96], n, 2, 32, 2, xp).reshape((n, 16, 16)).astype(xp.float32)
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    qh = (_bits(b[:, :32], n, 1, 32, 1, xp).reshape((n, 16, 16)) ^ 1).astype(xp.float32)
    return (dl * (ql - 4.0 * qh)).reshape((n, QK_K))


def _scale_min_k4(scales: Any, n: int, xp: ModuleType) -> tuple[Any, Any]:
    """Unpack the 8 six-bit scales and mins of Q4_K/Q5_K from their 12 bytes."""
    s = scales.reshape((n, 3, 4))
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = xp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = xp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(xp.float32), mn.astype(xp.float32)


def _k4_scales(b: Any, n: int, xp: ModuleType) -> tuple[Any, Any]:
    sc, mn = _scale_min_k4(b[:, 4:16], n, xp)
    d = (_f16(b[:, :2], xp) * sc).reshape((n, 8, 1))
    dm = (_f16(b[:, 2:4], xp) * mn).reshape((n, 8, 1))
    return d, dm


def _q4_k(b: Any, xp: ModuleType) -> Any:
    # d f16 | dmin f16 | scales[12] | qs[128]
    n = b.shape[0]
    d, dm = _k4_scales(b, n, xp)
    q = _nibbles(b[:, 16:], n, 4, 32, xp).reshape((n, 8, 32)).astype(xp.float32)
    return (d * q - dm).reshape((n, QK_K))


def _q5_k(b: Any, xp: ModuleType) -> Any:
    # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    n = b.shape[0]
    d, dm = _k4_scales(b, n, xp)
    ql = _nibbles(b[:, 48:], n, 4, 32, xp).reshape((n, 8, 32))
    qh = _bits(b[:, 16:48], n, 1, 32, 1, xp).reshape((n, 8, 32))
    q = (ql | (qh << 4)).astype(xp.float32)
    return (d * q - dm).reshape((n, QK_K))


def _q6_k(b: Any, xp: ModuleType) -> Any:
    # ql[128] (low nibbles) | qh[64] (high 2 bits) | scales[16] int8 | d f16
    n = b.shape[0]
    d = (_f16(b[:, 208:210], xp) * _int8(b[:, 192:208], xp)).reshape((n, 16, 1))
    ql = _nibbles(b[:, :128], n, 2, 64, xp).reshape((n, 8, 32))
    qh = _bits(b[:, 128:192], n, 2, 32, 2, xp).reshape((n, 8, 32))
    q = (ql | (qh << 4)).astype(xp.float32) - 32.0
    return (d * q.reshape((n, 16, 16))).reshape((n, QK_K))


_DEQUANTIZERS: dict[str, Callable[[Any, ModuleType], Any]] = {
    "F32": _f32,
    "F16": _f16_plain,
    "BF16": _bf16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}

PACKABLE_TYPES: tuple[str, ...] = tuple(_DEQUANTIZERS)
"""GGML types :func:`dequantize` implements: they can be bound packed and dequantized in-graph."""


def dequantize_rows(rows: Any, qtype: str, *, xp: ModuleType) -> Any:
    """Dequantize rows of GGML blocks ``(..., row_bytes)`` to float32 ``(..., row_elems)``.

    Unlike :func:`dequantize`, the leading dims may be symbolic (inside a ``jax.export`` with
    a symbolic batch): only the row length must be known. Used in-graph for embedding lookups
    and for the non-CPU branch of the quantized matmul.

    Raises:
        WeightError: an unknown type, or a row length that is not whole blocks.
    """
    fn = _DEQUANTIZERS.get(qtype)
    if fn is None:
        raise WeightError(f"cannot dequantize GGML type {qtype!r} in-graph: expected one of "
                          f"{', '.join(PACKABLE_TYPES)}")
    block_elems, block_bytes = block_layout(qtype)
    row_bytes = int(rows.shape[-1])
    if row_bytes % block_bytes:
        raise WeightError(f"{qtype} rows of {row_bytes} bytes are not whole {block_bytes}-byte "
                          f"blocks")
    per_row = row_bytes // block_bytes
    lead = tuple(rows.shape[:-1])
    out = fn(rows.reshape((-1, block_bytes)), xp)
    return out.reshape((*lead, per_row * block_elems))


def dequantize(blocks: Any, qtype: str, shape: Sequence[int], *, xp: ModuleType = np) -> Any:
    """Dequantize the raw bytes of one GGML tensor to float32.

    Args:
        blocks: the tensor's stored bytes as uint8, 1-D or ``(..., row_bytes)`` (any shape with
            the right number of bytes). A NumPy array (``xp=numpy``) or a JAX array/tracer.
        qtype: the GGML type name, one of :data:`PACKABLE_TYPES`.
        shape: the logical element shape in NumPy order (last axis = GGUF's ``ne0``).
        xp: ``numpy`` (bind time) or ``jax.numpy`` (inside a traced/exported graph).

    Returns:
        A float32 array of ``shape``, of the same array module as ``xp``.

    Raises:
        WeightError: ``qtype`` is not supported, ``blocks`` is not uint8, or its size does not
            match ``shape``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda b: dequantize(b, "Q8_0", (2, 32), xp=jnp))
        >>> f(jnp.zeros((2, 34), jnp.uint8)).shape
        (2, 32)
    """
    fn = _DEQUANTIZERS.get(qtype)
    if fn is None:
        raise WeightError(
            f"cannot dequantize GGML type {qtype!r} with jaxdist.core.quant: expected one of "
            f"{', '.join(PACKABLE_TYPES)}; bind the weight unpacked (dequantized at bind time)"
        )
    if np.dtype(blocks.dtype) != np.uint8:
        raise WeightError(
            f"{qtype} blocks must be uint8, found {blocks.dtype}; pass the tensor's stored bytes"
        )
    dims = tuple(int(d) for d in shape)
    block_elems, block_bytes = block_layout(qtype)
    packed = packed_shape(qtype, dims)
    n_bytes = math.prod(packed)
    if math.prod(blocks.shape) != n_bytes:
        raise WeightError(
            f"{qtype} tensor of shape {dims}: expected {n_bytes} bytes of blocks "
            f"({n_bytes // block_bytes} blocks x {block_bytes} B), found {math.prod(blocks.shape)} "
            f"bytes in an array of shape {tuple(blocks.shape)}"
        )
    n_blocks = n_bytes // block_bytes
    b = blocks.reshape((n_blocks, block_bytes))
    if xp is not np or n_blocks <= _NUMPY_CHUNK_BLOCKS:
        return fn(b, xp).reshape(dims)
    logger.debug("dequantizing %s %s in chunks of %d blocks", qtype, dims, _NUMPY_CHUNK_BLOCKS)
    out = np.empty((n_blocks, block_elems), np.float32)
    for start in range(0, n_blocks, _NUMPY_CHUNK_BLOCKS):
        stop = start + _NUMPY_CHUNK_BLOCKS
        out[start:stop] = fn(b[start:stop], np)
    return out.reshape(dims)
