"""The gRPC servicer of the generic worker. It holds no model code: stages arrive as specs.

Every failure of a unary call is mapped to a gRPC status in one place, :func:`_rpc`, through
``jaxdist.transport.status``. Failures of a frame are not call failures: they are reported to the
coordinator's subscription with the stage, this worker's address and the traceback, and the
stream goes on serving the next frame.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import jax
import jaxlib
import psutil

import jaxdist
from jaxdist import artifacts, devices
from jaxdist.errors import ArtifactError, JaxdistError, LimitError, SessionError
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.registry import LocalRegistry
from jaxdist.spec import SPEC_VERSION, StageSpec, validate
from jaxdist.stage import WorkerStage
from jaxdist.transport import status
from jaxdist.transport.frames import FrameAssembler, FrameView, header_of
from jaxdist.weights import WeightCache

from jaxdist.worker.runtime import HEARTBEAT, Hub, PeerPool, StageRuntime, remote_error
from jaxdist.worker.sessions import SessionStore

__all__ = ["WorkerConfig", "WorkerServicer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_S = 0.5


@dataclass
class WorkerConfig:
    """Everything a worker is told at start-up."""

    weights_roots: Sequence[str] = ()                 # weight URIs resolve only under these
    artifact_cache: str = ""                          # on-disk artifact store (survives restarts)
    device: str = "auto"                              # which devices this worker offers
    max_sessions: int = 64                            # resident sessions, LRU beyond
    allowed_custom_calls: Collection[str] = artifacts.DEFAULT_CUSTOM_CALL_ALLOWLIST
    max_artifact_bytes: int = 256 << 20               # largest artifact accepted
    max_frame_tensor_bytes: int = 1 << 30             # largest single tensor in a frame
    max_tensors_per_frame: int = 256
    devices: Sequence[Any] | None = field(default=None, repr=False)  # tests pass fakes


def _rpc(method: Callable[..., T]) -> Callable[..., T]:
    """Map every exception of a unary call to one status code and a message (the one place)."""

    @functools.wraps(method)
    def wrapper(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> T:
        try:
            return method(self, request, context)
        except Exception as exc:
            code = status.code_for(exc)
            if not isinstance(exc, JaxdistError):
                log.exception("%s failed", method.__name__)
            context.set_trailing_metadata((("jaxdist-error-type", type(exc).__name__),))
            context.abort(code, str(exc))
            raise  # unreachable: abort raises

    return wrapper


class WorkerServicer(pb_grpc.WorkerServicer):
    """Implements the ``jaxdist.v1.Worker`` service."""

    def __init__(self, config: WorkerConfig, *, address: str = "") -> None:
        self.config = config
        self.address = address
        self.started = time.monotonic()
        self.cache = WeightCache(config.weights_roots)
        self.registry = LocalRegistry(config.artifact_cache)
        self.sessions = SessionStore(config.max_sessions)
        self.hub = Hub()
        self.peers = PeerPool()
        self._all_devices = list(config.devices) if config.devices is not None else None
        # The worker's own directive narrows what stages may ask for.
        self.device = devices.resolve_device(config.device, self._all_devices)
        self._offered = [d for d in (self._all_devices or devices.available_devices())
                         if devices.device_platform(d) == devices.device_platform(self.device)]
        self.device_name = "{}:{}".format(devices.device_platform(self.device),
                                          devices.describe_device(self.device, self._offered)["index"])
        self._stages: dict[tuple[str, int], StageRuntime] = {}
        self._lock = threading.Lock()
        self._draining = threading.Event()
        # Waits for device results and compiles new shapes, off the data-plane loop.
        self._egress_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="egress")

    # -- control plane ----------------------------------------------------------------------

    @_rpc
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        with self._lock:
            runtimes = list(self._stages.values())
        reply = pb.InfoReply(
            address=self.address, worker_version=jaxdist.__version__,
            versions=pb.Versions(spec=SPEC_VERSION, jax=jax.__version__,
                                 jaxlib=jaxlib.__version__,
                                 serialization_version=artifacts.max_serialization_version()),
            default_device=self.device_name,
            sessions=len(self.sessions), max_sessions=self.config.max_sessions,
            rss_bytes=psutil.Process().memory_info().rss,
            uptime_s=time.monotonic() - self.started,
            artifacts=[e.digest for e in self.registry.list()],
            min_serialization_version=artifacts.min_serialization_version(),
            max_serialization_version=artifacts.max_serialization_version())
        for d in self._offered:
            desc = devices.describe_device(d, self._offered)
            reply.devices.add(platform=desc["platform"], index=desc["index"], kind=desc["kind"],
                              memory_total=int(desc.get("memory_total") or 0),
                              memory_free=int(desc.get("memory_free") or 0))
        for rt in runtimes:
            reply.stages.add(stage_id=rt.stage_id, pipeline_id=rt.pipeline_id,
                             stage_index=rt.spec.stage_index,
                             artifact_digest=rt.spec.artifact_digest, model=rt.spec.model,
                             weight_bytes=rt.stage.weight_bytes,
                             sessions=self.sessions.count(rt.stage_id), device=str(rt.stage.device))
        return reply

    @_rpc
    def HasArtifact(self, request: pb.ArtifactQuery, context: grpc.ServicerContext
                    ) -> pb.ArtifactPresence:
        return pb.ArtifactPresence(present=self.registry.has(request.digest))

    @_rpc
    def UploadArtifact(self, request_iterator: Iterator[pb.ArtifactChunk],
                       context: grpc.ServicerContext) -> pb.UploadReply:
        digest, parts, size = "", [], 0
        for chunk in request_iterator:
            if not digest:
                digest = chunk.digest
                if chunk.total_bytes > self.config.max_artifact_bytes:
                    raise LimitError(f"artifact {digest} is {chunk.total_bytes} bytes, over the "
                                     f"artifact size limit of {self.config.max_artifact_bytes}")
            size += len(chunk.data)
            if size > self.config.max_artifact_bytes:
                raise LimitError(f"artifact {digest} exceeds the artifact size limit of "
                                 f"{self.config.max_artifact_bytes} bytes")
            parts.append(chunk.data)
        if not digest:
            raise ArtifactError("empty artifact upload: the first chunk must name the digest")
        data = b"".join(parts)
        found = artifacts.digest_of(data)
        if found != digest:
            raise ArtifactError(f"uploaded artifact does not match its digest: expected {digest}, "
                                f"found {found} ({len(data)} bytes)")
        stored = not self.registry.has(digest)
        if stored:
            self.registry.put(data)
        return pb.UploadReply(digest=digest, stored=stored, size=len(data))

    @_rpc
    def LoadStage(self, request: pb.LoadStageRequest, context: grpc.ServicerContext
                  ) -> pb.LoadStageReply:
        spec = StageSpec.from_proto(request.spec)
        validate(spec)
        pipeline_id = request.pipeline_id or spec.stage_id.split("/")[0] or "default"
        key = (pipeline_id, spec.stage_index)
        stage_id = spec.stage_id or f"{pipeline_id}/{spec.stage_index}"
        with self._lock:
            old = self._stages.get(key)
        if old is not None and old.spec.replace(artifact=None) == spec.replace(artifact=None):
            return pb.LoadStageReply(stage_id=stage_id, already_loaded=True,
                                     weight_bytes=old.stage.weight_bytes,
                                     device=str(old.stage.device))
        if spec.artifact is not None:
            data = spec.artifact
            if artifacts.digest_of(data) == spec.artifact_digest and not self.registry.has(
                    spec.artifact_digest):
                self.registry.put(data)
        elif self.registry.has(spec.artifact_digest):
            data = self.registry.get(spec.artifact_digest)
        else:
            raise ArtifactError(f"artifact {spec.artifact_digest} not in this worker's cache; "
                                f"upload it first (UploadArtifact) or inline it in the spec")
        stage = WorkerStage.load(spec.replace(artifact=None), artifact=data, cache=self.cache,
                                 allowed_custom_calls=self.config.allowed_custom_calls,
                                 devices=self._offered)
        runtime = StageRuntime(stage, stage_id=stage_id, pipeline_id=pipeline_id,
                               sessions=self.sessions, hub=self.hub, peers=self.peers,
                               address=self.address, pool=self._egress_pool)
        with self._lock:
            old = self._stages.pop(key, None)
            self._stages[key] = runtime
        if old is not None:
            old.stop()
        return pb.LoadStageReply(stage_id=stage_id, already_loaded=False, bind_s=stage.bind_seconds,
                                 compile_s=stage.compile_seconds, weight_bytes=stage.weight_bytes,
                                 device=str(stage.device))

    @_rpc
    def UnloadStage(self, request: pb.UnloadStageRequest, context: grpc.ServicerContext
                    ) -> pb.UnloadStageReply:
        with self._lock:
            keys = [k for k, rt in self._stages.items()
                    if request.stage_id in (rt.stage_id, rt.pipeline_id)]
            runtimes = [self._stages.pop(k) for k in keys]
        for rt in runtimes:
            rt.stop()
        return pb.UnloadStageReply(unloaded=bool(runtimes))

    @_rpc
    def DescribeWeights(self, request: pb.DescribeWeightsRequest, context: grpc.ServicerContext
                        ) -> pb.DescribeWeightsReply:
        infos = self.cache.describe(request.path)
        reply = pb.DescribeWeightsReply()
        for name, info in infos.items():
            reply.tensors.add(name=name, shape=list(info.shape), dtype=info.dtype,
                              quant=info.quant or "", nbytes=info.nbytes)
        for key, value in self.cache.metadata(request.path).items():
            reply.metadata[key] = json.dumps(value, default=str)
        return reply

    @_rpc
    def EndSession(self, request: pb.EndSessionRequest, context: grpc.ServicerContext
                   ) -> pb.EndSessionReply:
        with self._lock:
            ids = [rt.stage_id for rt in self._stages.values()
                   if rt.pipeline_id == request.pipeline_id]
        freed, nbytes = self.sessions.end(request.session_id, ids)
        return pb.EndSessionReply(freed_stages=freed, freed_bytes=nbytes)

    # -- data plane -------------------------------------------------------------------------
    # Push and Subscribe are coroutines: they run on the data-plane event loop (server.py),
    # where the stages run and the next hops are written. The control calls above are plain
    # functions and run in the server's thread pool.

    async def Push(self, request_iterator: AsyncIterator[FrameView],
                   context: grpc.aio.ServicerContext) -> pb.PushAck:
        """Frames into the stages of this worker. Bad frames are reported, not fatal.

        Requests arrive as :class:`FrameView` (see ``jaxdist.transport.wire``)."""
        asm = FrameAssembler(max_bytes=self.config.max_frame_tensor_bytes,
                             max_tensors=self.config.max_tensors_per_frame)
        count = 0
        async for msg in request_iterator:
            count += 1
            header = header_of(msg.msg)
            runtime = self._stages.get((header.pipeline_id, header.stage))
            try:
                if self._draining.is_set():
                    raise SessionError(f"worker {self.address} is shutting down; frame of "
                                       f"session {header.session_id!r} refused")
                if runtime is None:
                    raise SessionError(f"unknown stage: pipeline {header.pipeline_id!r} stage "
                                       f"{header.stage} is not loaded on worker {self.address}")
                done = asm.add(msg, header)
                if done is None:
                    continue
                header, tensors = done
                shapes = runtime.stage.check_inputs(tensors)
            except Exception as exc:
                asm.reset()
                await self._report(header, exc)
                continue
            await runtime.process(header, tensors, shapes)
        return pb.PushAck(frames=count)

    async def _report(self, header: Any, exc: BaseException) -> None:
        err = remote_error(exc, stage=header.stage, address=self.address)
        log.info("rejected frame of session %r step %d: %s", header.session_id, header.step, exc)
        await self.hub.publish(header.pipeline_id, header.reply_to,
                               pb.Event(error=err, request_id=header.request_id,
                                        session_id=header.session_id))

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.Event]:
        """Results, errors and heartbeats of one pipeline, until the coordinator hangs up."""
        q = self.hub.open(request.pipeline_id, request.reply_to)
        beat = asyncio.get_running_loop().create_task(self._heartbeats(q))
        try:
            yield pb.Event(heartbeat=time.monotonic() - self.started)
            while True:
                event = await q.get()
                if event is None:
                    return
                if event is HEARTBEAT:
                    event = pb.Event(heartbeat=time.monotonic() - self.started)
                yield event
        finally:
            beat.cancel()
            self.hub.close(request.pipeline_id, request.reply_to, q)

    @staticmethod
    async def _heartbeats(q: asyncio.Queue[Any]) -> None:
        """Queue a heartbeat every HEARTBEAT_S while the subscription has nothing to send."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if q.empty():
                q.put_nowait(HEARTBEAT)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float = 30.0) -> bool:
        """Refuse new frames and wait for in-flight ones to leave. True when all finished."""
        self._draining.set()
        deadline = time.monotonic() + timeout
        with self._lock:
            runtimes = list(self._stages.values())
        return all(rt.drain(max(0.0, deadline - time.monotonic())) for rt in runtimes)

    def close(self) -> None:
        with self._lock:
            runtimes = list(self._stages.values())
            self._stages.clear()
        for rt in runtimes:
            rt.stop()
        self.hub.shutdown()
        self.peers.close()
        self._egress_pool.shutdown(wait=False)
        self.cache.close()
