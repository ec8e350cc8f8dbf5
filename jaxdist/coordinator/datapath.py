"""The coordinator's data path over the workers' data ports, on one event loop.

A :class:`~jaxdist.coordinator.pipeline.Pipeline` sends its frames to stage 0 and hears every
worker's results, errors and heartbeats. Over gRPC that takes a request-iterator thread per
``Push`` stream and a listener thread per ``Subscribe`` stream, and gRPC Python's per-message
work (docs/design.md, "The data path"). Here both go over the data connections of
:mod:`jaxdist.core.transport.stream` instead, the transport the workers use between themselves:

- :class:`TcpSender`: the frames of one pipeline to its stage 0, a data connection in the
  frames mode. :meth:`TcpSender.send_frame` may be called from any thread: it hands the frame's
  messages to the loop, which writes them at once; the caller waits only while the connection
  has more than :data:`~jaxdist.core.transport.dataconn.WRITE_BUFFER_BYTES` unsent (TCP's flow
  control: the worker does not read).
- :class:`TcpEvents`: one worker's events for one pipeline, a data connection in the events
  mode (the data port's ``Subscribe``). Each event is handed to a callback on the loop.

Every connection of every pipeline of the process runs on one asyncio loop, in one daemon thread
(:func:`data_loop`, named ``jaxdist-data``), so the threads of a coordinator do not grow with
its workers. The callbacks run on that loop: they must not block (the pipeline's resolve a
future and return).

A worker without a data port (``--data-listen off``), or a cluster with gRPC TLS credentials
but no TLS files for the data port, is reached over gRPC instead; the pipeline logs that choice
(:attr:`Pipeline.links`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import ssl
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jaxdist.core.errors import JaxdistError, LimitError, TransportError
from jaxdist.core.transport import frames, stream
from jaxdist.core.transport.channel import MAX_MESSAGE_BYTES
from jaxdist.core.transport.dataconn import (
    CONNECT_TIMEOUT_S,
    WRITE_BUFFER_BYTES,
    DataConnection,
    open_connection,
)
from jaxdist.core.transport.security import AUTH_HEADER, ClientAuth
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["DataAuth", "TcpEvents", "TcpSender", "data_auth", "data_loop"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class DataAuth:
    """What a coordinator presents at its workers' data ports: the token (proven, never sent)
    and TLS. Made by :func:`data_auth`."""

    key: bytes | None = field(default=None, repr=False)
    context: ssl.SSLContext | None = None


def data_auth(*, metadata: Sequence[tuple[str, str]] = (), tls: bool = False,
              auth: ClientAuth | None = None) -> tuple[DataAuth | None, str]:
    """How a cluster reaches its workers' data ports, or ``None`` and why it cannot.

    Args:
        metadata: the cluster's call metadata (the token: ``authorization: Bearer ...``).
        tls: the cluster has gRPC TLS credentials.
        auth: the cluster's files as read by :func:`jaxdist.core.transport.security.client_auth`;
            with TLS, the data port needs its TLS context (gRPC credentials do not give it).
    """
    if auth is not None:
        return DataAuth(auth.hmac_key, auth.ssl_context), ""
    if tls:
        return None, ("the cluster was given gRPC TLS credentials but not its TLS files "
                      "(Cluster(auth=client_auth(...)) gives both)")
    key = None
    for k, v in metadata:
        if k == AUTH_HEADER and v.startswith("Bearer "):
            key = v.removeprefix("Bearer ").encode("ascii")
    return DataAuth(key, None), ""


class _DataLoop:
    """The process's one event loop for data connections, in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="jaxdist-data", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


_LOOP: _DataLoop | None = None
_LOOP_LOCK = threading.Lock()


def data_loop() -> _DataLoop:
    """The process's data loop, started at its first use."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = _DataLoop()
        return _LOOP


class _SenderConnection(DataConnection):
    """A frames connection that tells its sender when the worker closes it."""

    on_closed: Callable[[JaxdistError], None] | None = None

    def closed(self, error: JaxdistError) -> None:
        if self.on_closed is not None:
            self.on_closed(error)


class TcpSender:
    """The frames of one pipeline to the data port of its stage 0's worker. Thread-safe.

    The connection is opened in the background at once; the first :meth:`send_frame` waits for
    it. Errors (refused, closed by the worker, stuck) go to ``on_error`` once, from the loop,
    and every later :meth:`send_frame` raises them.

    Args:
        hop: the data port, ``HOST:PORT``.
        address: the worker's gRPC address, for errors.
        auth: the token and TLS to present.
        on_error: told of the error that ended the connection (not of :meth:`close`).
        pipeline: ``(pipeline id, hop credential)`` to prove instead of the token: the
            worker then counts the connection under that pipeline (``transport/hop.py``).
    """

    def __init__(self, hop: str, address: str, auth: DataAuth, *,
                 on_error: Callable[[TransportError], None] | None = None,
                 pipeline: tuple[str, bytes] | None = None) -> None:
        self.address = address
        self.hop = hop
        self._on_error = on_error
        self._error: TransportError | None = None
        self._closed = False
        self._writable = threading.Event()  # clear while the socket's buffer is over its bound
        self._writable.set()
        self._data = data_loop()
        self._loop = self._data.loop
        self._conn: _SenderConnection | None = None
        self._opened = self._data.submit(self._open(auth, pipeline))

    async def _open(self, auth: DataAuth, pipeline: tuple[str, bytes] | None
                    ) -> _SenderConnection:
        where = f"data connection to worker {self.address} (data port {self.hop})"
        base = await open_connection(self.hop, where=where, key=auth.key,
                                     context=auth.context, watch=False,
                                     hop_pipeline=pipeline[0] if pipeline else None,
                                     hop_credential=pipeline[1] if pipeline else None)
        conn = _SenderConnection(base.reader, base.writer, base.max_message, self.hop)
        conn.on_closed = self._closed_by_worker
        self._conn = conn
        return conn

    def _closed_by_worker(self, error: JaxdistError) -> None:
        if not self._closed:
            self._fail(TransportError(f"worker {self.address} closed the data connection: "
                                      f"{error}"))

    def _fail(self, error: TransportError) -> None:
        if self._error is not None:
            return
        self._error = error
        self._writable.set()  # wake a sender waiting for room: it sees the error
        if self._conn is not None:
            self._conn.broken(error)
        log.warning("%s", error)
        if self._on_error is not None and not self._closed:
            self._on_error(error)

    @property
    def error(self) -> TransportError | None:
        return self._error

    def wait_connected(self, timeout: float) -> bool:
        """Wait until the connection is made (True) or failed, at most ``timeout`` seconds; a
        failure is raised by the first :meth:`send_frame`."""
        try:
            self._opened.result(timeout)
            return True
        except Exception:  # noqa: BLE001 - kept for send_frame, which raises it
            return False

    def send_frame(self, msgs: Sequence[bytes], timeout: float) -> None:
        """Queue the messages of one frame for the worker, in order with the frames before it.

        Raises:
            TransportError: the connection could not be made, or broke; the worker took nothing
                for ``timeout`` seconds.
            LimitError: a message is over the worker's data-port limit (nothing is sent).
        """
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransportError(f"the data connection to worker {self.address} is closed")
        if threading.current_thread() is self._data.thread and not self._opened.done():
            raise TransportError(f"worker {self.address}: a frame was sent from the data loop "
                                 f"before its connection was made (a callback of a step's "
                                 f"future must not submit before the first step)")
        try:
            conn = self._opened.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TransportError(f"worker {self.address}: no data connection to {self.hop} "
                                 f"within {timeout}s") from None
        except JaxdistError as exc:
            error = exc if isinstance(exc, TransportError) else TransportError(str(exc))
            self._error = self._error or error
            raise error from None
        for msg in msgs:
            if len(msg) > conn.max_message:
                raise LimitError(f"a message of {len(msg)} bytes for stage 0 at {self.address} "
                                 f"is over that worker's data port limit of {conn.max_message} "
                                 f"bytes per message (its --max-frame-bytes)")
        on_loop = threading.current_thread() is self._data.thread  # must not wait on itself
        if not self._writable.is_set() and not on_loop and not self._writable.wait(timeout):
            error = TransportError(f"worker {self.address} took no frame for {timeout}s")
            self._loop.call_soon_threadsafe(self._fail, error)
            raise error
        if self._error is not None:
            raise self._error
        self._loop.call_soon_threadsafe(self._write, conn, msgs, timeout)

    def _write(self, conn: _SenderConnection, msgs: Sequence[bytes], timeout: float) -> None:
        if self._error is not None or self._closed:
            return  # the frame is lost with the connection; the pipeline was told
        if conn.writer.is_closing():
            self._fail(TransportError(f"the data connection to worker {self.address} closed"))
            return
        for msg in msgs:
            stream.write_message(conn.writer, msg)
        if conn.writer.transport.get_write_buffer_size() > WRITE_BUFFER_BYTES:
            self._writable.clear()
            self._loop.create_task(self._drain(conn, timeout))

    async def _drain(self, conn: _SenderConnection, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await conn.writer.drain()
        except TimeoutError:
            self._fail(TransportError(f"worker {self.address} took no frame for {timeout}s"))
        except OSError as exc:
            self._fail(TransportError(f"data connection to worker {self.address} failed: "
                                      f"{exc}"))
        finally:
            self._writable.set()

    def close(self, *, cancel: bool = False) -> None:
        """Close after the frames already queued; ``cancel``: drop them."""
        if self._closed:
            return
        self._closed = True

        async def close() -> None:
            try:
                conn = await asyncio.wrap_future(self._opened)
            except BaseException:
                return
            if cancel:
                conn.broken(TransportError("cancelled"))
            else:
                await conn.close()

        try:
            self._data.submit(close()).result(10.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass


class TcpEvents:
    """One worker's events for one pipeline, over its data port. :meth:`cancel` is
    thread-safe.

    ``on_event`` gets each event (:class:`frames.EventView`) on the data loop, the first being
    the heartbeat that says the subscription is registered. ``on_end`` is called once, on the
    loop, when the subscription ends by itself: with the worker's reason (its goodbye: a
    :class:`~jaxdist.core.errors.PipelineKeyError` for a key that does not open the pipeline, a
    ``LimitError`` for a dropped subscriber), or a :class:`TransportError` for a connection
    that failed or closed. A cancelled subscription calls neither again.

    Args:
        hop: the worker's data port, ``HOST:PORT``.
        address: the worker's gRPC address, for errors.
        request: the subscription (pipeline, reply_to, key).
    """

    def __init__(self, hop: str, address: str, auth: DataAuth, request: pb.SubscribeRequest,
                 *, on_event: Callable[[frames.EventView], bool],
                 on_end: Callable[[JaxdistError], None]) -> None:
        self.address = address
        self.hop = hop
        self._on_event = on_event
        self._on_end = on_end
        self._data = data_loop()
        self._task = self._data.submit(self._run(auth, request))

    async def _run(self, auth: DataAuth, request: pb.SubscribeRequest) -> None:
        where = f"event connection to worker {self.address} (data port {self.hop})"
        conn: DataConnection | None = None
        try:
            conn = await open_connection(self.hop, where=where, key=auth.key,
                                         context=auth.context, mode=stream.MODE_EVENTS,
                                         watch=False, timeout=CONNECT_TIMEOUT_S)
            stream.write_message(conn.writer, request.SerializeToString())
            await conn.writer.drain()
            limit = f"MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}"
            while True:
                data = await stream.read_message(conn.reader, MAX_MESSAGE_BYTES, limit)
                if data is None:
                    error: JaxdistError = TransportError(f"worker {self.address} closed its "
                                                         f"event stream")
                    break
                if not data:  # the goodbye: why it ends
                    said = await stream.read_status(conn.reader, self.hop)
                    error = said or TransportError(f"worker {self.address} ended its event "
                                                   f"stream")
                    break
                if not self._on_event(frames.parse_event(data)):
                    return  # the pipeline is done with it
        except asyncio.CancelledError:
            return
        except JaxdistError as exc:
            error = exc
        except OSError as exc:
            error = TransportError(f"{where} failed: {exc}")
        finally:
            if conn is not None:
                conn.writer.transport.abort()
        self._on_end(error)

    def cancel(self) -> None:
        """Stop: close the connection; no callback runs after this returns on the loop."""
        self._task.cancel()
