"""gRPC channels and long-lived frame streams, shared by the coordinator and the workers.

Channel options raise the 4 MiB default message limit (frames are chunked to 1 MiB anyway, but
specs with inline artifacts can be larger) and turn on HTTP/2 keepalive, so a peer that vanishes
is noticed in seconds rather than at the next TCP timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from jaxdist.errors import TransportError
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

__all__ = ["GRPC_OPTIONS", "FrameSender", "make_channel", "stub_for"]

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
]

SERVER_OPTIONS: list[tuple[str, int]] = GRPC_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.so_reuseport", 0),
]


def make_channel(address: str, *, credentials: grpc.ChannelCredentials | None = None
                 ) -> grpc.Channel:
    """Open a channel to ``HOST:PORT`` (TLS when credentials are given)."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)
    return grpc.insecure_channel(address, options=GRPC_OPTIONS)


def stub_for(channel: grpc.Channel) -> pb_grpc.WorkerStub:
    return pb_grpc.WorkerStub(channel)


_CLOSE = object()


class FrameSender:
    """One long-lived ``Push`` stream to a worker, fed from a bounded queue.

    ``send`` blocks when ``max_pending`` messages are queued, so a slow receiver slows the sender
    instead of growing memory. A broken stream calls ``on_error`` once with a TransportError that
    names the address; later sends raise it.

    Args:
        stub: the peer's stub.
        address: the peer's ``HOST:PORT``, for error messages.
        on_error: called from the stream's thread when the stream fails.
        metadata: call metadata (e.g. a bearer token).
        max_pending: queue bound, in messages.
    """

    def __init__(self, stub: pb_grpc.WorkerStub, address: str, *,
                 on_error: Callable[[TransportError], None] | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), max_pending: int = 64) -> None:
        self.address = address
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_pending)
        self._on_error = on_error
        self._error: TransportError | None = None
        self._closed = False
        self._done = threading.Event()
        self._call = stub.Push.future(self._requests(), metadata=metadata)
        self._call.add_done_callback(self._finished)

    def _requests(self) -> Iterator[pb.Frame]:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            yield item  # type: ignore[misc]

    def _finished(self, call: grpc.Future) -> None:
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

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
            log.warning("%s", error)
            if self._on_error is not None:
                self._on_error(error)

    @property
    def error(self) -> TransportError | None:
        return self._error

    def send(self, msg: pb.Frame, timeout: float | None = None) -> None:
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
