"""Give the process's free heap back to the operating system (glibc ``malloc_trim``).

Binding a stage (dequantizing, transposing) and compiling it (XLA, LLVM) allocate and free
hundreds of MB. glibc keeps freed memory in its arenas for reuse, so the resident set of a
worker stays at its peak long after: measured on SmolLM2 stages, 33 MB after binding and 49 MB
after compiling were free but resident (bench/NOTES.md, "Worker memory"). ``malloc_trim(0)``
returns those pages. It is glibc-only: elsewhere (musl, macOS) :func:`release_free_heap` does
nothing and says so once in the log, since those allocators return memory on their own terms.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from typing import Any

__all__ = ["release_free_heap"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_trim: Any = None  # the malloc_trim function; False once we know there is none


def _malloc_trim() -> Any:
    global _trim
    with _lock:
        if _trim is None:
            _trim = False
            name = ctypes.util.find_library("c")
            try:
                libc = ctypes.CDLL(name) if name else None
            except OSError:
                libc = None
            fn = getattr(libc, "malloc_trim", None)
            if fn is None:
                log.info("no glibc malloc_trim here (libc %s): freed heap is left to the "
                         "allocator", name)
            else:
                fn.argtypes = [ctypes.c_size_t]
                fn.restype = ctypes.c_int
                _trim = fn
        return _trim


def release_free_heap() -> bool:
    """Return free heap pages to the OS. True when glibc's ``malloc_trim`` ran.

    Cheap when there is little to return (microseconds to a few ms); call it after large
    transient work (binding, compiling), not per step.
    """
    fn = _malloc_trim()
    if not fn:
        return False
    fn(0)
    return True
