"""The TCP transport of a worker's stage: frames to the next stage's data port.

:class:`TcpRoute` is the :class:`~jaxdist.core.runtime.Route` of a stage whose spec names a
``next_data_hop`` (the coordinator sets it when the next worker has a data port). It sends the
same ``Frame`` messages a ``Push`` stream would, each after its length, on a TCP connection of
its own (:mod:`jaxdist.core.transport.stream`), so one pipeline's stalled edge holds up only that
pipeline. A write waits while the socket's buffer is full: TCP's flow control slows this stage
when the next one does not read. Errors of a frame go to the caller's subscription, as for
:class:`~jaxdist.worker.runtime.GrpcRoute`.

The connection is made at the first frame, with the worker's own token and TLS files: the
token is proven (``stream.client_handshake``), never sent. A next hop that cannot be reached, or
a connection that breaks, is a ``TransportError`` (``UNAVAILABLE``) naming the next stage and
its address, the error :class:`~jaxdist.worker.runtime.GrpcRoute` reports, so the coordinator
fails over the same way. A broken connection is made anew for the next frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from jaxdist.core.errors import JaxdistError, LimitError, TransportError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import stream
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.core.transport.security import ClientAuth
from jaxdist.core.transport.trust import PeerTrust, check_hop
from jaxdist.worker.runtime import SEND_TIMEOUT_S, Hub, publish_failure

__all__ = ["TcpRoute"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # connect, TLS and the handshake with the next hop's data port
WRITE_BUFFER_BYTES = 4 << 20  # a write waits once this much is queued beyond the socket's own


class _Connection:
    """One data connection: its streams, the server's message limit, and why it broke."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_message: int, peer: str) -> None:
        self.reader = reader
        self.writer = writer
        self.max_message = max_message
        self.error: JaxdistError | None = None
        self._watch = asyncio.get_running_loop().create_task(self._watch_for_close(peer))

    async def _watch_for_close(self, peer: str) -> None:
        """The server sends nothing more unless it closes the connection: then at most a
        goodbye saying why (``stream.read_status``)."""
        try:
            said = await stream.read_status(self.reader, peer)
        except JaxdistError as exc:
            said = exc
        except OSError as exc:
            said = TransportError(f"data connection to {peer} failed: {exc}")
        self.error = self.error or said or TransportError(
            f"data port {peer} sent an empty status after the handshake")

    def broken(self, error: JaxdistError) -> None:
        """Mark the connection unusable (part of a frame may be on the wire) and drop it."""
        if self.error is None:
            self.error = error
        self._watch.cancel()
        self.writer.transport.abort()

    async def close(self, timeout: float = 5.0) -> None:
        """Close after the bytes already written; drop them after ``timeout`` seconds."""
        self._watch.cancel()
        self.writer.close()
        try:
            async with asyncio.timeout(timeout):
                await self.writer.wait_closed()
        except (OSError, TimeoutError):
            self.writer.transport.abort()


class TcpRoute:
    """The route of one stage on a worker whose next stage has a data port.

    Args:
        spec: the stage's spec; ``next_data_hop`` and ``next_hop`` are the next worker's.
        pipeline_id: the pipeline the stage belongs to.
        hub: the worker's subscriptions (a frame's errors go to its caller there).
        auth: this worker's token and TLS towards its next hops (``WorkerConfig.peer_auth``).
        address: this worker's address, for error reports.
        trust: the next hops this worker may dial (``WorkerConfig.peer_trust``), checked
            before each connection is opened.
    """

    wants_host = True
    kind = "tcp"

    def __init__(self, spec: StageSpec, *, pipeline_id: str, hub: Hub, auth: ClientAuth,
                 address: str, trust: PeerTrust | None = None) -> None:
        self._spec = spec
        self._trust = trust or PeerTrust()
        self._pipeline_id = pipeline_id
        self._hub = hub
        self._auth = auth
        self._address = address
        self._conn: _Connection | None = None
        self._lock = asyncio.Lock()  # a frame's messages never interleave with another's

    def _where(self) -> str:
        spec = self._spec
        return (f"stage {spec.stage_index} could not forward to stage {spec.stage_index + 1} at "
                f"{spec.next_hop} (data port {spec.next_data_hop})")

    async def _connect(self) -> _Connection:
        hop = self._spec.next_data_hop
        host, _, port = hop.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        context = self._auth.ssl_context
        check_hop(hop, self._auth, self._trust, stage=f"stage {self._spec.stage_index} of "
                                                      f"pipeline {self._pipeline_id[:64]}")
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    host, int(port), ssl=context, server_hostname=host if context else None)
                try:
                    hello = await stream.client_handshake(reader, writer,
                                                          key=self._auth.hmac_key, peer=hop)
                except BaseException:
                    writer.close()
                    raise
        except TimeoutError:
            raise TransportError(f"{self._where()}: no connection and handshake within "
                                 f"{CONNECT_TIMEOUT_S}s") from None
        except OSError as exc:  # refused, unreachable, reset, TLS handshake failed
            raise TransportError(f"{self._where()}: {exc}") from None
        except JaxdistError as exc:  # refused the proof, or not a data port
            raise type(exc)(f"{self._where()}: {exc}", code=exc.code) from None
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        return _Connection(reader, writer, hello.max_message, hop)

    async def forward(self, header: FrameHeader, outputs: Mapping[str, Any]) -> None:
        if not self._spec.next_data_hop:  # the servicer gives a TcpRoute only to such stages
            raise TransportError(f"stage {self._spec.stage_index} has no data port to send to")
        async with self._lock:
            conn = self._conn
            if conn is None or conn.error is not None:  # first frame, or the connection broke
                if conn is not None:
                    log.info("stage %d: data connection to %s broke (%s); connecting again",
                             self._spec.stage_index, self._spec.next_data_hop, conn.error)
                    conn.broken(conn.error or TransportError("broken"))
                self._conn = None
                conn = self._conn = await self._connect()
            await self._send(conn, header, outputs)

    async def _send(self, conn: _Connection, header: FrameHeader, outputs: Mapping[str, Any]
                    ) -> None:
        writer = conn.writer
        transport = writer.transport
        written = False
        try:
            for msg in split_frame(header, outputs):
                if len(msg) > conn.max_message:
                    error = LimitError(
                        f"stage {self._spec.stage_index}: a message of {len(msg)} bytes for "
                        f"stage {self._spec.stage_index + 1} at {self._spec.next_hop} is over "
                        f"that worker's data port limit of {conn.max_message} bytes per message "
                        f"(its --max-frame-bytes)")
                    if written:  # part of the frame is on the wire: the connection is spent
                        conn.broken(error)
                    raise error
                if conn.error is not None or writer.is_closing():
                    raise conn.error or TransportError("the data connection closed")
                stream.write_message(writer, msg)
                written = True
                if transport.get_write_buffer_size():  # not all taken by the socket: wait
                    async with asyncio.timeout(SEND_TIMEOUT_S):
                        await writer.drain()
        except TimeoutError:
            stuck = TransportError(f"{self._where()}: it took no frame for {SEND_TIMEOUT_S}s")
            conn.broken(stuck)
            raise stuck from None
        except OSError as exc:  # reset: the next stage's worker went away
            gone = TransportError(f"{self._where()}: {exc}")
            conn.broken(gone)
            raise gone from None
        except TransportError as exc:
            conn.broken(exc)
            raise TransportError(f"{self._where()}: {exc}") from None

    async def fail(self, header: FrameHeader, error: BaseException) -> None:
        publish_failure(self._hub, header, error, stage=self._spec.stage_index,
                        address=self._address)

    async def close(self) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0), self._lock:  # after the frame being written
                pass
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()
