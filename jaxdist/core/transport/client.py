"""A typed client for one worker: unary calls raise jaxdist errors, never raw ``grpc.RpcError``."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import grpc

from jaxdist.core.errors import JaxdistError, TransportError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import security, status, wire
from jaxdist.core.transport.channel import FrameSender, make_channel
from jaxdist.core.transport.trust import check_token_destination
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

__all__ = ["Call", "WorkerClient", "raise_for_rpc"]

log = logging.getLogger(__name__)

T = TypeVar("T")

UPLOAD_CHUNK = 1 << 20


def raise_for_rpc(exc: grpc.RpcError, address: str, what: str) -> JaxdistError:
    """The jaxdist error for a failed call: the class the worker raised, or one by status code."""
    remote_type = ""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "jaxdist-error-type":
            remote_type = value
    code = exc.code()
    cls = status.error_class_for(code, remote_type)
    details = exc.details() or code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAUTHENTICATED):
        details = f"{code.name}: {details}"
    return cls(f"worker {address}: {what}: {details}")


class Call(Generic[T]):
    """A unary call in flight, which another thread may cancel (Ctrl-C during a compile).

    :meth:`result` waits and raises jaxdist errors, as the blocking calls do; a cancelled call
    raises :class:`TransportError`. The worker sees the cancellation at once (a ``LoadStage``
    then abandons its load: ``worker/loads.py``).
    """

    def __init__(self, client: WorkerClient, what: str, future: Any) -> None:
        self._client = client
        self._what = what
        self._future = future

    def result(self) -> T:
        try:
            result: T = self._future.result()
            return result
        except grpc.FutureCancelledError:
            raise TransportError(f"worker {self._client.address}: {self._what}: cancelled"
                                 ) from None
        except grpc.RpcError as exc:
            raise self._client._error(exc, self._what) from None

    def cancel(self) -> bool:
        """Cancel the call, unless it has finished. True when it was cancelled."""
        return bool(self._future.cancel())


class WorkerClient:
    """Control-plane calls to one worker, with deadlines.

    Args:
        address: ``HOST:PORT``.
        timeout: default deadline of quick calls, in seconds.
        metadata: call metadata sent with every call (e.g. ``authorization``).
        credentials: TLS channel credentials, or ``None`` for plaintext.
        insecure_token: allow a token in ``metadata`` to go in plaintext to an address that is
            not loopback (``--insecure-token``); without it that is refused.

    Both usually come from :func:`jaxdist.core.transport.security.client_auth`.

    Raises:
        AuthError: a token would go in plaintext to a non-loopback address
            (:func:`jaxdist.core.transport.trust.check_token_destination`).
    """

    def __init__(self, address: str, *, timeout: float = 10.0,
                 metadata: tuple[tuple[str, str], ...] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 insecure_token: bool = False) -> None:
        token = any(k == security.AUTH_HEADER for k, _ in metadata)
        check_token_destination(address, token=token, tls=credentials is not None,
                                insecure_token=insecure_token)
        self.address = address
        self.timeout = timeout
        self.metadata = metadata
        self.tls = credentials is not None
        self.channel = make_channel(address, credentials=credentials)
        self.stub = pb_grpc.WorkerStub(self.channel)

    def _call(self, what: str, fn: Callable[..., T], request: Any, timeout: float | None = None
              ) -> T:
        try:
            return fn(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise self._error(exc, what) from None

    def _start(self, what: str, fn: Any, request: Any, timeout: float | None = None) -> Call[Any]:
        return Call(self, what, fn.future(request, timeout=timeout or self.timeout,
                                          metadata=self.metadata))

    def _error(self, exc: grpc.RpcError, what: str) -> JaxdistError:
        error = raise_for_rpc(exc, self.address, what)
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            hint = security.connection_hint(exc.details() or "", tls=self.tls)
            error = type(error)(f"{error}{hint}")
        return error

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the worker's channel is connected, at most ``timeout`` seconds.

        A connection that fails (refused: nothing listens there; a TLS mismatch) is reported
        at once rather than after the timeout.

        Raises:
            TransportError: not reachable, naming the address and why.
        """
        settled = threading.Event()
        states: list[grpc.ChannelConnectivity] = []

        def seen(state: grpc.ChannelConnectivity) -> None:
            if state in (grpc.ChannelConnectivity.READY,
                         grpc.ChannelConnectivity.TRANSIENT_FAILURE):
                states.append(state)
                settled.set()

        self.channel.subscribe(seen, try_to_connect=True)
        try:
            settled.wait(timeout)
        finally:
            self.channel.unsubscribe(seen)
        if states and states[0] == grpc.ChannelConnectivity.READY:
            return
        # Why it is not ready: one short call says it (e.g. a TLS mismatch, given a hint).
        try:
            self.stub.Info(pb.InfoRequest(), timeout=min(timeout, 1.0), metadata=self.metadata)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise raise_for_rpc(exc, self.address, "Info") from None
            details = exc.details() or ""
            hint = security.connection_hint(details, tls=self.tls)
            waited = "" if states else f" after {timeout}s"
            raise TransportError(f"worker {self.address} is not reachable{waited}: "
                                 f"{exc.code().name}: {details}{hint}") from None
        # It answered: it became reachable just now.

    def info(self, timeout: float | None = None) -> pb.InfoReply:
        reply: pb.InfoReply = self._call("Info", self.stub.Info, pb.InfoRequest(), timeout)
        return reply

    def has_artifact(self, digest: str) -> bool:
        present: bool = self._call("HasArtifact", self.stub.HasArtifact,
                                   pb.ArtifactQuery(digest=digest)).present
        return present

    def upload_artifact(self, digest: str, data: bytes, timeout: float = 300.0) -> pb.UploadReply:
        return self.start_upload_artifact(digest, data, timeout).result()

    def start_upload_artifact(self, digest: str, data: bytes, timeout: float = 300.0
                              ) -> Call[pb.UploadReply]:
        """:meth:`upload_artifact`, as a call that can be cancelled."""
        def chunks() -> Iterator[pb.ArtifactChunk]:
            for off in range(0, max(len(data), 1), UPLOAD_CHUNK):
                yield pb.ArtifactChunk(digest=digest, data=data[off:off + UPLOAD_CHUNK],
                                       total_bytes=len(data))
        return self._start("UploadArtifact", self.stub.UploadArtifact, chunks(), timeout)

    def load_stage(self, spec: StageSpec, pipeline_id: str, timeout: float = 1800.0, *,
                   lease_s: float = 0.0, key: bytes = b"") -> pb.LoadStageReply:
        return self.start_load_stage(spec, pipeline_id, timeout, lease_s=lease_s,
                                     key=key).result()

    def start_load_stage(self, spec: StageSpec, pipeline_id: str, timeout: float = 1800.0, *,
                         lease_s: float = 0.0, key: bytes = b"") -> Call[pb.LoadStageReply]:
        """:meth:`load_stage`, as a call that can be cancelled. While it runs, the worker's
        ``Info`` lists it under ``loading`` with its phase. ``lease_s`` > 0: the worker
        unloads the pipeline's stages once nobody has subscribed to it for that long; 0:
        they stay until unloaded."""
        return self._start(f"LoadStage (stage {spec.stage_index})", self.stub.LoadStage,
                           pb.LoadStageRequest(spec=spec.to_proto(), pipeline_id=pipeline_id,
                                               lease_s=lease_s, pipeline_key=key),
                           timeout)

    def unload_stage(self, stage_id: str, timeout: float | None = None) -> bool:
        unloaded: bool = self._call("UnloadStage", self.stub.UnloadStage,
                                    pb.UnloadStageRequest(stage_id=stage_id), timeout).unloaded
        return unloaded

    def describe_weights(self, path: str) -> tuple[list[pb.WeightInfo], dict[str, Any]]:
        reply = self._call(f"DescribeWeights({path})", self.stub.DescribeWeights,
                           pb.DescribeWeightsRequest(path=path), 60.0)
        return list(reply.tensors), {k: json.loads(v) for k, v in reply.metadata.items()}

    def end_session(self, pipeline_id: str, session_id: str, key: bytes = b""
                    ) -> pb.EndSessionReply:
        reply: pb.EndSessionReply = self._call(
            "EndSession", self.stub.EndSession,
            pb.EndSessionRequest(pipeline_id=pipeline_id, session_id=session_id, pipeline_key=key))
        return reply

    def sender(self, on_error: Callable[[TransportError], None] | None = None,
               max_pending: int = 64, metadata: tuple[tuple[str, str | bytes], ...] = ()
               ) -> FrameSender:
        """A ``Push`` stream to this worker; ``metadata`` goes with the client's own (a
        pipeline's hop credential: ``transport/hop.py``)."""
        return FrameSender(wire.push_method(self.channel), self.address, on_error=on_error,
                           metadata=(*self.metadata, *metadata), max_pending=max_pending)

    def subscribe(self, pipeline_id: str, reply_to: str, key: bytes = b"") -> Any:
        """The event stream of a pipeline on this worker, as :class:`frames.EventView` items
        (cancel it to stop). ``key``: the pipeline's key, empty for a shared pipeline."""
        return wire.subscribe_method(self.channel)(
            pb.SubscribeRequest(pipeline_id=pipeline_id, reply_to=reply_to, pipeline_key=key),
            metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
