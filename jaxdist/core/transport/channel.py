"""gRPC channels and long-lived frame streams, shared by the coordinator and the workers.

Channel options raise the 4 MiB default message limit (frames are chunked to 1 MiB anyway, but
specs with inline artifacts can be larger) and turn on HTTP/2 keepalive, so a peer that vanishes
is noticed in seconds rather than at the next TCP timeout.

Two senders: :class:`FrameSender` for threads (the coordinator), and :class:`AsyncFrameSender`
for the worker's data-plane event loop. The second writes straight from the loop that produced
the frame; a thread-fed stream needs two thread handoffs per message (the caller's queue to
gRPC's request-iterator thread, and the send completion back to it), ~16 us each here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from jaxdist.core.errors import TransportError
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

__all__ = ["GRPC_OPTIONS", "AsyncFrameSender", "FrameSender", "make_aio_channel", "make_channel",
           "stub_for"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20

GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping every 2 s, give up 3 s after an unanswered ping: a dead peer shows within ~5 s.
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.min_time_between_pings_ms", 1000),
    # A fixed 16 MiB flow-control window per stream instead of BDP probing. The probe pings
    # the peer as data arrives, so on a stream of small frames a frame can cost an extra PING
    # and its ack on both ends: off, a 4 KB hop took 9-14% less time (A/B on this machine),
    # and 16 MiB frames moved as fast or faster. 16 MiB bounds what a sender may have
    # unacknowledged per stream (the receiver buffers at most that much).
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 16 << 20),
]

SERVER_OPTIONS: list[tuple[str, int]] = GRPC_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.so_reuseport", 0),
    # Before authentication nothing is held for long: a connection that has not finished its
    # HTTP/2 (and TLS) handshake within 2 s is closed (gRPC's default: 120 s), and the
    # connections held at once are bounded (jaxdist.worker.server sets the bound from the
    # worker's file descriptor limit), so idle sockets cannot take every descriptor. The worker
    # also has the kernel accept a connection only once it has sent data (openfiles.
    # defer_accept), so the handshake's clock starts with the client's first bytes in hand:
    # 2 s is one TLS round trip's worth many times over.
    ("grpc.server_handshake_timeout_ms", 2000),
]


def make_channel(address: str, *, credentials: grpc.ChannelCredentials | None = None
                 ) -> grpc.Channel:
    """Open a channel to ``HOST:PORT`` (TLS when credentials are given)."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def make_aio_channel(address: str, *, credentials: grpc.ChannelCredentials | None = None
                     ) -> grpc.aio.Channel:
    """Like :func:`make_channel`, for the running event loop (call it from that loop)."""
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS)
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


def stub_for(channel: grpc.Channel) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(channel)


_CLOSE = object()


class FrameSender:
    """One long-lived ``Push`` stream to a worker, fed from a bounded queue.

    ``send`` blocks when ``max_pending`` messages are queued, so a slow receiver slows the sender
    instead of growing memory. A broken stream calls ``on_error`` once with a TransportError that
    names the address; later sends raise it.

    Args:
        push: the peer's ``Push`` method (:func:`jaxdist.core.transport.wire.push_method`).
        address: the peer's ``HOST:PORT``, for error messages.
        on_error: called from the stream's thread when the stream fails.
        metadata: call metadata (e.g. a bearer token).
        max_pending: queue bound, in messages.
    """

    def __init__(self, push: Any, address: str, *,
                 on_error: Callable[[TransportError], None] | None = None,
                 metadata: tuple[tuple[str, str | bytes], ...] = (), max_pending: int = 64) -> None:
        self.address = address
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._on_error = on_error
        self._error: TransportError | None = None
        self._closed = False
        self._done = threading.Event()
        self._call = push.future(self._requests(), metadata=metadata)
        self._call.add_done_callback(self._finished)

    def _requests(self) -> Iterator[bytes | pb.Frame]:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            yield item  # type: ignore[misc]

    def _finished(self, call: grpc.Future) -> None:
        self._release()
        try:
            exc = call.exception()
        except grpc.FutureCancelledError:
            exc = None
        if exc is not None and not (self._closed and call.cancelled()):
            code = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
            details = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
            self._fail(TransportError(f"stream to worker {self.address} broke: {code}: {details}"))
        elif not self._closed:
            self._fail(TransportError(f"worker {self.address} closed the frame stream"))
        self._done.set()

    def _release(self) -> None:
        """End the request iterator: gRPC's thread that consumes it waits in it for the next
        message, and would wait for ever once the call is over (one thread lost per stream)."""
        while True:
            try:
                self._queue.put_nowait(_CLOSE)
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._queue.get_nowait()  # the call is over: queued messages go nowhere

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
            log.warning("%s", error)
            if self._on_error is not None:
                self._on_error(error)

    @property
    def error(self) -> TransportError | None:
        return self._error

    def send(self, msg: bytes | pb.Frame, timeout: float | None = None) -> None:
        """Queue one message. Raises TransportError if the stream broke or the queue stays full."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransportError(f"stream to worker {self.address} is closed")
        try:
            self._queue.put(msg, timeout=timeout)
        except queue.Full:
            raise TransportError(f"worker {self.address} did not accept frames for {timeout}s "
                                 f"({self._queue.maxsize} queued)") from None

    def send_frame(self, msgs: Iterable[bytes | pb.Frame], timeout: float | None = None
                   ) -> None:
        """Queue the messages of one frame (the caller keeps frames from interleaving)."""
        for msg in msgs:
            self.send(msg, timeout)

    def close(self, *, cancel: bool = False) -> None:
        """End the stream after the queued messages (or at once with ``cancel``)."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            self._call.cancel()
        else:
            try:
                self._queue.put(_CLOSE, timeout=5)
            except queue.Full:
                self._call.cancel()
        self._done.wait(timeout=5)


class AsyncFrameSender:
    """One long-lived ``Push`` stream to a worker, written from the event loop that made it.

    :meth:`send_frame` writes all messages of one frame under a lock, so frames of several
    stages sharing the stream never interleave. A write waits for HTTP/2 flow control: a slow
    receiver slows the sender, nothing queues without bound. A stream that breaks (or ends) sets
    :attr:`error`; the owner then opens a new one. A frame that is not taken within its timeout
    fails the stream; a watchdog checks that once a second, which costs less per frame than
    arming a timer around each write.

    Args:
        push: the peer's ``Push`` method on an aio channel
            (:func:`jaxdist.core.transport.wire.push_method`).
        address: the peer's ``HOST:PORT``, for error messages.
        metadata: call metadata (a next hop's stream: its pipeline's hop credential).
    """

    WATCH_S = 1.0

    def __init__(self, push: Any, address: str, *,
                 metadata: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        self.address = address
        self._error: TransportError | None = None
        self._closed = False
        self._lock = asyncio.Lock()
        self._since: float | None = None  # loop time the frame being written started
        self._timeout = 0.0
        self._call = push(metadata=metadata)
        self._call.add_done_callback(self._finished)
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def _finished(self, call: object) -> None:
        if not self._closed and self._error is None:
            self._error = TransportError(f"stream to worker {self.address} ended")
        self._watchdog.cancel()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.WATCH_S)
            since = self._since
            if since is not None and loop.time() - since > self._timeout:
                # Part of the frame may be on the wire: this stream cannot carry another one.
                self._fail(TransportError(f"worker {self.address} did not accept a frame for "
                                          f"{self._timeout}s"))
                return

    @property
    def error(self) -> TransportError | None:
        return self._error

    async def send_frame(self, msgs: Iterable[bytes | pb.Frame], timeout: float) -> None:
        """Write the messages of one frame. Raises TransportError (naming the address) when the
        stream broke or the peer did not take the frame within about ``timeout`` seconds."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransportError(f"stream to worker {self.address} is closed")
        await self._lock.acquire()
        try:
            self._timeout = timeout
            self._since = asyncio.get_running_loop().time()
            for msg in msgs:
                await self._call.write(msg)
        except asyncio.CancelledError:
            if self._error is None:  # our task was cancelled, not the stream
                raise
            raise self._error from None
        except grpc.aio.AioRpcError as exc:
            self._fail(TransportError(f"stream to worker {self.address} broke: "
                                      f"{exc.code().name}: {exc.details()}"))
            raise self._error from None  # type: ignore[misc]
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            self._fail(TransportError(f"stream to worker {self.address} ended: {exc}"))
            raise self._error from None  # type: ignore[misc]
        finally:
            self._since = None
            self._lock.release()

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
            log.warning("%s", error)
        self._call.cancel()

    async def close(self, timeout: float = 5.0) -> None:
        """End the stream after the frames already written (cancel it after ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self._watchdog.cancel()
        if self._error is not None:
            return
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:
                    await self._call.done_writing()
                await self._call
        except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
            self._call.cancel()

    def cancel(self) -> None:
        self._closed = True
        self._watchdog.cancel()
        self._call.cancel()
