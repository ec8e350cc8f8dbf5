"""The TCP transport of a worker's stage: frames to the next stage's data port.

:class:`TcpRoute` is the :class:`~jaxdist.core.runtime.Route` of a stage whose spec names a
``next_data_hop`` (the coordinator sets it when the next worker has a data port). It sends the
same ``Frame`` messages a ``Push`` stream would, each after its length, on a TCP connection of
its own (:mod:`jaxdist.core.transport.stream`), so one pipeline's stalled edge holds up only that
pipeline. A write waits while the socket's buffer is full: TCP's flow control slows this stage
when the next one does not read. Errors of a frame go to the caller's subscription, as for
:class:`~jaxdist.worker.runtime.GrpcRoute`.

The connection is made at the first frame, with the worker's own TLS files and the pipeline's
hop credential (``transport/hop.py``: made from the pipeline's key, or for a pipeline without
one from the token), proven for the connection's nonce (``stream.client_handshake``), never
sent. Nothing of the token goes to the next hop, and the connection carries this pipeline's
frames only. A next hop that cannot be reached, or a connection that breaks, is a
``TransportError`` (``UNAVAILABLE``) naming the next stage and its address, the error
:class:`~jaxdist.worker.runtime.GrpcRoute` reports, so the coordinator fails over the same
way. A broken connection is made anew for the next frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from jaxdist.core.errors import LimitError, TransportError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import hop, stream
from jaxdist.core.transport.dataconn import DataConnection, open_connection
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.core.transport.security import ClientAuth
from jaxdist.core.transport.trust import PeerTrust, check_hop
from jaxdist.worker.runtime import SEND_TIMEOUT_S, Hub, publish_failure

__all__ = ["TcpRoute"]

log = logging.getLogger(__name__)

class TcpRoute:
    """The route of one stage on a worker whose next stage has a data port.

    Args:
        spec: the stage's spec; ``next_data_hop`` and ``next_hop`` are the next worker's.
        pipeline_id: the pipeline the stage belongs to.
        hub: the worker's subscriptions (a frame's errors go to its caller there).
        auth: this worker's token and TLS towards its next hops (``WorkerConfig.peer_auth``);
            the token only makes the hop credential of a pipeline without a key.
        address: this worker's address, for error reports.
        trust: the next hops this worker may dial (``WorkerConfig.peer_trust``), checked
            before each connection is opened.
        key: the pipeline's key (``b""``: none), which its hop credential is made from.
    """

    wants_host = True
    kind = "tcp"

    def __init__(self, spec: StageSpec, *, pipeline_id: str, hub: Hub, auth: ClientAuth,
                 address: str, trust: PeerTrust | None = None, key: bytes = b"") -> None:
        self._spec = spec
        self._trust = trust or PeerTrust()
        self._pipeline_id = pipeline_id
        self._credential = hop.credential(pipeline_id, key, auth.hmac_key)
        self._hub = hub
        self._auth = auth
        self._address = address
        self._conn: DataConnection | None = None
        self._lock = asyncio.Lock()  # a frame's messages never interleave with another's

    def _where(self) -> str:
        spec = self._spec
        return (f"stage {spec.stage_index} could not forward to stage {spec.stage_index + 1} at "
                f"{spec.next_hop} (data port {spec.next_data_hop})")

    async def _connect(self) -> DataConnection:
        address = self._spec.next_data_hop
        check_hop(address, self._auth, self._trust, stage=f"stage {self._spec.stage_index} "
                                                          f"of pipeline {self._pipeline_id[:64]}")
        return await open_connection(address, where=self._where(), key=None,
                                     context=self._auth.ssl_context,
                                     hop_pipeline=self._pipeline_id,
                                     hop_credential=self._credential)

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

    async def _send(self, conn: DataConnection, header: FrameHeader, outputs: Mapping[str, Any]
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
