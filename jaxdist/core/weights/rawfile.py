"""``file://PATH`` weights: one raw little-endian array per file, shape and dtype from the spec.

The file carries no header, so its size is the only thing to check: it must equal
``prod(shape) * itemsize`` exactly.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist.core.errors import WeightError

__all__ = ["file_bytes", "map_fd", "read_raw"]

logger = logging.getLogger(__name__)


def map_fd(fd: int, path: str | os.PathLike[str]) -> np.ndarray:
    """Map the file open on ``fd`` as a flat read-only uint8 array, then close ``fd`` (the map
    keeps what it needs). ``path`` names it in errors.

    Raises:
        WeightError: the file cannot be mapped.
    """
    try:
        if os.fstat(fd).st_size == 0:  # np.memmap refuses empty files
            return np.zeros(0, np.uint8)
        with os.fdopen(os.dup(fd), "rb") as f:
            return np.memmap(f, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise WeightError(f"weight file '{path}' could not be mapped: {exc}") from exc
    finally:
        os.close(fd)


def file_bytes(path: str | os.PathLike[str]) -> np.ndarray:
    """The whole file as a flat read-only uint8 memory map (empty files give an empty array).

    Raises:
        WeightError: the file cannot be opened.
    """
    try:
        if os.path.getsize(path) == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as exc:
        raise WeightError(f"raw weight file '{path}' could not be read: {exc}") from exc


def read_raw(
    path: str | os.PathLike[str],
    *,
    shape: Sequence[int],
    dtype: np.dtype[Any],
    uri: str,
    data: np.ndarray | None = None,
) -> np.ndarray:
    """Map a raw little-endian array.

    Args:
        path: real path of the file (already checked against the weight roots).
        data: the file's bytes, mapped already (what a checksum was computed on); default:
            map ``path``.
        shape: the array shape the spec gives.
        dtype: the element dtype the spec gives (read little-endian).
        uri: the URI, for error messages.

    Returns:
        A read-only memory-mapped array of ``shape`` and ``dtype``.

    Raises:
        WeightError: the file size is not ``prod(shape) * itemsize``.
    """
    dims = tuple(int(d) for d in shape)
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    expected = math.prod(dims) * dt.itemsize
    if data is None:
        data = file_bytes(path)
    if data.size != expected:
        raise WeightError(
            f"raw weight '{uri}': size mismatch: expected {expected} bytes "
            f"({dt.name} {dims}), found {data.size} bytes in '{path}'; "
            f"fix the shape/dtype in the spec or the file"
        )
    logger.debug("mapped raw %s as %s %s", path, dt.name, dims)
    return data.view(dt).reshape(dims)
