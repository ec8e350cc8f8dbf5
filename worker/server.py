"""Build the worker's gRPC server. ``create_server`` binds; ``__main__`` serves."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from jaxdist.errors import TransportError
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.transport.channel import SERVER_OPTIONS

from jaxdist.worker.servicer import WorkerConfig, WorkerServicer

__all__ = ["create_server"]

log = logging.getLogger(__name__)

# Each Push and Subscribe stream holds a thread for its lifetime; size the pool for many
# pipelines' streams plus control calls.
MAX_WORKERS = 64


def create_server(listen: str, config: WorkerConfig
                  ) -> tuple[grpc.Server, WorkerServicer, str]:
    """Create and start a worker server on ``HOST:PORT`` (port 0 picks a free port).

    Returns:
        ``(server, servicer, address)`` where ``address`` is the bound ``HOST:PORT``.

    Raises:
        TransportError: the address cannot be bound.
    """
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise TransportError(f"--listen expects HOST:PORT, found {listen!r}")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_WORKERS,
                                                    thread_name_prefix="rpc"),
                         options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_WORKERS * 4)
    try:
        bound = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise TransportError(f"cannot listen on {listen}: {exc}") from None
    if bound == 0:
        raise TransportError(f"cannot listen on {listen}: address in use or not available")
    address = f"{host}:{bound}"
    servicer = WorkerServicer(config, address=address)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    server.start()
    log.info("worker serving on %s", address)
    return server, servicer, address
