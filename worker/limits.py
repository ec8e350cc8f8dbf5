"""The worker's resource limits that need code of their own: the whole-frame budget, and the
default bound on session state (KV) bytes.

Every limit is a ``WorkerConfig`` field and a worker flag (see SECURITY.md, "Limits and their
defaults"); exceeding one raises :class:`~jaxdist.core.errors.LimitError` (``RESOURCE_EXHAUSTED``)
with a message naming the flag, its value and what was asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil

from jaxdist.core.errors import LimitError
from jaxdist.core.weights.uri import clip

log = logging.getLogger(__name__)

__all__ = ["KV_MEMORY_FRACTION", "MAX_ID_BYTES", "FrameBudget", "InflightBytes", "OpenStream",
           "Streams", "check_ids", "default_max_kv_bytes", "next_within", "peer_host",
           "stream_owner"]

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


def stream_owner(peer: str, pipeline_id: str | None = None) -> str:
    """Whom a stream is counted under: ``pipeline ID`` for a stream that proved a pipeline's own
    key (its hop credential, or a ``Subscribe``'s key), else ``host HOST``. The workers' token is
    shared by every coordinator of a cluster, so it tells none apart; a pipeline's key does."""
    return f"pipeline {pipeline_id}" if pipeline_id is not None else f"host {peer_host(peer)}"


@dataclass(eq=False)
class OpenStream:
    """A stream counted by :class:`Streams`: whom it is counted under and, for a stream of
    frames, the task reading it, which is stopped when the stream has sent nothing for a while
    and its owner needs room."""

    owner: str
    what: str
    task: asyncio.Task[Any] | None = None  # None: never closed for room (Subscribe)
    last: float = field(default_factory=time.monotonic)  # when it last sent a message
    waiting: bool = False  # its task waits in next()
    closed_why: str | None = None  # set when it was closed for another stream of its owner

    async def next(self, message: Awaitable[T]) -> T:
        """Await the stream's next message (its task's only wait for one).

        Raises:
            LimitError: the stream was closed for another of its owner, saying why.
        """
        if self.closed_why is not None:
            if isinstance(message, Coroutine):
                message.close()
            raise LimitError(self.closed_why)
        self.waiting = True
        try:
            got = await message
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.closed_why is None or task is None:
                raise
            task.uncancel()
            raise LimitError(self.closed_why) from None
        finally:
            self.waiting = False
        self.last = time.monotonic()
        return got


class Streams:
    """Streams open per owner (:func:`stream_owner`): ``Push``, ``Subscribe`` and data
    connections (on the loop only). Streams cost the worker no thread, but each holds memory and
    a share of gRPC's concurrent-call limit; without a bound one client's idle streams took all
    of it, and every other client got "Concurrent RPC limit exceeded".

    An owner at its limit that opens another stream gets room from its own streams of frames
    that have sent nothing for ``idle_s`` (the oldest first; each is closed with a message
    saying why); with none, the new stream is refused. So a pipeline's streams are never closed
    for another client, and a client's idle streams never keep it out.

    Args:
        limit: the most streams one owner holds open at once (``--max-streams-per-peer``).
        idle_s: how long a stream of frames must have sent nothing to be closed for room
            (``--frame-idle-timeout``).
    """

    def __init__(self, limit: int, idle_s: float) -> None:
        self.limit = limit
        self.idle_s = idle_s
        self._open: dict[str, list[OpenStream]] = {}
        self.total = 0  # streams open, all owners (read from any thread)
        self.closed_idle = 0  # streams closed for room, since start

    @contextmanager
    def hold(self, what: str, owner: str, *, frames: bool = False) -> Iterator[OpenStream]:
        """Count a stream while the block runs. See :meth:`enter`."""
        opened = self.enter(what, owner, frames=frames)
        try:
            yield opened
        finally:
            self.leave(opened)

    def enter(self, what: str, owner: str, *, frames: bool = False) -> OpenStream:
        """Count a stream of ``owner``; give it back with :meth:`leave` when it ends.

        Args:
            what: the kind of stream, for messages (``"Push"``, ``"Subscribe"``, ...).
            frames: a stream of frames, read by the current task with
                :meth:`OpenStream.next`: it may be closed for room once idle.

        Raises:
            LimitError: ``owner`` has ``limit`` streams open already, none of them of frames
                idle for ``idle_s``; names ``what``, the owner, the count and the flag.
        """
        streams = self._open.setdefault(owner, [])
        if len(streams) >= self.limit:
            self._make_room(what, owner, streams)
        opened = OpenStream(owner, what, asyncio.current_task() if frames else None)
        streams.append(opened)
        self.total += 1
        return opened

    def _make_room(self, what: str, owner: str, streams: list[OpenStream]) -> None:
        now = time.monotonic()
        idle = [s for s in streams if s.task is not None and now - s.last >= self.idle_s]
        if not idle:
            raise LimitError(
                f"{what} of {clip(owner, 90)}: it holds {len(streams)} streams (Push, "
                f"Subscribe and data connections) open on this worker, the limit "
                f"(--max-streams-per-peer={self.limit}), and none of its streams of frames "
                f"has been idle for {self.idle_s:g} s (--frame-idle-timeout) to be closed for "
                f"it; close some, or raise the limit")
        victim = min(idle, key=lambda s: s.last)
        why = (f"closed: this {victim.what} stream sent nothing for {now - victim.last:.0f} s "
               f"(--frame-idle-timeout={self.idle_s:g}) and {clip(owner, 90)} opened another "
               f"past its limit of {self.limit} streams (--max-streams-per-peer)")
        self.leave(victim)
        victim.closed_why = why
        self.closed_idle += 1
        log.info("%s", why)
        if victim.waiting and victim.task is not None:
            victim.task.cancel()  # else it ends at its next wait

    def leave(self, opened: OpenStream) -> None:
        """Give back ``opened``'s place (once: a stream closed for room already gave it)."""
        if opened.closed_why is not None:
            return
        streams = self._open.get(opened.owner, [])
        if opened in streams:
            streams.remove(opened)
            self.total -= 1
            if not streams:
                del self._open[opened.owner]
