"""The gRPC servicer of the generic worker. It holds no model code: stages arrive as specs.

Every failure of a call is mapped to a gRPC status in one place, :func:`_failure`, through
``jaxdist.core.transport.status``: for unary calls in :func:`_rpc`, which also parses their request
bytes (see ``jaxdist.core.transport.wire``), in ``LoadStage`` (a coroutine, so that it learns
when its caller leaves: ``worker/loads.py``), and for a stream whose requests cannot be read.
Failures of a frame are not call failures: they are reported to the coordinator's subscription
with the stage, this worker's address and the traceback, and the stream goes on serving the
next frame.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import jax
import jaxlib
import psutil

import jaxdist
from jaxdist.core import artifacts, devices, heap, kernels
from jaxdist.core.errors import (
    ArtifactError,
    AuthError,
    JaxdistError,
    LimitError,
    PipelineKeyError,
    TransportError,
)
from jaxdist.core.runtime import StageRuntime, remote_error
from jaxdist.core.sessions import SessionStore
from jaxdist.core.spec import SPEC_VERSION, StageSpec, validate
from jaxdist.core.stage import WorkerStage, shapes_at_load
from jaxdist.core.transport import hop, status, wire
from jaxdist.core.transport.frames import FrameView
from jaxdist.core.transport.trust import check_hop
from jaxdist.core.weights import WeightCache
from jaxdist.core.weights.uri import clip
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.worker.artifact_cache import ArtifactCache
from jaxdist.worker.config import WorkerConfig
from jaxdist.worker.health import WorkerHealth
from jaxdist.worker.ingress import FrameIngress
from jaxdist.worker.limits import (
    InflightBytes,
    Streams,
    check_ids,
    default_max_kv_bytes,
    next_within,
    stream_owner,
)
from jaxdist.worker.loads import CallerLeft, Load, Loads
from jaxdist.worker.pipelines import LoadedPipelines, stop_unloaded
from jaxdist.worker.runtime import (
    HEARTBEAT,
    GrpcRoute,
    Hub,
    OpenSubscription,
    PeerPool,
    Subscription,
)
from jaxdist.worker.tcp_route import TcpRoute
from jaxdist.worker.uploads import ArtifactUploads

__all__ = ["WorkerServicer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

HEARTBEAT_S = 0.5
# LoadStage calls that load at once; more wait for a thread (each compiles and binds a stage).
LOAD_THREADS = 8


def _route_kind(runtime: StageRuntime) -> str:
    """How a stage's frames leave: "tcp" or "grpc" (``LoadedStage.route``)."""
    return "tcp" if isinstance(runtime.route, TcpRoute) else "grpc"


def _failure(exc: BaseException, context: grpc.ServicerContext | grpc.aio.ServicerContext,
             method: str) -> grpc.StatusCode:
    """The status code a failed call ends with, and its error class as trailing metadata (the
    one place). Logs the traceback of an error that is not a ``JaxdistError``: a bug."""
    if not isinstance(exc, JaxdistError):
        log.exception("%s failed", method)
    context.set_trailing_metadata((("jaxdist-error-type", type(exc).__name__),))
    return status.code_for(exc)


def _rpc(method: Callable[..., T]) -> Callable[..., T]:
    """Parse a unary call's request bytes (``wire.parse_request``), and map every exception of
    the call, a malformed request included, to one status code and a message."""
    request_class = wire.request_class(method.__name__)

    @functools.wraps(method)
    def wrapper(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> T:
        try:
            if request_class is not None:
                request = wire.parse_request(request_class, request)
            return method(self, request, context)
        except Exception as exc:
            # Clipped: gRPC carries the message in a header, which the client bounds (8 KiB).
            context.abort(_failure(exc, context, method.__name__), clip(str(exc), 4000))
            raise  # unreachable: abort raises

    return wrapper


class WorkerServicer(pb_grpc.WorkerServicer):
    """Implements the ``jaxdist.v1.Worker`` service."""

    def __init__(self, config: WorkerConfig, *, address: str = "") -> None:
        self.config = config
        self.address = address
        self.data_port = 0  # the data port (worker/data_listener.py), set by server.py; 0: off
        self.started = time.monotonic()
        self.cache = WeightCache(config.weights_roots)
        self.registry = ArtifactCache(config.artifact_cache,
                                      max_bytes=config.max_artifact_cache_bytes,
                                      in_use=self._artifacts_in_use)
        self.hub = Hub(config.max_subscriber_events, config.max_subscriber_bytes,
                       config.max_queued_event_bytes)
        self.peers = PeerPool(config.peer_auth, config.peer_trust)
        self._all_devices = list(config.devices) if config.devices is not None else None
        # The worker's own directive narrows what stages may ask for.
        self.device = devices.resolve_device(config.device, self._all_devices)
        self._offered = [d for d in (self._all_devices or devices.available_devices())
                         if devices.device_platform(d) == devices.device_platform(self.device)]
        self.device_name = "{}:{}".format(devices.device_platform(self.device),
                                          devices.describe_device(self.device, self._offered)["index"])
        # Quantized weights need the CPU kernels; a GPU/TPU worker dequantizes in the graph.
        cpu = devices.device_platform(self.device) == "cpu"
        self.kernels = kernels.load(threads=config.kernel_threads,
                                    enabled=config.kernels and cpu)
        if not cpu:
            self.kernels = kernels.KernelInfo(False, reason="not a cpu worker")
        self.sessions = SessionStore(config.max_sessions, max_kv_bytes=self._kv_limit(),
                                     idle_timeout=config.session_idle_timeout)
        self._reaper_stop = threading.Event()
        if config.session_idle_timeout > 0:
            threading.Thread(target=self._reap_idle_sessions, name="session-reaper",
                             daemon=True).start()
        # The loaded stages, their pipelines' keys and leases
        self.pipelines = LoadedPipelines(address, self.hub.subscribed,
                                         max_compiled_shapes=config.max_compiled_shapes)
        self.uploads = ArtifactUploads(config, self.registry)
        self.inflight = InflightBytes(config.max_inflight_bytes)  # frames being received
        # Push, Subscribe and data connections, per pipeline or peer host
        self.streams = Streams(config.max_streams_per_peer, config.frame_idle_timeout)
        threading.Thread(target=self.pipelines.watch_leases, args=(self._reaper_stop,),
                         name="lease-watch", daemon=True).start()
        self._draining = threading.Event()
        self.health = WorkerHealth()  # grpc.health.v1; server.py serves it
        # Compiles new shapes, off the data-plane loop (each stage runs its steps and waits
        # for its device results in threads of its own: jaxdist.core.runtime).
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="compile")
        # LoadStage's work; the call itself waits on the loop, to learn if its caller leaves.
        self.loads = Loads()
        self._load_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=LOAD_THREADS, thread_name_prefix="load")

    def _kv_limit(self) -> int:
        """``max_kv_bytes``, or by default half the memory behind this worker's device."""
        if self.config.max_kv_bytes is not None:
            return self.config.max_kv_bytes
        memory = devices.describe_device(self.device, self._offered).get("memory_total")
        return default_max_kv_bytes(int(memory or 0))

    def _reap_idle_sessions(self) -> None:
        """Reclaim idle sessions now and then, so a crashed coordinator's state is freed even
        when no new session comes to trigger it."""
        period = min(max(self.config.session_idle_timeout / 4, 0.05), 30.0)
        while not self._reaper_stop.wait(period):
            self.sessions.reclaim_idle()

    def runtimes(self) -> list[StageRuntime]:
        """The loaded stages, as they are now (the metrics read them)."""
        return self.pipelines.runtimes()

    def _artifacts_in_use(self) -> set[str]:
        """The loaded stages' artifacts: the artifact cache never deletes them."""
        return {rt.spec.artifact_digest for rt in self.pipelines.runtimes()}

    # -- control plane ----------------------------------------------------------------------

    @_rpc
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        runtimes = self.pipelines.runtimes()
        cached = self.registry.list()
        reply = pb.InfoReply(
            address=self.address, worker_version=jaxdist.__version__,
            versions=pb.Versions(spec=SPEC_VERSION, jax=jax.__version__,
                                 jaxlib=jaxlib.__version__,
                                 serialization_version=artifacts.max_serialization_version()),
            default_device=self.device_name,
            sessions=len(self.sessions), max_sessions=self.config.max_sessions,
            rss_bytes=psutil.Process().memory_info().rss,
            uptime_s=time.monotonic() - self.started,
            artifacts=[e.digest for e in cached],
            artifact_cache_bytes=sum(e.size for e in cached),
            artifact_cache_max_bytes=self.registry.max_bytes,
            min_serialization_version=artifacts.min_serialization_version(),
            max_serialization_version=artifacts.max_serialization_version(),
            kernels=pb.KernelInfo(version=self.kernels.version, types=self.kernels.types,
                                  targets=self.kernels.targets, threads=self.kernels.threads,
                                  unavailable_reason=self.kernels.reason,
                                  isa=self.kernels.isa, cpus=self.kernels.cpus),
            loading=self.loads.to_proto(), data_port=self.data_port,
            upload_bytes=self.uploads.held, inflight_bytes=self.inflight.held,
            streams=self.streams.total)
        for d in self._offered:
            desc = devices.describe_device(d, self._offered)
            reply.devices.add(platform=desc["platform"], index=desc["index"], kind=desc["kind"],
                              memory_total=int(desc.get("memory_total") or 0),
                              memory_free=int(desc.get("memory_free") or 0),
                              memory_used=int(desc.get("memory_used") or 0),
                              memory_source=desc.get("memory_source") or "")
        for rt in runtimes:
            reply.stages.add(stage_id=rt.stage_id, pipeline_id=rt.pipeline_id,
                             stage_index=rt.spec.stage_index,
                             artifact_digest=rt.spec.artifact_digest, model=rt.spec.model,
                             weight_bytes=rt.stage.weight_bytes,
                             sessions=self.sessions.count(rt.stage_id), device=str(rt.stage.device),
                             packed_bytes=rt.stage.packed_bytes,
                             dequantized_types=rt.stage.dequantized_types,
                             frames=rt.frames_done, compute_seconds=rt.compute_s,
                             bytes_in=rt.bytes_in, bytes_out=rt.bytes_out,
                             in_flight=rt.in_flight, route=_route_kind(rt))
        return reply

    @_rpc
    def HasArtifact(self, request: pb.ArtifactQuery, context: grpc.ServicerContext
                    ) -> pb.ArtifactPresence:
        return pb.ArtifactPresence(present=self.registry.has(request.digest))

    async def UploadArtifact(self, request_iterator: AsyncIterator[pb.ArtifactChunk],
                             context: grpc.aio.ServicerContext) -> pb.UploadReply:
        """Receive an artifact, on the loop, under the upload limits (``worker/uploads.py``)."""
        try:
            return await self.uploads.upload(request_iterator)
        except Exception as exc:
            await context.abort(_failure(exc, context, "UploadArtifact"), clip(str(exc), 4000))
            raise  # unreachable: abort raises

    async def LoadStage(self, request: bytes, context: grpc.aio.ServicerContext
                        ) -> pb.LoadStageReply:
        """Load a stage in a thread of the load pool, while the call waits on the loop.

        A coroutine so that it learns when its caller leaves (cancelled, past its deadline, or
        the server stopping): gRPC cancels it then, and the load is abandoned (see
        ``worker/loads.py``). ``request`` is a ``LoadStageRequest``'s bytes, read in the thread.
        """
        load = Load()
        self.loads.add(load)
        future = asyncio.get_running_loop().run_in_executor(self._load_pool, self._load_stage,
                                                            request, load)
        # An abandoned load's outcome has no reader; taking it here keeps asyncio quiet.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            reply = await asyncio.shield(future)
            if reply is None:  # abandoned while the call was still there: the worker stops
                raise TransportError(f"worker {self.address}: LoadStage of stage "
                                     f"{load.stage_id} was abandoned ({load.why}); it is not "
                                     f"loaded")
            return reply
        except asyncio.CancelledError:
            load.leave("the caller left (cancelled, or past its deadline)")
            raise
        except Exception as exc:
            await context.abort(_failure(exc, context, "LoadStage"), str(exc))
            raise  # unreachable: abort raises

    def key_matches(self, pipeline_id: str, key: bytes) -> bool:
        """Whether ``key`` is ``pipeline_id``'s key (``LoadedPipelines.key_matches``)."""
        return self.pipelines.key_matches(pipeline_id, key)

    def hop_key(self, pipeline_id: str) -> bytes | None:
        """The key ``pipeline_id``'s hop credential is made from here (``b""``: none, the token
        then), ``None`` when it is not loaded here (``LoadedPipelines.hop_key``)."""
        return self.pipelines.hop_key(pipeline_id)

    def _check_hops(self, spec: StageSpec, pipeline_id: str) -> None:
        """Refuse, before anything is loaded or dialled, a stage whose next hops this worker may
        not send its frames and credentials to (``transport.trust.check_hop``)."""
        stage = f"LoadStage: stage {spec.stage_index} of pipeline {clip(pipeline_id, 64)!r}"
        for hop in (spec.next_hop, spec.next_data_hop):
            if hop:
                check_hop(hop, self.config.peer_auth, self.config.peer_trust, stage=stage)

    def _load_stage(self, data: bytes, load: Load) -> pb.LoadStageReply | None:
        """LoadStage's work, in a load thread; ``load`` records each phase for ``Info``.
        ``None``: the load was abandoned, and nothing of it is kept."""
        try:
            return self._load(wire.parse_request(pb.LoadStageRequest, data), load)
        except CallerLeft as skipped:
            log.warning("LoadStage of stage %s: %s; it stopped before %s and is not loaded",
                        load.stage_id or "?", load.why, skipped)
            return None
        finally:
            self.loads.remove(load)

    def _load(self, request: pb.LoadStageRequest, load: Load) -> pb.LoadStageReply | None:
        spec = StageSpec.from_proto(request.spec)
        check_ids("LoadStage", self.config.max_id_bytes, pipeline_id=request.pipeline_id,
                  stage_id=spec.stage_id, model=spec.model)
        validate(spec)
        self._check_hops(spec, request.pipeline_id or spec.stage_id)
        pipeline_id = request.pipeline_id or spec.stage_id.split("/")[0] or "default"
        pipelines = self.pipelines
        pipelines.check_key_size(pipeline_id, request.pipeline_key)
        pipelines.check_key("LoadStage", pipeline_id, request.pipeline_key)
        stage_id = spec.stage_id or f"{pipeline_id}/{spec.stage_index}"
        load.describe(stage_id, pipeline_id, spec.stage_index)
        old = pipelines.get(pipeline_id, spec.stage_index)
        if old is not None and old.spec.replace(artifact=None) == spec.replace(artifact=None):
            pipelines.lease(pipeline_id, request.lease_s)
            return pb.LoadStageReply(stage_id=stage_id, already_loaded=True,
                                     weight_bytes=old.stage.weight_bytes,
                                     device=str(old.stage.device))
        # The shapes it compiles now, charged to its pipeline before any is compiled; they
        # are the runtime's once it exists, and it gives them back when it stops.
        reserved = shapes_at_load(spec)
        held = pipelines.charge_shapes(pipeline_id, reserved,
                                       leaving=old.shapes_held if old is not None else 0)
        if held is not None:
            raise LimitError(
                f"LoadStage: stage {spec.stage_index} of pipeline {clip(pipeline_id, 64)!r} "
                f"has {reserved} buckets to compile, and the pipeline holds {held} compiled "
                f"shapes on this worker: over its limit (--max-compiled-shapes="
                f"{pipelines.max_compiled_shapes}, per pipeline)")
        try:
            runtime = self._runtime(request, load, spec, pipeline_id, stage_id)
        except BaseException:
            if reserved:  # no runtime took them
                pipelines.refund_shapes(pipeline_id, reserved)
            raise
        if runtime.shapes_held < reserved:  # buckets of the same shapes: compiled once
            pipelines.refund_shapes(pipeline_id, reserved - runtime.shapes_held)
        return self._install(request, load, runtime, pipeline_id, stage_id)

    def _runtime(self, request: pb.LoadStageRequest, load: Load, spec: StageSpec,
                 pipeline_id: str, stage_id: str) -> StageRuntime:
        """Load, compile and bind a stage whose shapes are charged to its pipeline, and make
        its runtime, which then holds the shapes it compiled."""
        pipelines = self.pipelines
        load.enter("load")
        if spec.artifact is not None:
            data = spec.artifact
            if len(data) > self.config.max_artifact_bytes:
                raise LimitError(f"artifact {spec.artifact_digest} inlined in the spec of stage "
                                 f"{stage_id} is {len(data)} bytes, over the artifact size limit "
                                 f"(--max-artifact-bytes={self.config.max_artifact_bytes})")
            if artifacts.digest_of(data) == spec.artifact_digest and not self.registry.has(
                    spec.artifact_digest):
                self.registry.put(data)
        elif self.registry.has(spec.artifact_digest):
            data = self.registry.get(spec.artifact_digest)
        else:
            raise ArtifactError(f"artifact {spec.artifact_digest} not in this worker's cache; "
                                f"upload it first (UploadArtifact) or inline it in the spec")
        try:
            stage = WorkerStage.load(spec.replace(artifact=None), artifact=data,
                                     cache=self.cache,
                                     allowed_custom_calls=self.config.allowed_custom_calls,
                                     devices=self._offered, worker=self.address,
                                     on_phase=load.enter)
        finally:  # the weight files' maps and parsed headers are not needed between binds
            self.cache.drop_readers()
        load.finish()
        route: GrpcRoute | TcpRoute
        if stage.spec.next_data_hop:
            route = TcpRoute(stage.spec, pipeline_id=pipeline_id, hub=self.hub,
                             auth=self.config.peer_auth, address=self.address,
                             trust=self.config.peer_trust, key=request.pipeline_key)
        else:
            route = GrpcRoute(stage.spec, pipeline_id=pipeline_id, hub=self.hub,
                              peers=self.peers, address=self.address,
                              key=request.pipeline_key)
        log.info("stage %s sends its frames over %s to %s", stage_id, route.kind,
                 stage.spec.next_data_hop or stage.spec.next_hop or "its callers")
        runtime = StageRuntime(stage, stage_id=stage_id, pipeline_id=pipeline_id,
                               sessions=self.sessions, route=route, pool=self._compile_pool,
                               budget=pipelines.shape_budget(pipeline_id))
        return runtime

    def _install(self, request: pb.LoadStageRequest, load: Load, runtime: StageRuntime,
                 pipeline_id: str, stage_id: str) -> pb.LoadStageReply | None:
        """Put a loaded stage in its place (its runtime holds its compiled shapes now: from
        here, stopping it gives them back)."""
        pipelines, stage = self.pipelines, runtime.stage
        try:
            installed, old = pipelines.install(runtime, request.pipeline_key,
                                               abandoned=lambda: load.left)
        except PipelineKeyError:  # another coordinator loaded it meanwhile
            runtime.stop()
            raise
        if not installed:
            runtime.stop()
            del stage, runtime
            heap.release_free_heap()
            log.warning("LoadStage of stage %s: %s while it loaded; it finished anyway and is "
                        "discarded, not loaded", stage_id, load.why)
            return None
        if old is not None:
            old.stop()
        pipelines.lease(pipeline_id, request.lease_s)
        return pb.LoadStageReply(stage_id=stage_id, already_loaded=False, bind_s=stage.bind_seconds,
                                 compile_s=stage.compile_seconds, weight_bytes=stage.weight_bytes,
                                 device=str(stage.device), load_s=load.seconds.get("load", 0.0))

    @_rpc
    def UnloadStage(self, request: pb.UnloadStageRequest, context: grpc.ServicerContext
                    ) -> pb.UnloadStageReply:
        check_ids("UnloadStage", self.config.max_id_bytes, stage_id=request.stage_id)
        # Stopped, and their memory given back (stop_unloaded), before the reply
        stopped = stop_unloaded(self.pipelines.unload(request.stage_id))
        return pb.UnloadStageReply(unloaded=bool(stopped))

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
        check_ids("EndSession", self.config.max_id_bytes, pipeline_id=request.pipeline_id,
                  session_id=request.session_id)
        ids = self.pipelines.stage_ids("EndSession", request.pipeline_id, request.pipeline_key)
        freed, nbytes = self.sessions.end(request.session_id, ids)
        if freed and not self.sessions.nbytes:
            # No session left: what the steps allocated and freed (XLA's per-step temporaries,
            # frame buffers, in per-thread heaps nothing else trims) goes back to the OS, about
            # 85 MB on a SmolLM2 worker (bench/NOTES.md, "Worker memory").
            heap.release_free_heap()
        return pb.EndSessionReply(freed_stages=freed, freed_bytes=nbytes)

    # -- data plane -------------------------------------------------------------------------
    # Push and Subscribe are coroutines: they run on the data-plane event loop (server.py),
    # where the stages run and the next hops are written. The control calls above are plain
    # functions and run in the server's thread pool, except LoadStage, which waits on the loop
    # for its load thread.

    async def Push(self, request_iterator: AsyncIterator[FrameView],
                   context: grpc.aio.ServicerContext) -> pb.PushAck:
        """Frames into the stages of this worker. Bad frames are reported, not fatal.

        Requests arrive as :class:`FrameView` (see ``jaxdist.core.transport.wire``). A request that
        cannot be read (``frames.parse_frame`` raised) ends the call with its status."""
        try:
            return await self._push(request_iterator, context)
        except Exception as exc:
            await context.abort(_failure(exc, context, "Push"), str(exc))
            raise  # unreachable: abort raises

    async def _push(self, request_iterator: AsyncIterator[FrameView],
                    context: grpc.aio.ServicerContext) -> pb.PushAck:
        peer = context.peer()
        # A stream with a pipeline's hop credential (a next hop's, or its coordinator's) opens
        # that one pipeline, so every frame on it must be of that pipeline, and it is counted
        # under that pipeline when the credential proves the pipeline's own key.
        pipeline = self.hop_pipeline(hop.presented(context.invocation_metadata()))
        ingress = FrameIngress(self, pipeline_id=pipeline)
        try:
            with self.streams.hold("Push", self.stream_owner(peer, pipeline),
                                   frames=True) as opened:
                messages = aiter(request_iterator)
                while True:
                    try:
                        msg = await opened.next(next_within(messages, ingress.idle_timeout))
                    except TimeoutError:
                        raise await ingress.stalled(f"Push from {clip(peer, 80)}") from None
                    if msg is None:
                        break
                    await ingress.take(msg)
        finally:
            ingress.close()
        return pb.PushAck(frames=ingress.messages)

    def hop_pipeline(self, given: tuple[str, bytes] | str | None) -> str | None:
        """The pipeline a ``Push``'s hop credential (:func:`hop.presented`) opens, checked
        here whatever else the call presented; ``None`` for a call without one.

        Raises:
            AuthError: malformed, or not that pipeline's credential on this worker.
        """
        if given is None:
            return None
        problem = given if isinstance(given, str) else hop.check(
            given[0], given[1], key=self.hop_key(given[0]), token=self.config.peer_auth.hmac_key)
        if problem is not None:
            raise AuthError(problem)
        assert isinstance(given, tuple)
        return given[0]

    def stream_owner(self, peer: str, pipeline_id: str | None) -> str:
        """Whom a stream of ``peer`` is counted under (``limits.stream_owner``): the pipeline
        when its stream proved that pipeline's own key, else ``peer``'s host. A pipeline
        without a key (``jaxdist deploy``'s) is opened by the shared token: its streams count
        under their host."""
        keyed = pipeline_id is not None and bool(self.hop_key(pipeline_id))
        return stream_owner(peer, pipeline_id if keyed else None)

    def runtime_for(self, pipeline_id: str, stage: int) -> StageRuntime | None:
        """The loaded stage a frame is for, if any (on the loop, per frame: no lock)."""
        return self.pipelines.get(pipeline_id, stage)

    @property
    def draining(self) -> bool:
        """Shutting down: new frames are refused."""
        return self._draining.is_set()

    async def report(self, header: Any, exc: BaseException) -> None:
        """Tell a frame's caller it was refused (on its subscription), and log it."""
        err = remote_error(exc, stage=header.stage, address=self.address)
        log.info("rejected frame of session %r step %d: %s", header.session_id[:64], header.step,
                 exc)
        self.hub.publish(header.pipeline_id, header.reply_to,
                         pb.Event(error=err, request_id=header.request_id,
                                  session_id=header.session_id))

    async def Subscribe(self, request: bytes, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.Event]:
        """Results, errors and heartbeats of one pipeline, until the coordinator hangs up.

        ``request`` is a ``SubscribeRequest``'s bytes (see ``jaxdist.core.transport.wire``)."""
        try:
            sub = self.open_subscription(request, "Subscribe", context.peer())
        except JaxdistError as exc:
            await context.abort(_failure(exc, context, "Subscribe"), str(exc))
            raise  # unreachable: abort raises
        try:
            async with contextlib.aclosing(self.events(sub)) as events:
                async for event in events:
                    yield event
        except JaxdistError as exc:  # dropped for not reading, or the key no longer opens it
            await context.abort(_failure(exc, context, "Subscribe"), str(exc))
        finally:
            self.streams.leave(sub.stream)

    def open_subscription(self, request: bytes, what: str, peer: str) -> OpenSubscription:
        """Check a ``SubscribeRequest`` (its bytes) of ``peer`` and count its stream (the caller
        gives it back: ``streams.leave(sub.host)``). Shared by gRPC's ``Subscribe`` and the
        data port's events connections (``data_listener.py``).

        Raises:
            CodecError: not a ``SubscribeRequest``. LimitError: ids too long, or too many
                streams from ``peer``. PipelineKeyError: the key does not open the pipeline.
        """
        sub = wire.parse_request(pb.SubscribeRequest, request)
        check_ids(what, self.config.max_id_bytes, pipeline_id=sub.pipeline_id,
                  reply_to=sub.reply_to)
        self.pipelines.check_key(what, sub.pipeline_id, sub.pipeline_key)
        keyed = bool(sub.pipeline_key)  # and check_key found it to be the pipeline's
        owner = self.stream_owner(peer, sub.pipeline_id if keyed else None)
        return OpenSubscription(sub, self.streams.enter(what, owner))

    async def events(self, opened: OpenSubscription) -> AsyncGenerator[pb.Event, None]:
        """The events of one subscription: a heartbeat at once (it is registered), then
        results, errors and heartbeats, until it ends.

        Raises:
            LimitError: the subscriber was dropped for not reading (``RESOURCE_EXHAUSTED``).
            PipelineKeyError: the pipeline was loaded by another coordinator since.
        """
        sub = opened.request
        q = self.hub.open(sub.pipeline_id, sub.reply_to)
        beat = asyncio.get_running_loop().create_task(self._heartbeats(q))
        try:
            yield pb.Event(heartbeat=time.monotonic() - self.started)
            while True:
                event = await q.get()
                if event is None:
                    if q.dropped is not None:  # it did not read: it hears why, once
                        raise LimitError(q.dropped)
                    return
                if not self.pipelines.opens(sub.pipeline_id, sub.pipeline_key):
                    # Subscribed before the pipeline was loaded, by another coordinator.
                    raise PipelineKeyError(
                        f"Subscribe: pipeline {clip(sub.pipeline_id, 64)!r} was loaded on "
                        f"worker {self.address} by another coordinator since this "
                        f"subscription began; its key is not the one this subscription "
                        f"presented")
                if event is HEARTBEAT:
                    event = pb.Event(heartbeat=time.monotonic() - self.started)
                yield event
        finally:
            beat.cancel()
            self.hub.close(sub.pipeline_id, sub.reply_to, q)

    @staticmethod
    async def _heartbeats(q: Subscription) -> None:
        """Queue a heartbeat every HEARTBEAT_S while the subscription has nothing to send."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if q.empty():
                q.put(HEARTBEAT)

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float = 30.0) -> bool:
        """Refuse new frames and wait for in-flight ones to leave. True when all finished.

        Health turns ``NOT_SERVING`` first, for good."""
        self.health.shutting_down()
        self._draining.set()
        deadline = time.monotonic() + timeout
        runtimes = self.pipelines.runtimes()
        return all(rt.drain(max(0.0, deadline - time.monotonic())) for rt in runtimes)

    def close(self) -> None:
        self._reaper_stop.set()
        self.loads.leave_all("the worker is stopping")  # first: none is loaded after this
        for rt in self.pipelines.clear():
            rt.stop()
        self.hub.shutdown()
        self.peers.close()
        self._compile_pool.shutdown(wait=False)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()
