"""One data connection to a worker's data port, from a worker's stage or from a coordinator.

:func:`open_connection` dials ``HOST:PORT``, with TLS when given a context, and runs the client
half of the handshake of :mod:`jaxdist.core.transport.stream` for one mode: frames (a stage
sending to the next one: ``worker/tcp_route.py``; a coordinator sending to stage 0) or events
(a coordinator's subscription: ``jaxdist/coordinator/datapath.py``). A coordinator proves the
token, never sending it; a worker's stage proves its pipeline's hop credential instead
(``transport/hop.py``), so nothing of the token goes to a next hop. Every failure to connect
is a typed error that names ``where``: a refused, unreachable or timed-out hop is a
:class:`TransportError` (``UNAVAILABLE``), so callers fail over the same way whatever the
transport. Used on an event loop only.
"""

from __future__ import annotations

import asyncio
import ssl

from jaxdist.core.errors import JaxdistError, TransportError
from jaxdist.core.transport import stream

__all__ = ["CONNECT_TIMEOUT_S", "WRITE_BUFFER_BYTES", "DataConnection", "data_address",
           "open_connection"]

CONNECT_TIMEOUT_S = 10.0  # connect, TLS and the handshake with the data port
WRITE_BUFFER_BYTES = 4 << 20  # a write waits once this much is queued beyond the socket's own


def data_address(address: str, data_port: int) -> str:
    """The ``HOST:PORT`` of a worker's data port (``Info.data_port``), on the host its gRPC
    ``address`` is dialled at (so ``[::1]:50051`` and port 7000 give ``[::1]:7000``).

    >>> data_address("10.0.0.5:50051", 7000)
    '10.0.0.5:7000'
    """
    return f"{address.rpartition(':')[0]}:{data_port}"


class DataConnection:
    """One data connection: its streams, the server's message limit, and why it broke.

    In the frames mode the server sends nothing after the handshake unless it closes the
    connection, then at most a goodbye saying why; a task reads that (``watch=True``) and sets
    :attr:`error`, so the next write fails instead of vanishing into a closed socket.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_message: int, peer: str, *, watch: bool = True) -> None:
        self.reader = reader
        self.writer = writer
        self.max_message = max_message
        self.peer = peer
        self.error: JaxdistError | None = None
        self._watch = (asyncio.get_running_loop().create_task(self._watch_for_close())
                       if watch else None)

    async def _watch_for_close(self) -> None:
        try:
            said = await stream.read_status(self.reader, self.peer)
        except JaxdistError as exc:
            said = exc
        except OSError as exc:
            said = TransportError(f"data connection to {self.peer} failed: {exc}")
        self.error = self.error or said or TransportError(
            f"data port {self.peer} sent an empty status after the handshake")
        self.closed(self.error)

    def closed(self, error: JaxdistError) -> None:
        """Called once the server closed the connection (override to be told)."""

    def broken(self, error: JaxdistError) -> None:
        """Mark the connection unusable (part of a frame may be on the wire) and drop it."""
        if self.error is None:
            self.error = error
        if self._watch is not None:
            self._watch.cancel()
        self.writer.transport.abort()

    async def close(self, timeout: float = 5.0) -> None:
        """Close after the bytes already written; drop them after ``timeout`` seconds."""
        if self._watch is not None:
            self._watch.cancel()
        self.writer.close()
        try:
            async with asyncio.timeout(timeout):
                await self.writer.wait_closed()
        except (OSError, TimeoutError):
            self.writer.transport.abort()


async def open_connection(hop: str, *, where: str, key: bytes | None,
                          context: ssl.SSLContext | None, mode: int = stream.MODE_FRAMES,
                          watch: bool = True, timeout: float = CONNECT_TIMEOUT_S,
                          hop_pipeline: str | None = None, hop_credential: bytes | None = None
                          ) -> DataConnection:
    """Connect to the data port ``hop`` (``HOST:PORT``) and pass its handshake for ``mode``.

    Args:
        where: what connects to what, the start of every error's message.
        key: the token to prove (``None``: none is held).
        context: TLS for the connection; ``None``: plaintext.
        watch: read the server's goodbye in a task of the connection (frames mode).
        hop_pipeline: a worker's stage sending to the next one: prove this pipeline's
            ``hop_credential`` instead of ``key`` (``stream.client_handshake``).

    Raises:
        TransportError: refused, unreachable, reset, a TLS failure, or no handshake within
            ``timeout`` seconds.
        AuthError: the server refused the proof. CodecError: not a data port, or one without
            ``mode``.
    """
    host, _, port = hop.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, int(port), ssl=context, server_hostname=host if context else None)
            try:
                hello = await stream.client_handshake(reader, writer, key=key, peer=hop,
                                                      mode=mode, hop_pipeline=hop_pipeline,
                                                      hop_credential=hop_credential)
            except BaseException:
                writer.close()
                raise
    except TimeoutError:
        raise TransportError(f"{where}: no connection and handshake within {timeout}s"
                             ) from None
    except OSError as exc:  # refused, unreachable, reset, TLS handshake failed
        raise TransportError(f"{where}: {exc}") from None
    except JaxdistError as exc:  # refused the proof, or not a data port
        raise type(exc)(f"{where}: {exc}", code=exc.code) from None
    writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
    return DataConnection(reader, writer, hello.max_message, hop, watch=watch)
