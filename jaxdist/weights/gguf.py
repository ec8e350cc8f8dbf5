"""A memory-mapped GGUF reader: tensor info, stored bytes, dequantized arrays and metadata.

``gguf.GGUFReader`` memory-maps the file and parses only the header, so opening even a multi-GB
model is cheap and describing it reads no tensor data. GGUF lists dims fastest-first (``ne0``
first); everything here reports NumPy (row-major) order, i.e. reversed.

Dequantization uses :func:`jaxdist.quant.dequantize` for :data:`jaxdist.quant.PACKABLE_TYPES`.
The other GGML types that ``gguf.quants`` can decode (the IQ*, TQ*, MXFP4 families) are decoded by
``gguf.quants.dequantize`` on purpose: they are rare, their lookup-grid layouts are long, and the
reference implementation is exact. Such tensors can only be bound unpacked, because no in-graph
dequantizer exists for them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np
from gguf import quants as gguf_quants

from jaxdist import quant
from jaxdist.errors import WeightError
from jaxdist.weights.uri import WeightInfo

__all__ = ["GGUFFile", "metadata"]

logger = logging.getLogger(__name__)

_T = gguf.GGMLQuantizationType

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

# Keys GGUFReader synthesises from the file header; they are not key/value metadata.
_HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


class GGUFFile:
    """One open (memory-mapped) GGUF file.

    Args:
        path: real path of the ``.gguf`` file (already checked against the weight roots).

    Raises:
        WeightError: the file cannot be opened, is not GGUF, or is big-endian.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise WeightError(
                f"GGUF file '{self.path}' could not be read: {exc}; expected a GGUF v2/v3 file "
                f"(check the file is complete and really GGUF)"
            ) from exc
        if self._reader.byte_order != "I":
            raise WeightError(
                f"GGUF file '{self.path}' is big-endian; expected little-endian, found the "
                f"opposite byte order; convert it with llama.cpp's gguf tools"
            )
        self._tensors = {t.name: t for t in self._reader.tensors}
        logger.debug("opened GGUF %s: %d tensors", self.path, len(self._tensors))

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._tensors)

    def _tensor(self, name: str) -> Any:
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
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        plain = _PLAIN.get(t.tensor_type)
        return WeightInfo(
            name=name,
            shape=shape,
            dtype=plain.name if plain is not None else "float32",
            quant=None if plain is not None else t.tensor_type.name,
            nbytes=int(t.n_bytes),
            path=self.path,
        )

    def describe(self) -> dict[str, WeightInfo]:
        """Info of every tensor, in file order, without reading tensor data."""
        return {name: self.info(name) for name in self._tensors}

    def stored_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored in the file: a flat uint8 view of the memory map."""
        return self._tensor(name).data.reshape(-1).view(np.uint8)

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
            logger.debug("dequantizing %s (%s) with jaxdist.quant", name, info.quant)
            return quant.dequantize(raw, info.quant, info.shape)
        logger.debug("dequantizing %s (%s) with gguf.quants (no in-graph path)", name, info.quant)
        try:
            rows = raw.reshape(quant.packed_shape(info.quant, info.shape))
            out = gguf_quants.dequantize(rows, _T[info.quant])
        except NotImplementedError as exc:
            raise WeightError(
                f"tensor '{name}' in '{self.path}' has GGML type {info.quant}, which neither "
                f"jaxdist.quant ({', '.join(quant.PACKABLE_TYPES)}) nor gguf.quants can "
                f"dequantize; requantize the model to a supported type"
            ) from exc
        return np.asarray(out, dtype=np.float32).reshape(info.shape)

    def metadata(self) -> dict[str, Any]:
        """GGUF key/value metadata: strings decoded, arrays as lists, scalars as Python values."""
        out: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key in _HEADER_KEYS:
                continue
            out[key] = field.contents()
        return out

    def close(self) -> None:
        """Drop the reader; the memory map closes once no array views of it remain."""
        self._tensors = {}
        self._reader = None  # type: ignore[assignment]


def metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (architecture, hyperparameters, tokenizer).

    This opens ``path`` directly, without weight-root checks: it is meant for the coordinator
    reading a model it holds. Workers go through :meth:`jaxdist.weights.WeightCache.metadata`.

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
