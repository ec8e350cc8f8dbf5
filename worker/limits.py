"""The worker's resource limits that need code of their own: the whole-frame budget, and the
default bound on session state (KV) bytes.

Every limit is a ``WorkerConfig`` field and a worker flag (see SECURITY.md, "Limits and their
defaults"); exceeding one raises :class:`~jaxdist.core.errors.LimitError` (``RESOURCE_EXHAUSTED``)
with a message naming the flag, its value and what was asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psutil

from jaxdist.core.errors import LimitError

__all__ = ["KV_MEMORY_FRACTION", "MAX_ID_BYTES", "FrameBudget", "check_ids",
           "default_max_kv_bytes"]

MAX_ID_BYTES = 256
"""Default ``--max-id-bytes``: the longest pipeline, stage, session, reply-to id or model name a
worker keeps (UTF-8 bytes). Ids are kept in tables, logs and ``Info``; an unbounded one (a
130 MiB pipeline id) made ``Info`` fail for every client until it was unloaded."""

KV_MEMORY_FRACTION = 0.5
"""Share of the memory behind the worker's device that session state may take by default.

Session state (KV caches) is allocated on the device when a session starts and stays there until
it ends, so the bound is the device's memory: the physical RAM for a CPU device, the device's own
memory where jax reports it. Half leaves the other half for the stages' weights, the compiled
executables, activations in flight and the rest of the machine. Read once, at start-up.
"""


def check_ids(where: str, limit: int, **ids: str) -> None:
    """Refuse an id longer than ``limit`` UTF-8 bytes, before anything keeps or logs it.

    Raises:
        LimitError: naming the request, the field, its size, the flag, and the id's start.
    """
    for field, value in ids.items():
        if 4 * len(value) <= limit:  # at most 4 bytes a character: no need to encode (per frame)
            continue
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise LimitError(f"{where}: {field} is {size} bytes, over the id length limit "
                             f"(--max-id-bytes={limit}); it starts {value[:40]!r}")


def default_max_kv_bytes(device_memory_total: int = 0) -> int:
    """The default ``--max-kv-bytes``: :data:`KV_MEMORY_FRACTION` of the device's memory.

    Args:
        device_memory_total: the device's memory in bytes when known (accelerators); 0 for a CPU
            device, whose state lives in the physical RAM.
    """
    total = device_memory_total or psutil.virtual_memory().total
    return int(total * KV_MEMORY_FRACTION)


class FrameBudget:
    """Counts what one frame on a ``Push`` stream has brought so far against the frame limits.

    The :class:`~jaxdist.core.transport.frames.FrameAssembler` checks each tensor's declared size and
    the number of distinct tensors; this counts the bytes that arrived for the whole frame, across
    its messages and tensors, and the tensors that began, before the assembler copies anything.

    Args:
        max_bytes: most tensor bytes in one frame (``--max-frame-bytes``).
        max_tensors: most tensors in one frame (``--max-tensors-per-frame``).
    """

    __slots__ = ("_bytes", "_tensors", "max_bytes", "max_tensors")

    def __init__(self, max_bytes: int, max_tensors: int) -> None:
        self.max_bytes = max_bytes
        self.max_tensors = max_tensors
        self._bytes = 0
        self._tensors = 0

    def add(self, chunks: Sequence[Any], header: Any) -> None:
        """Count one message's chunks (``codec.Chunk`` tuples) of the frame ``header`` names.

        Raises:
            LimitError: the frame is over either limit; :meth:`reset` before the next frame.
        """
        n, t = self._bytes, self._tensors
        for chunk in chunks:
            n += len(chunk[3])
            t += chunk[4] == 0  # a tensor's first chunk is the one at offset 0
        self._bytes, self._tensors = n, t
        if n > self.max_bytes:
            raise LimitError(f"frame of session {header.session_id!r} step {header.step} is over "
                             f"the frame size limit (--max-frame-bytes={self.max_bytes}): "
                             f"{n} bytes of tensor data so far")
        if t > self.max_tensors:
            raise LimitError(f"frame of session {header.session_id!r} step {header.step}: more "
                             f"than {self.max_tensors} tensors in one frame, the tensor count "
                             f"limit (--max-tensors-per-frame={self.max_tensors}): {t} so far")

    def reset(self) -> None:
        self._bytes = 0
        self._tensors = 0
