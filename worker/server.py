"""Build the worker's gRPC server. ``create_server`` binds; ``__main__`` serves.

The server is a ``grpc.aio`` server on a thread of its own running an event loop: the data
plane. ``Push`` and ``Subscribe`` are coroutines on that loop, which also runs the stages and
writes the streams to next hops, so a frame crosses a worker without a thread handoff. The
control calls (``LoadStage``, ``Info``, ...) are plain functions, run in a thread pool, so a
long compile or weight load never stalls the loop.

Credentials (``jaxdist.core.transport.security``): with TLS the port is a secure port (mutual TLS when
a CA is given); with a token, an interceptor refuses every call without it before the servicer
sees the call, except the health checks (``grpc.health.v1``, served here too: ``worker/health.py``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from concurrent import futures

import grpc

from jaxdist.core.errors import TransportError
from jaxdist.core.transport import wire
from jaxdist.core.transport.channel import SERVER_OPTIONS
from jaxdist.core.transport.security import ServerAuth
from jaxdist.worker.servicer import WorkerConfig, WorkerServicer

__all__ = ["WorkerServer", "create_server"]

log = logging.getLogger(__name__)

# Control calls run in this many threads; streams cost no thread.
MAX_WORKERS = 64


class WorkerServer:
    """A started worker server and the loop thread it runs on (made by :func:`create_server`)."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread) -> None:
        self._server = server
        self._loop = loop
        self._thread = thread

    def stop(self, grace: float | None) -> threading.Event:
        """Stop serving; calls still running get ``grace`` seconds. The event is set when done."""
        done = threading.Event()
        future = asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)
        future.add_done_callback(lambda _: done.set())
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        future = asyncio.run_coroutine_threadsafe(
            self._server.wait_for_termination(timeout), self._loop)
        return bool(future.result())


def create_server(listen: str, config: WorkerConfig, auth: ServerAuth | None = None
                  ) -> tuple[WorkerServer, WorkerServicer, str]:
    """Create and start a worker server on ``HOST:PORT`` (port 0 picks a free port).

    Args:
        listen: ``HOST:PORT`` to bind.
        config: the worker's configuration.
        auth: what callers must present (``security.server_auth``); ``None``: plaintext, no
            credentials checked.

    Returns:
        ``(server, servicer, address)`` where ``address`` is the bound ``HOST:PORT``.

    Raises:
        TransportError: the address cannot be bound.
    """
    auth = auth or ServerAuth()
    host, _, port = listen.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port, re.ASCII):
        raise TransportError(f"--listen expects HOST:PORT, found {listen!r}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="data-plane", daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, WorkerServicer, str]:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=MAX_WORKERS,
                                                             thread_name_prefix="rpc"),
            options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_WORKERS * 4,
            interceptors=auth.interceptors or None)
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
        wire.add_worker_servicer(servicer, server)
        await servicer.health.attach(server)
        await server.start()
        return server, servicer, address

    try:
        server, servicer, address = asyncio.run_coroutine_threadsafe(start(), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        raise
    log.info("worker serving on %s (%s)", address, auth.describe())
    return WorkerServer(server, loop, thread), servicer, address
