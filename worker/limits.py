"""The worker's resource limits that need code of their own: the whole-frame budget, and the
default bound on session state (KV) bytes.

Every limit is a ``WorkerConfig`` field and a worker flag (see SECURITY.md, "Limits and their
defaults"); exceeding one raises :class:`~jaxdist.core.errors.LimitError` (``RESOURCE_EXHAUSTED``)
with a message naming the flag, its value and what was asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import psutil

from jaxdist.core.errors import LimitError
from jaxdist.core.weights.uri import clip

__all__ = ["KV_MEMORY_FRACTION", "MAX_ID_BYTES", "FrameBudget", "InflightBytes", "PeerStreams",
           "check_ids", "default_max_kv_bytes", "next_within", "peer_host"]

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


T = TypeVar("T")


async def next_within(messages: AsyncIterator[T], timeout: float | None) -> T | None:
    """A stream's next message, or ``None`` at its end (the idle bound of ``Push`` and
    ``UploadArtifact``).

    Raises:
        TimeoutError: none came within ``timeout`` seconds (``None``: no bound).
    """
    async with asyncio.timeout(timeout):
        return await anext(messages, None)


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
    the number of distinct tensors; this counts, for the whole frame, across its messages and
    tensors, the sizes its tensors declare and the bytes that arrived, and the tensors that
    began, before the assembler copies anything.

    Args:
        max_bytes: most tensor bytes in one frame (``--max-frame-bytes``).
        max_tensors: most tensors in one frame (``--max-tensors-per-frame``).
    """

    __slots__ = ("_bytes", "_declared", "_tensors", "max_bytes", "max_tensors")

    def __init__(self, max_bytes: int, max_tensors: int) -> None:
        self.max_bytes = max_bytes
        self.max_tensors = max_tensors
        self._bytes = 0
        self._declared = 0
        self._tensors = 0

    def add(self, chunks: Sequence[Any], header: Any) -> int:
        """Count one message's chunks (``codec.Chunk`` tuples) of the frame ``header`` names.

        Returns:
            the bytes these chunks make the worker hold: the tensor data they bring. A tensor's
            buffer is allocated at its declared size when its first chunk arrives, uninitialized
            (``codec.TensorAssembler``): its pages cost memory only once the chunks written into
            them arrive, so a frame holds what it was sent, not what it declared.

        Raises:
            LimitError: the frame is over either limit, in the bytes that arrived or in the
                sizes its tensors declare (refused up front, before their bytes arrive);
                :meth:`reset` before the next frame.
        """
        n, t, declared = self._bytes, self._tensors, self._declared
        for chunk in chunks:
            size = len(chunk[3])
            n += size
            if chunk[4] == 0:  # a tensor's first chunk is the one at offset 0
                t += 1
                one = max(size, chunk[5])
                if one <= self.max_bytes:  # a tensor over it alone: the assembler says so
                    declared += one
        held = n - self._bytes
        self._bytes, self._tensors, self._declared = n, t, declared
        if n > self.max_bytes:
            raise LimitError(f"frame of session {header.session_id!r} step {header.step} is over "
                             f"the frame size limit (--max-frame-bytes={self.max_bytes}): "
                             f"{n} bytes of tensor data so far")
        if declared > self.max_bytes:
            raise LimitError(f"frame of session {header.session_id!r} step {header.step} is over "
                             f"the frame size limit (--max-frame-bytes={self.max_bytes}): its "
                             f"tensors declare {declared} bytes so far")
        if t > self.max_tensors:
            raise LimitError(f"frame of session {header.session_id!r} step {header.step}: more "
                             f"than {self.max_tensors} tensors in one frame, the tensor count "
                             f"limit (--max-tensors-per-frame={self.max_tensors}): {t} so far")
        return held

    def reset(self) -> None:
        self._bytes = 0
        self._declared = 0
        self._tensors = 0


class InflightBytes:
    """The bytes of frames a worker is receiving, all its streams together (on the loop only).

    What counts is what arrived, not what was declared: the tensor data of a frame's messages
    as they are taken, and on a data connection each part of a message as it is read
    (``stream.read_message``), until the frame completes, fails or its stream ends. A declared
    size is checked only against the per-frame limits (``--max-frame-bytes``, the tensor and
    message limits), up front; the buffers it sizes are allocated uninitialized, so their pages
    cost memory only once written. Without this bound, a few streams that each send most of a
    1 GiB frame and stall would hold gigabytes between them; and were the declared sizes
    counted instead, a stream that declares 1 GiB and sends nothing would keep the budget from
    everyone else.

    Args:
        limit: the most bytes held at once (``--max-inflight-bytes``).
    """

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int, what: str) -> None:
        """Count ``n`` more bytes for ``what`` (a frame, a message), or refuse them.

        Raises:
            LimitError: naming ``what``, the bytes held, the limit and the flag.
        """
        if n and self.held + n > self.limit:
            raise LimitError(f"{what}: the frames being received by this worker hold "
                             f"{self.held} bytes; {n} more would pass the limit of {self.limit} "
                             f"(--max-inflight-bytes)")
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``) or of a
    ``HOST:PORT``: the unit streams are counted by. A peer without a port is itself."""
    kind, sep, rest = peer.partition(":")
    if sep and kind in ("ipv4", "ipv6"):
        peer = rest
    elif kind == "unix":
        return peer
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else peer


class PeerStreams:
    """Streams open per peer host: ``Push``, ``Subscribe`` and data connections (on the loop
    only). Streams cost the worker no thread, but each holds memory and a share of gRPC's
    concurrent-call limit; without this bound one client's idle streams took all of it, and every
    other client got "Concurrent RPC limit exceeded".

    Args:
        limit: the most streams one peer host holds open at once (``--max-streams-per-peer``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self.total = 0  # streams open, all peers (read from any thread)

    @contextmanager
    def hold(self, what: str, peer: str) -> Iterator[None]:
        """Count a stream of ``peer`` while the block runs. See :meth:`enter`."""
        host = self.enter(what, peer)
        try:
            yield
        finally:
            self.leave(host)

    def enter(self, what: str, peer: str) -> str:
        """Count a stream of ``peer`` (a gRPC peer string or ``HOST:PORT``); the host to
        :meth:`leave` when it ends.

        Raises:
            LimitError: the peer's host has ``limit`` streams open already; names ``what``,
                the host, the count and the flag.
        """
        host = peer_host(peer)
        n = self._open.get(host, 0)
        if n >= self.limit:
            raise LimitError(f"{what} from {clip(host, 80)}: that host holds {n} streams (Push, "
                             f"Subscribe and data connections) open on this worker, the limit "
                             f"(--max-streams-per-peer={self.limit}); close some, or raise it")
        self._open[host] = n + 1
        self.total += 1
        return host

    def leave(self, host: str) -> None:
        self.total -= 1
        if self._open[host] <= 1:
            del self._open[host]
        else:
            self._open[host] -= 1
