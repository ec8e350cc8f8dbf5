"""The worker service with jaxdist's own (de)serializers on its two data-plane streams.

``Push`` requests and ``Subscribe`` events carry activations, so they skip protobuf's message
objects: they are written by :func:`frames.split_frame` / :func:`frames.result_events` straight
from the arrays, and read by :func:`frames.parse_frame` / :func:`frames.parse_event` into views
of the received bytes. Each protobuf object on the way would cost a full copy of the tensor data
(building it, serializing it, and every read of a ``bytes`` field). The bytes on the wire are
the same ``Frame`` and ``Event`` messages protobuf writes: any gRPC client of ``jaxdist.v1``
still talks to a worker.

A request that does not parse is answered ``INVALID_ARGUMENT`` (:class:`CodecError`, from
:func:`parse_request` or :func:`frames.parse_frame`) through the servicer's one status mapping.
When the deserializer of a unary request raises, grpc answers ``UNKNOWN`` before the servicer
runs, so those requests (``LoadStage``, ``Info``, ``Subscribe``, ...) reach the servicer as the
received bytes and it parses them; the requests of a client stream are parsed by grpc, and a
failure surfaces where the servicer iterates over them.

The method table comes from the service descriptor (the ``.proto``), never from hand-written
paths; the generated ``*_pb2_grpc.py`` is used for everything else.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from jaxdist.core.errors import CodecError
from jaxdist.core.transport import frames
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["PUSH", "SUBSCRIBE", "add_worker_servicer", "parse_request", "push_method",
           "request_class", "subscribe_method"]

M = TypeVar("M", bound=Message)

_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"]
PUSH = _SERVICE.methods_by_name["Push"]
SUBSCRIBE = _SERVICE.methods_by_name["Subscribe"]


def _path(method: Any) -> str:
    return f"/{_SERVICE.full_name}/{method.name}"


def push_method(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """``Push`` on a channel (sync or aio): send serialized frames (or ``pb.Frame``)."""
    return channel.stream_unary(_path(PUSH), request_serializer=frames.serialize,
                                response_deserializer=pb.PushAck.FromString)


def subscribe_method(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """``Subscribe`` on a channel: events arrive as :class:`frames.EventView`."""
    return channel.unary_stream(_path(SUBSCRIBE),
                                request_serializer=pb.SubscribeRequest.SerializeToString,
                                response_deserializer=frames.parse_event)


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def request_class(method_name: str) -> type[Message] | None:
    """The request message class of a worker method whose request reaches the servicer as
    bytes (see the module docstring); ``None`` for a client stream, whose requests arrive
    parsed."""
    method = _SERVICE.methods_by_name[method_name]
    return None if method.client_streaming else getattr(pb, method.input_type.name)


def parse_request(cls: type[M], data: bytes) -> M:
    """Parse the bytes of a unary call's request.

    Raises:
        CodecError: the bytes are not a ``cls`` message.
    """
    try:
        msg: M = cls.FromString(data)
        return msg
    except DecodeError as exc:
        raise CodecError(f"malformed {cls.DESCRIPTOR.name} ({len(data)} bytes): {exc}") from None


def add_worker_servicer(servicer: Any, server: grpc.Server | grpc.aio.Server) -> None:
    """Serve every method of the worker service from ``servicer`` (one method per RPC, by the
    RPC's name), the data-plane streams with the (de)serializers of :mod:`frames`.

    Methods with a unary request get its bytes (:func:`request_class`): ``servicer`` parses
    them with :func:`parse_request`."""
    handlers = {}
    for method in _SERVICE.methods:
        request = getattr(pb, method.input_type.name)
        response = getattr(pb, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=(functools.partial(parse_request, request)
                                  if method.client_streaming else None),
            response_serializer=response.SerializeToString)
    handlers[PUSH.name] = handlers[PUSH.name]._replace(request_deserializer=frames.parse_frame)
    handlers[SUBSCRIBE.name] = handlers[SUBSCRIBE.name]._replace(
        response_serializer=frames.serialize)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)
