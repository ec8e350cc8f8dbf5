"""Build the worker's gRPC server. ``create_server`` binds; ``__main__`` serves.

The server is a ``grpc.aio`` server on a thread of its own running an event loop: the data
plane. ``Push`` and ``Subscribe`` are coroutines on that loop, which also runs the stages and
writes the streams to next hops, so a frame crosses a worker without a thread handoff. The
worker's data port (``data_listener.py``: frames from the previous workers over TCP) is served
on the same loop. The
control calls (``Info``, ``UnloadStage``, ...) are plain functions, run in a thread pool, and
``LoadStage`` waits on the loop for a load thread of its own (``worker/loads.py``), so a long
compile or weight load never stalls the loop.

Credentials (``jaxdist.core.transport.security``): with TLS the port is a secure port (mutual TLS when
a CA is given); with a token, an interceptor refuses every call without it before the servicer
sees the call, except the health checks (``grpc.health.v1``, served here too: ``worker/health.py``)
and a previous stage's ``Push`` that presents the hop credential of a pipeline loaded here
(``jaxdist.core.transport.hop``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from concurrent import futures

import grpc

from jaxdist.core.errors import TransportError
# The open-file limit and the connection bound under it, shared with jaxdist serve. The gRPC port
# takes a connection only once it has sent data (defer_accept: a silent one waits in the kernel,
# holding no descriptor), holds connection_limit() at once, and closes one that has not finished
# its handshake after 2 s (grpc.server_handshake_timeout_ms).
from jaxdist.core.openfiles import (DEFER_ACCEPT_S, FD_RESERVE, connection_limit, defer_accept,
                                    raise_fd_limit)
from jaxdist.core.transport import wire
from jaxdist.core.transport.channel import SERVER_OPTIONS
from jaxdist.core.transport.security import ServerAuth, TokenInterceptor
from jaxdist.worker.data_listener import DataListener
from jaxdist.worker.config import WorkerConfig
from jaxdist.worker.servicer import WorkerServicer

__all__ = ["WorkerServer", "create_server"]

log = logging.getLogger(__name__)

# Control calls run in this many threads; streams cost no thread.
MAX_WORKERS = 64
# Calls at once, streams included: gRPC refuses one more with "Concurrent RPC limit exceeded".
# Streams are bounded per peer host below this (--max-streams-per-peer), so one client's idle
# streams cannot take them all.
MAX_RPCS = 4096


class WorkerServer:
    """A started worker server and the loop thread it runs on (made by :func:`create_server`)."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, data: DataListener | None = None) -> None:
        self._server = server
        self._loop = loop
        self._thread = thread
        self._data = data

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving; calls still running get ``grace`` seconds. The event is set when done.
        The data port closes at once, with its connections."""
        done = threading.Event()

        async def stop() -> None:
            if self._data is not None:
                await self._data.close()
            await self._server.stop(grace)

        future = asyncio.run_coroutine_threadsafe(stop(), self._loop)
        future.add_done_callback(lambda _: done.set())
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        future = asyncio.run_coroutine_threadsafe(
            self._server.wait_for_termination(timeout), self._loop)
        return bool(future.result())




def create_server(listen: str, config: WorkerConfig, auth: ServerAuth | None = None, *,
                  data_listen: str | None = None) -> tuple[WorkerServer, WorkerServicer, str]:
    """Create and start a worker server on ``HOST:PORT`` (port 0 picks a free port).

    Args:
        listen: ``HOST:PORT`` to bind.
        config: the worker's configuration.
        auth: what callers must present (``security.server_auth``); ``None``: plaintext, no
            credentials checked. The data port requires the same.
        data_listen: ``HOST:PORT`` of the data port (``--data-listen``); ``None``: none, and
            the previous stages send to this worker over gRPC.

    Returns:
        ``(server, servicer, address)`` where ``address`` is the bound ``HOST:PORT``.

    Raises:
        TransportError: the address cannot be bound.
    """
    auth = auth or ServerAuth()
    host = _host_port("--listen", listen)[0]
    data_at = _host_port("--data-listen", data_listen) if data_listen is not None else None
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="data-plane", daemon=True)
    thread.start()

    servicers: list[WorkerServicer] = []  # the one servicer, once made (after the bind)

    def hop_key(pipeline_id: str) -> bytes | None:
        return servicers[0].hop_key(pipeline_id) if servicers else None

    # The token check of this server also lets through a next hop's Push that presents the hop
    # credential of a pipeline loaded here (transport/hop.py).
    interceptors = tuple(i.for_worker(hop_key) if isinstance(i, TokenInterceptor) else i
                         for i in auth.interceptors)

    async def start() -> tuple[grpc.aio.Server, WorkerServicer, str, DataListener | None]:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=MAX_WORKERS,
                                                             thread_name_prefix="rpc"),
            options=[*SERVER_OPTIONS, ("grpc.max_allowed_incoming_connections",
                                       connection_limit())],
            maximum_concurrent_rpcs=MAX_RPCS,
            interceptors=interceptors or None)
        try:
            if auth.credentials is not None:
                bound = server.add_secure_port(listen, auth.credentials)
            else:
                bound = server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise TransportError(f"cannot listen on {listen}: {exc}") from None
        if bound == 0:
            raise TransportError(f"cannot listen on {listen}: address in use or not available")
        address = f"{host}:{bound}"
        servicer = WorkerServicer(config, address=address)
        servicers.append(servicer)
        data = None
        if data_at is not None:
            data = DataListener(servicer, auth)
            servicer.data_port = await data.start(data_at[0].strip("[]"), int(data_at[1]))
        wire.add_worker_servicer(servicer, server)
        await servicer.health.attach(server)
        await server.start()
        if defer_accept(int(bound)):
            log.info("the gRPC port takes a connection once it has sent data "
                     "(TCP_DEFER_ACCEPT, %d s): silent connections hold no descriptor",
                     DEFER_ACCEPT_S)
        else:
            log.warning("TCP_DEFER_ACCEPT is not available here: a silent connection holds a "
                        "descriptor until the handshake timeout")
        return server, servicer, address, data

    try:
        server, servicer, address, data = asyncio.run_coroutine_threadsafe(start(), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        raise
    log.info("worker serving on %s (%s)%s", address, auth.describe(),
             f", data port {servicer.data_port}" if data is not None else ", no data port")
    return WorkerServer(server, loop, thread, data), servicer, address


def _host_port(flag: str, text: str) -> tuple[str, str]:
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port, re.ASCII):
        raise TransportError(f"{flag} expects HOST:PORT, found {text!r}")
    return host, port
