"""The worker's data port: data connections from the previous stages' workers.

Served on the data-plane event loop beside gRPC (``server.py``), on ``--data-listen`` (default:
the ``--listen`` host, a free port; ``off``: none). A connection first passes the handshake of
:mod:`jaxdist.core.transport.stream` (with the worker's token: a proof of it from a
coordinator, or from a previous stage's worker a proof of one loaded pipeline's hop credential,
``transport/hop.py``, and then only that pipeline's frames; with its TLS files: TLS, and a
client certificate from ``--tls-ca`` for mutual TLS), within :data:`HANDSHAKE_TIMEOUT_S`. Then its messages go into a :class:`FrameIngress`, the path of a
gRPC ``Push`` stream: the same checks and limits, the same stages. A bad frame is reported to its
caller and the connection goes on, as on ``Push``. A message that cannot be read (longer than the
limit, or not a ``Frame``) ends the connection with a goodbye saying why, logged at most once per
kind per :data:`LOG_INTERVAL_S`; the worker goes on serving.

A connection in the events mode is a coordinator's subscription, as gRPC's ``Subscribe``: its
one ``SubscribeRequest`` is checked by the servicer (``open_subscription``: ids, the pipeline's
key, streams per peer), then the events of ``WorkerServicer.events`` are written to it, each
after its length, until the coordinator closes the connection. A subscription dropped for not
reading, or refused, ends with a goodbye naming why (``RESOURCE_EXHAUSTED``,
``PERMISSION_DENIED``), as gRPC's status would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Protocol

from jaxdist.core.errors import AuthError, JaxdistError, LimitError, TransportError
from jaxdist.core.transport import frames, stream
from jaxdist.core.transport.channel import MAX_MESSAGE_BYTES
from jaxdist.core.transport.frames import parse_frame
from jaxdist.core.transport.security import RefusalLog, ServerAuth
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.ingress import FrameIngress, FrameLimits, IngressWorker
from jaxdist.worker.runtime import SEND_TIMEOUT_S, OpenSubscription

__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_HANDSHAKES", "DataListener", "DataPortWorker",
           "message_limit"]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0  # TLS and the proof; a connection still without them is closed
MAX_HANDSHAKES = 64  # connections in their handshake at once; one more is closed at once
HEADER_BYTES = 1 << 20  # a message's bytes beyond its tensor data: ids, control, tensor headers
# asyncio's reader limit: a connection stops reading (TCP flow control then slows its sender)
# with twice this unread, beyond the message being read
READ_LIMIT_BYTES = 1 << 20
LOG_INTERVAL_S = 10.0
MAX_SUBSCRIBE_BYTES = 4096  # a SubscribeRequest: two ids and a key


class DataPortWorker(IngressWorker, Protocol):
    """What the data port needs of its worker (``WorkerServicer``): the ingress of frames, and
    the subscriptions of the events mode."""

    def open_subscription(self, request: bytes, what: str, peer: str) -> OpenSubscription: ...
    def hop_key(self, pipeline_id: str) -> bytes | None: ...
    def stream_owner(self, peer: str, pipeline_id: str | None) -> str: ...
    def events(self, opened: OpenSubscription) -> AsyncGenerator[pb.Event, None]: ...


def message_limit(config: FrameLimits) -> tuple[int, str]:
    """The longest message a data connection may declare, and what sets it (for errors).

    A message carries part of one frame, so its tensor data is at most ``--max-frame-bytes``;
    and a message is never longer than gRPC would take on ``Push`` (``MAX_MESSAGE_BYTES``).
    """
    frame = config.max_frame_bytes + HEADER_BYTES
    if frame <= MAX_MESSAGE_BYTES:
        return frame, (f"--max-frame-bytes={config.max_frame_bytes}, plus {HEADER_BYTES} bytes "
                       f"for a message's header fields")
    return MAX_MESSAGE_BYTES, f"MAX_MESSAGE_BYTES={MAX_MESSAGE_BYTES}, the gRPC message limit"


class DataListener:
    """The data port of one worker. :meth:`start` and :meth:`close` run on the data-plane loop.

    Args:
        worker: the servicer whose stages the frames are for.
        auth: what a data connection must present: the token's proof, and TLS (mutual when
            the worker requires client certificates), from the worker's own files.
    """

    def __init__(self, worker: DataPortWorker, auth: ServerAuth) -> None:
        self._worker = worker
        self._auth = auth
        self._max_message, self._limit = message_limit(worker.config)
        self._server: asyncio.Server | None = None
        self._handshaking = 0
        self._connections: set[asyncio.StreamWriter] = set()
        self._refusals = RefusalLog(log, LOG_INTERVAL_S)
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port.

        Raises:
            TransportError: the address cannot be bound.
        """
        try:
            self._server = await asyncio.start_server(
                self._serve, host, port, ssl=self._auth.ssl_context,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self._auth.ssl_context else None,
                limit=READ_LIMIT_BYTES)
        except OSError as exc:
            raise TransportError(f"cannot listen on --data-listen {host}:{port}: {exc}"
                                 ) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        """Stop listening and close every data connection."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.transport.abort()
        self._connections.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*(writer.get_extra_info("peername") or ("?", 0))[:2])
        self._connections.add(writer)
        try:
            admitted = await self._admit(peer, reader, writer)
            mode, pipeline_id = admitted if admitted is not None else (None, None)
            if mode == stream.MODE_FRAMES:
                await self._frames(peer, reader, writer, pipeline_id)
            elif mode == stream.MODE_EVENTS:
                await self._events(peer, reader, writer)
        finally:
            self._connections.discard(writer)
            if writer.transport.get_write_buffer_size():  # a goodbye it did not read
                writer.transport.abort()
            else:
                writer.close()

    async def _admit(self, peer: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> tuple[int, str | None] | None:
        """The handshake, bounded in time and in number: the connection's mode and the
        pipeline a next hop's credential named (``None``: a coordinator's token), or ``None``
        (logged) when refused."""
        if self._handshaking >= MAX_HANDSHAKES:
            self._refused(peer, f"more than {MAX_HANDSHAKES} connections in their handshake")
            return None
        self._handshaking += 1
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                return await stream.server_handshake(reader, writer, key=self._auth.hmac_key,
                                                     max_message=self._max_message,
                                                     hop_keys=self._worker.hop_key)
        except TimeoutError:
            self._refused(peer, f"no handshake within {HANDSHAKE_TIMEOUT_S}s")
        except AuthError as exc:
            self._refused(peer, str(exc).split(":")[0], str(exc))
        except TransportError:
            self._refused(peer, "closed during the handshake")
        except JaxdistError as exc:
            self._refused(peer, "not the data protocol", str(exc))
        except OSError:
            pass  # gone before the handshake ended: nothing to say
        finally:
            self._handshaking -= 1
        return None

    async def _events(self, peer: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        """A coordinator's subscription: its request, then its events until it hangs up."""
        watch = stream.IdleWatch(HANDSHAKE_TIMEOUT_S)
        try:
            request = await stream.read_message(reader, MAX_SUBSCRIBE_BYTES,
                                                f"{MAX_SUBSCRIBE_BYTES} bytes per "
                                                f"SubscribeRequest", wait=HANDSHAKE_TIMEOUT_S,
                                                watch=watch)
            if request is None:
                return
            opened = self._worker.open_subscription(bytes(request), "Subscribe", peer)
        except TimeoutError:
            self._refused(peer, f"no SubscribeRequest within {HANDSHAKE_TIMEOUT_S}s")
            return
        except (TransportError, OSError):
            return
        except JaxdistError as exc:
            self._refused(peer, type(exc).__name__, str(exc))
            await _goodbye(writer, exc, events=True)
            return
        finally:
            watch.close()
        hangup = asyncio.get_running_loop().create_task(reader.read(1))
        writing = asyncio.get_running_loop().create_task(self._write_events(writer, opened))
        try:
            await asyncio.wait((hangup, writing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            writing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writing
            self._worker.streams.leave(opened.stream)

    async def _write_events(self, writer: asyncio.StreamWriter, opened: OpenSubscription
                            ) -> None:
        transport = writer.transport
        try:
            async with contextlib.aclosing(self._worker.events(opened)) as events:
                async for event in events:
                    stream.write_message(writer, frames.serialize(event))
                    if transport.get_write_buffer_size():  # not all taken by the socket
                        async with asyncio.timeout(SEND_TIMEOUT_S):
                            await writer.drain()
        except (OSError, TimeoutError):
            transport.abort()  # gone, or not reading for SEND_TIMEOUT_S
        except JaxdistError as exc:  # dropped for not reading, or the key refused
            await _goodbye(writer, exc, events=True)

    async def _frames(self, peer: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter, pipeline_id: str | None = None) -> None:
        """Messages into the stages until the client closes, or a message cannot be read;
        only of ``pipeline_id`` on a next hop's connection."""
        worker = self._worker
        ingress = FrameIngress(worker, pipeline_id=pipeline_id)
        inflight, reserved = worker.inflight, [0]
        idle = worker.config.frame_idle_timeout

        def reserve(part: int, n: int) -> None:  # each part of a message as it is read
            inflight.take(part, f"a message of {n} bytes on the data connection from {peer}, "
                                f"{reserved[0]} of them read")
            reserved[0] += part

        watch = stream.IdleWatch(idle)
        try:
            with worker.streams.hold("data connection", worker.stream_owner(peer, pipeline_id),
                                     frames=True) as opened:
                while True:
                    try:
                        data = await opened.next(stream.read_message(
                            reader, self._max_message, self._limit, wait=ingress.idle_timeout,
                            watch=watch, reserve=reserve))
                    except TimeoutError:
                        if ingress.idle_timeout is not None and not reserved[0]:
                            raise await ingress.stalled(
                                f"data connection from {peer}") from None
                        raise LimitError(
                            f"data connection from {peer}: a message began, then nothing more "
                            f"of it arrived for {idle:g} s (--frame-idle-timeout); the "
                            f"connection is closed and the {reserved[0]} bytes it held are "
                            f"freed") from None
                    if data is None:
                        return
                    try:
                        await ingress.take(parse_frame(data))
                    finally:
                        inflight.give(reserved[0])
                        reserved[0] = 0
        except TransportError:
            return  # closed inside a message: the sender went away
        except OSError:
            return
        except JaxdistError as exc:  # over a limit, or not a Frame: the connection ends
            self._refused(peer, type(exc).__name__, str(exc))
            await _goodbye(writer, exc)
        finally:
            watch.close()
            inflight.give(reserved[0])
            ingress.close()

    def _refused(self, peer: str, kind: str, detail: str = "") -> None:
        self._refusals.refused(f"data connection from {peer}", kind, detail)


async def _goodbye(writer: asyncio.StreamWriter, error: JaxdistError, *,
                   events: bool = False) -> None:
    """Tell the client why its connection ends, if it takes that within a second."""
    if events:
        stream.write_goodbye(writer, error)
    else:
        stream.write_status(writer, error)
    try:
        async with asyncio.timeout(1.0):
            await writer.drain()
    except (OSError, TimeoutError):
        pass
