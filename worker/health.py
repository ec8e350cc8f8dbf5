"""The worker's gRPC health service (``grpc.health.v1``), for Kubernetes probes, load balancers
and ``grpc_health_probe``.

Two service names are reported, with the same status: ``""`` (the worker as a whole) and
``jaxdist.v1.Worker``.

* ``NOT_SERVING`` from the moment the server exists until the worker is ready (``jaxdist-worker``
  marks it :meth:`WorkerHealth.set_serving` just before it prints its ``listening on`` line);
* ``SERVING`` from then on;
* ``NOT_SERVING`` for good once a drain begins (SIGTERM, ``WorkerServicer.drain``), so a load
  balancer stops sending new work while the frames in flight finish.

Where it is served (SECURITY.md, "Health checks and metrics"):

* on the worker's own port, with its TLS. ``Check`` and ``List`` need no token
  (``security.TOKENLESS_METHODS``); ``Watch`` holds a call open, so it needs the token like
  every other call;
* with ``--health-listen HOST:PORT``, on a plaintext port of its own that serves nothing but
  health, every method without credentials: for probes that cannot do TLS or present a client
  certificate (Kubernetes' gRPC probes cannot).

The status is kept by grpc's own asyncio servicer, on the worker's data-plane loop, so a
``Watch`` costs no thread and a loop that stops turning also stops answering probes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from jaxdist.core.errors import TransportError
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["HEALTH_PORT_MAX_RPCS", "SERVICES", "WorkerHealth"]

log = logging.getLogger(__name__)

SERVICES = ("", pb.DESCRIPTOR.services_by_name["Worker"].full_name)
"""The service names the worker reports: the overall status and the worker service's."""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

HEALTH_PORT_MAX_RPCS = 32  # calls at once on the --health-listen port (probes make one or two)
_HEALTH_PORT_MAX_MESSAGE = 4096  # request bytes on that port: a service name fits many times
_SET_TIMEOUT_S = 5.0  # for a status change to reach the loop


class _Servicer(health_aio.HealthServicer):
    """grpc's asyncio health servicer, with ``List`` (the base answers it ``UNIMPLEMENTED``)."""

    def __init__(self, status: Callable[[], int]) -> None:
        super().__init__()
        self._status = status

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
                   ) -> health_pb2.HealthListResponse:
        reply = health_pb2.HealthListResponse()
        for name in SERVICES:
            reply.statuses[name].status = self._status()
        return reply


class WorkerHealth:
    """The health status of one worker, served on its gRPC server and optionally on a port of
    its own.

    :meth:`attach` runs on the server's loop before the server starts; the status changes
    (:meth:`set_serving`, :meth:`shutting_down`) come from any other thread.

    Example::

        health = WorkerHealth()
        await health.attach(server)      # in the coroutine that builds the server
        health.set_serving()             # from the main thread, once ready
        health.shutting_down()           # at the start of a drain: NOT_SERVING for good
    """

    def __init__(self) -> None:
        self.status = NOT_SERVING
        self._final = False
        self._servicer = _Servicer(lambda: self.status)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ports: list[grpc.aio.Server] = []

    @property
    def serving(self) -> bool:
        return bool(self.status == SERVING)

    async def attach(self, server: grpc.aio.Server) -> None:
        """Serve ``grpc.health.v1`` on ``server`` (call it on its loop, before it starts); every
        service starts ``NOT_SERVING``."""
        self._loop = asyncio.get_running_loop()
        for name in SERVICES:
            await self._servicer.set(name, self.status)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def set_serving(self) -> None:
        """The worker is ready: ``SERVING``, unless a drain has begun. A loop that does not take
        it within 5 s is logged as an error, and probes go on seeing ``NOT_SERVING``.

        Raises:
            TransportError: the health service is not attached to a server.
        """
        if self._loop is None:
            raise TransportError("the health service is not attached to a server: call "
                                 "WorkerHealth.attach(server) while building it")
        if self._final:
            return
        self.status = SERVING
        if not self._on_loop(self._apply):
            self.status = NOT_SERVING
            log.error("the data-plane loop did not take the health status SERVING within %g s; "
                      "health checks answer NOT_SERVING", _SET_TIMEOUT_S)

    def shutting_down(self) -> None:
        """A drain begins: ``NOT_SERVING`` for good. Watchers hear it at once; a loop that does
        not take it within 5 s is logged, and ``Check`` answers ``NOT_SERVING`` anyway."""
        self._final = True
        self.status = NOT_SERVING
        if self._loop is not None and not self._on_loop(self._servicer.enter_graceful_shutdown):
            log.warning("the data-plane loop did not take the health status NOT_SERVING within "
                        "%g s; watchers may not have heard it", _SET_TIMEOUT_S)

    async def _apply(self) -> None:
        for name in SERVICES:
            await self._servicer.set(name, self.status)

    def _on_loop(self, fn: Callable[[], Any]) -> bool:
        """Run coroutine function ``fn`` on the loop from another thread; False on a timeout or
        a closed loop."""
        if self._loop is None or self._loop.is_closed():
            return False
        future = asyncio.run_coroutine_threadsafe(fn(), self._loop)
        try:
            future.result(_SET_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            return False
        return True

    def serve(self, host: str, port: int) -> str:
        """Serve health alone on plaintext ``host:port`` too (``--health-listen``; port 0 picks a
        free port), with no credentials asked. Call after :meth:`attach`.

        Returns:
            The bound ``HOST:PORT``.

        Raises:
            TransportError: the address cannot be bound.
        """
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if self._loop is None:
            raise TransportError("the health service is not attached to a server: call "
                                 "WorkerHealth.attach(server) before serving --health-listen")

        async def start() -> int:
            server = grpc.aio.server(
                # no SO_REUSEPORT: a port in use is an error, never shared with another process
                options=[("grpc.max_receive_message_length", _HEALTH_PORT_MAX_MESSAGE),
                         ("grpc.so_reuseport", 0)],
                maximum_concurrent_rpcs=HEALTH_PORT_MAX_RPCS)
            health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
            try:
                bound: int = server.add_insecure_port(where)
            except RuntimeError as exc:
                raise TransportError(f"cannot listen on {where} (--health-listen): {exc}"
                                     ) from None
            if bound == 0:
                raise TransportError(f"cannot listen on {where} (--health-listen): address in "
                                     f"use or not available")
            await server.start()
            self._ports.append(server)
            return bound

        bound = asyncio.run_coroutine_threadsafe(start(), self._loop).result(_SET_TIMEOUT_S * 2)
        return f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    def close(self) -> None:
        """Stop the ``--health-listen`` ports (their watchers are cancelled)."""
        ports, self._ports = self._ports, []

        async def stop_all() -> None:
            for server in ports:
                await server.stop(None)

        if ports:
            self._on_loop(stop_all)
