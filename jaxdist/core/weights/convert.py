"""From a tensor's stored bytes to the array a stage binds: dtype names, the cast rules, and
buffers XLA:CPU takes in place.

The cast rules: floats convert to any float width (the compute-dtype choice); integers to any
integer width whose range holds the values; a cast across families (float <-> int/bool) is
refused with a :class:`~jaxdist.core.errors.WeightError` that names the weight.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist.core.errors import WeightError
from jaxdist.core.quant import packed_shape
from jaxdist.core.weights.uri import WeightInfo

__all__ = ["aligned_empty", "as_dtype", "byte_shape", "check_cast", "check_int_range", "convert",
           "drop_pages", "dtype_family"]


def as_dtype(dtype: Any, where: str) -> np.dtype[Any]:
    """A NumPy dtype from a name or type; ``"bfloat16"`` and the FP8 names come from ml_dtypes."""
    if dtype is None:
        raise WeightError(f"{where}: no dtype given; expected a dtype name such as 'float32'")
    try:
        found: np.dtype[Any] = np.dtype(dtype)
        return found
    except TypeError:
        extra = getattr(ml_dtypes, dtype, None) if isinstance(dtype, str) else None
        if isinstance(extra, type) and issubclass(extra, np.generic):
            return np.dtype(extra)
        raise WeightError(
            f"{where}: unknown dtype {dtype!r}; expected a NumPy dtype name such as 'float32', "
            f"'float16', 'bfloat16' or 'int64'"
        ) from None


def dtype_family(dt: np.dtype[Any]) -> str:
    if dt.kind == "f" or dt.name.startswith(("bfloat", "float")):
        return "float"
    return {"i": "int", "u": "int", "b": "bool"}.get(dt.kind, dt.kind)


_ALIGN = 64  # XLA:CPU uses a host buffer in place only at this alignment
_HUGE = 2 << 20  # an x86-64 transparent huge page
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def _ask_huge_pages(addr: int, nbytes: int) -> None:
    """Ask Linux for transparent huge pages under the whole 2 MiB pages of a fresh range.

    A decode step streams every weight once. With 4 KiB pages one core's hardware prefetchers
    stop at every page boundary; with 2 MiB pages the kernels read the same bytes 15-25% faster
    (bench/NOTES.md, "Decode on a ~1B model"). Only pages wholly inside the range are advised,
    so no byte beyond the array is ever backed. Where THP is off or "never", or outside Linux,
    this does nothing; it is advice either way, never an error.
    """
    madvise = _madvise()
    first = -(-addr // _HUGE) * _HUGE
    last = (addr + nbytes) // _HUGE * _HUGE
    if madvise is not None and last > first:
        madvise(first, last - first, _MADV_HUGEPAGE)


def aligned_empty(shape: tuple[int, ...], dt: np.dtype[Any]) -> np.ndarray:
    """An uninitialized C-contiguous array on a 64-byte boundary, so that
    ``jax.device_put(a, cpu_device, may_alias=True)`` takes it as the device buffer, no copy.
    Arrays of several MiB get transparent huge pages where Linux offers them
    (:func:`_ask_huge_pages`): they are touched first after this, by the copy from the file."""
    nbytes = math.prod(shape) * dt.itemsize
    buf = np.empty(nbytes + _ALIGN, np.uint8)
    start = -buf.ctypes.data % _ALIGN
    if nbytes >= 2 * _HUGE:
        _ask_huge_pages(buf.ctypes.data + start, nbytes)
    return buf[start:start + nbytes].view(dt).reshape(shape)


def drop_pages(view: np.ndarray) -> None:
    """``MADV_DONTNEED`` the pages of a memory map behind ``view``.

    The pages are clean file pages: they leave this process's resident set (and stop counting in
    its RSS) but stay in the page cache; reading the range again faults them back in from the
    file. Does nothing for arrays that are not views of an ``mmap`` or where madvise is missing.
    """
    base: Any = view
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or view.nbytes == 0 or not hasattr(base, "madvise"):
        return
    start = view.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
    page = start - start % mmap.PAGESIZE
    base.madvise(mmap.MADV_DONTNEED, page, start + view.nbytes - page)


def check_cast(src: np.dtype[Any], dt: np.dtype[Any], where: str) -> None:
    """Refuse a cast across families (float <-> int/bool); see :func:`convert`."""
    if src != dt and dtype_family(src) != dtype_family(dt):
        raise WeightError(
            f"{where}: dtype mismatch: expected {dt.name}, found {src.name}; "
            f"a {dtype_family(src)} tensor is not converted to {dtype_family(dt)} implicitly, "
            f"fix the dtype in the spec"
        )


def check_int_range(arr: np.ndarray, dt: np.dtype[Any], where: str) -> None:
    """Refuse a narrowing integer cast when the values do not fit; see :func:`convert`."""
    if dtype_family(dt) == "int" and not np.can_cast(arr.dtype, dt) and arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        info = np.iinfo(dt)
        if lo < info.min or hi > info.max:
            raise WeightError(
                f"{where}: dtype mismatch: expected {dt.name}, found {arr.dtype.name} values in "
                f"[{lo}, {hi}] that {dt.name} cannot hold; widen the dtype in the spec"
            )


def convert(arr: np.ndarray, dt: np.dtype[Any], *, transpose: bool, where: str) -> np.ndarray:
    """Transpose (reverse axes) and cast in one copy; no copy at all when neither is needed.

    Floats convert to any float width (that is the compute-dtype choice); integers to any integer
    width whose range holds the values. Crossing families (float <-> int/bool) is refused.
    """
    src = arr.T if transpose else arr
    if arr.dtype == dt:
        return np.ascontiguousarray(src) if transpose else np.asarray(src)
    check_cast(arr.dtype, dt, where)
    check_int_range(arr, dt, where)
    return np.array(src, dtype=dt, order="C")


def byte_shape(info: WeightInfo) -> tuple[int, ...]:
    """Shape of a tensor's stored bytes: its shape with the last dim replaced by bytes per row."""
    if info.quant is not None:
        return packed_shape(info.quant, info.shape)
    if not info.shape:
        return (info.nbytes,)
    itemsize = as_dtype(info.dtype, info.name).itemsize
    return (*info.shape[:-1], info.shape[-1] * itemsize)
