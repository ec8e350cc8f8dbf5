"""The coordinator: deploy a model across workers.

:class:`Cluster` holds the workers. :meth:`Cluster.deploy` partitions a model into stages, exports
each (:func:`jaxdist.export.stages.build_stage_specs`), ships the artifacts and loads the stages, and returns a running
:class:`~jaxdist.coordinator.pipeline.Pipeline`. :meth:`Cluster.deploy_manifest` does the same from a model
exported earlier into a registry (:mod:`jaxdist.registry.manifest`), with no tracing. The running side
(streaming, subscriptions, heartbeats, sessions) lives in :mod:`jaxdist.coordinator.pipeline`; ``Pipeline``
and ``Session`` are re-exported here.

Example:
    >>> with Cluster.local(2, weights_roots=[root]) as cluster:      # doctest: +SKIP
    ...     pipe = cluster.deploy(model)
    ...     out = pipe.call({"x": x})
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from jaxdist.coordinator.datapath import DataAuth, data_auth
from jaxdist.coordinator.loading import LoadInterrupted, load_stages, new_pipeline_key
from jaxdist.coordinator.pipeline import Pipeline, Session
from jaxdist.coordinator.spawn import LocalWorker, spawn_workers, stop_workers
from jaxdist.core import codec, kernels
from jaxdist.core.defaults import HEARTBEAT_TIMEOUT_S, LEASE_S
from jaxdist.core.errors import ArtifactError, JaxdistError, SpecError, TransportError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.dataconn import data_address
from jaxdist.core.transport.security import ClientAuth, client_auth
from jaxdist.export.model import Model
from jaxdist.export.stages import (
    BuiltStage,
    Progress,
    build_stage_specs,
    log_progress,
    plan_stages,
)
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.registry.local import open_registry
from jaxdist.registry.manifest import Manifest, open_manifest

if TYPE_CHECKING:  # Ray is optional: jaxdist.launch.ray is imported by Cluster.ray
    from jaxdist.launch.ray import RayWorker, RayWorkers

__all__ = ["Cluster", "LoadInterrupted", "Pipeline", "Session", "StageLoad"]

log = logging.getLogger(__name__)


class _ExportInterrupted(LoadInterrupted):
    """Raised in a thread that exports by :meth:`Cluster.interrupt` (made without arguments)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("interrupted while exporting",)))


@dataclass(frozen=True)
class StageLoad:
    """How one stage got onto its worker (:meth:`Cluster.stage_loads`)."""

    stage: int
    address: str
    digest: str
    uploaded: bool          # the worker lacked the artifact, so it was uploaded
    already_loaded: bool    # the worker had this exact stage loaded already
    bind_s: float           # weights resolved, laid out and put on the device
    compile_s: float        # every shape bucket compiled (or fetched from the XLA cache)
    weight_bytes: int
    route: str = "grpc"     # how its frames leave: "tcp" (the next worker's data port), "grpc"
    load_s: float = 0.0     # artifact read and vetted, spec checked


# ---------------------------------------------------------------------------------------------
# The cluster


class Cluster:
    """A set of workers a coordinator can deploy to.

    Args:
        addresses: ``HOST:PORT`` of each worker.
        timeout: deadline of quick control calls, seconds.
        heartbeat_timeout: a worker silent for this long is declared frozen or gone.
        metadata: call metadata sent with every call (e.g. a bearer token).
        credentials: TLS channel credentials.
        insecure_token: allow the token in ``metadata`` to go in plaintext to workers whose
            address is not loopback (the CLI's ``--insecure-token``); without it, and without
            ``credentials``, such a worker is refused with an ``AuthError`` naming its address.
        spares: ``HOST:PORT`` of spare workers. They get no stage at deploy; when a worker of a
            pipeline dies, :meth:`Pipeline.recover` moves its stages to a spare.
        lease_s: the stages this cluster loads are leased for this long: a worker unloads them
            once nobody has subscribed to their pipeline there for that long (this coordinator
            died). 0: pinned. ``deploy_manifest(..., pin=True)`` pins one deploy.
        auth: the token and TLS files as read by
            :func:`jaxdist.core.transport.security.client_auth`, in place of ``metadata`` and
            ``credentials``: with TLS, the pipelines then also reach the workers' data ports
            (which gRPC credentials alone do not open).
        data_path: ``"tcp"`` (default): a pipeline's frames and events go over the workers'
            data ports where they have one (:mod:`jaxdist.coordinator.datapath`); ``"grpc"``:
            over gRPC ``Push`` and ``Subscribe`` streams.

    Example:
        >>> with Cluster.local(2, weights_roots=["/srv/models"]) as cluster:  # doctest: +SKIP
        ...     pipe = cluster.deploy(model)  # one stage per worker, balanced by weight bytes
        ...     y = pipe.call(x=x)["x"]
        >>> cluster = Cluster.connect("h1:50051,h2:50051", spares=["h3:50051"])  # doctest: +SKIP
    """

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, metadata: tuple[tuple[str, str], ...] = (),
                 credentials: grpc.ChannelCredentials | None = None,
                 spares: Sequence[str] = (), lease_s: float = LEASE_S,
                 insecure_token: bool = False, auth: ClientAuth | None = None,
                 data_path: str = "tcp") -> None:
        if not addresses:
            raise TransportError("a cluster needs at least one worker address")
        if data_path not in ("tcp", "grpc"):
            raise TransportError(f"data_path={data_path!r}: expected 'tcp' or 'grpc'")
        if auth is not None:
            metadata, credentials = auth.metadata, auth.credentials
        self.data_auth: DataAuth | None = None
        self.data_auth_why = "the cluster was made with data_path='grpc'"
        if data_path == "tcp":
            self.data_auth, self.data_auth_why = data_auth(
                metadata=metadata, tls=credentials is not None, auth=auth)
        both = sorted(set(addresses) & set(spares))
        if both:
            raise TransportError(f"workers {both} are given both as workers and as spares")
        self._client_args: dict[str, Any] = {"timeout": timeout, "metadata": metadata,
                                             "credentials": credentials,
                                             "insecure_token": insecure_token}
        self.clients = [WorkerClient(a, **self._client_args) for a in addresses]
        self.spare_clients = [WorkerClient(a, **self._client_args) for a in spares]
        self._spare_lock = threading.Lock()
        self.heartbeat_timeout = heartbeat_timeout
        self.lease_s = lease_s
        self._local: list[LocalWorker] = []
        self._ray: RayWorkers | None = None  # workers started as Ray actors (Cluster.ray)
        self._pipelines: list[Pipeline] = []
        self._loads: dict[str, list[StageLoad]] = {}
        self._interrupted = threading.Event()  # set by interrupt(): no stage loads any more
        self._exporting: set[int] = set()  # threads tracing in deploy(), which interrupt() stops
        self._exporting_lock = threading.Lock()

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.clients]

    @property
    def spares(self) -> list[str]:
        """Spare workers not yet used by a failover."""
        return [c.address for c in self.spare_clients]

    @classmethod
    def connect(cls, addresses: Sequence[str] | str, *, wait: float = 10.0, **kwargs: Any
                ) -> Cluster:
        """Connect to running workers; checks each answers ``Info`` within ``wait`` seconds."""
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        cluster = cls(addresses, **kwargs)
        try:
            for c in cluster.clients + cluster.spare_clients:
                c.wait_ready(wait)
                c.info()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @classmethod
    def local(cls, n: int, *, weights_roots: Sequence[str] = (), device: str = "auto",
              gpu_memory_fraction: float | None = None, spares: int = 0, **kwargs: Any
              ) -> Cluster:
        """Spawn ``n`` worker processes on loopback; they stop when the cluster closes.

        ``spares`` more workers are spawned as spares (see the constructor).

        ``device`` is every worker's directive: ``auto`` (a TPU, a CUDA or ROCm GPU, else the
        cpu; so the cpu on a machine without accelerators), ``cpu``, ``cuda[:N]``,
        ``rocm[:N]``, ``tpu[:N]``. One this machine cannot honour is refused before any
        worker starts, naming the devices present. Workers on one GPU share it, each
        allocating what it needs; ``gpu_memory_fraction=F`` makes each preallocate that
        fraction of the GPU's memory instead (:func:`jaxdist.coordinator.spawn.spawn_workers`).

        Extra keyword arguments go to :func:`jaxdist.coordinator.spawn.spawn_workers` (``artifact_cache``,
        ``compilation_cache``, ``max_sessions``, ``pin_cpus``, ``log_level``, ``env``) or to the
        constructor (``timeout``, ``heartbeat_timeout``). The workers' ``token_file``,
        ``tls_cert``, ``tls_key`` and ``tls_ca`` are also the cluster's own credentials.

        Raises:
            DeviceError: ``device`` or ``gpu_memory_fraction`` is refused.
            TransportError: a worker did not start.
        """
        ctor: dict[str, Any] = {k: kwargs.pop(k) for k in ("timeout", "heartbeat_timeout",
                                                           "lease_s", "insecure_token",
                                                           "data_path")
                                if k in kwargs}
        auth = client_auth(**{k: kwargs[k] for k in ("token_file", "tls_cert", "tls_key",
                                                       "tls_ca") if kwargs.get(k)})
        ctor.update(auth=auth)
        workers = spawn_workers(n + spares, weights_roots=[str(r) for r in weights_roots],
                                device=device, gpu_memory_fraction=gpu_memory_fraction,
                                **kwargs)
        try:
            cluster = cls([w.address for w in workers[:n]],
                          spares=[w.address for w in workers[n:]], **ctor)
        except BaseException:
            stop_workers(workers)
            raise
        cluster._local = workers
        return cluster

    @property
    def local_workers(self) -> list[LocalWorker]:
        return list(self._local)

    @classmethod
    def ray(cls, n: int, *, resources: Mapping[str, float] | None = None, spares: int = 0,
            strategy: str = "PACK", address: str | None = None, **kwargs: Any) -> Cluster:
        """Start ``n`` workers as Ray actors (and ``spares`` more as spares), one per bundle
        of one placement group; they stop, and the group is removed, when the cluster closes.

        Each actor runs the normal worker as its child and dies with it; a killed actor is a
        dead worker, which :meth:`Pipeline.recover` replaces with a spare. Ray is imported
        here (``pip install 'jaxdist[ray]'``) and initialized with ``address`` unless it is
        already (:func:`jaxdist.launch.ray.start_workers` says how).

        Args:
            n: workers that get stages.
            resources: one worker's bundle, e.g. ``{"GPU": 1}``, ``{"TPU": 1}``, ``{"CPU": 2}``
                (default ``{"CPU": 1}``). A GPU worker sees its GPU as ``cuda:0``.
            spares: more workers, started alike, held as spares.
            strategy: ``"PACK"`` or ``"STRICT_SPREAD"`` (one node per worker), or Ray's
                ``"SPREAD"`` / ``"STRICT_PACK"``.
            address: the Ray cluster (``"auto"``, ``HOST:PORT``); ``None``: the local one.

        Extra keyword arguments go to :func:`jaxdist.launch.ray.start_workers`
        (``weights_roots``, ``device``, ``placement_timeout``, ``loopback``,
        ``artifact_cache``, ``compilation_cache``, ``max_sessions``, ``log_level``, ``env``,
        ...) or to the constructor (``timeout``, ``heartbeat_timeout``). The workers'
        ``token_file``, ``tls_cert``, ``tls_key`` and ``tls_ca`` are also the cluster's own
        credentials.

        Raises:
            JaxdistError: Ray is not installed.
            TransportError: the placement group cannot be placed (the message names the
                resources asked for and what the Ray cluster has), or a worker did not start.

        Example:
            >>> with Cluster.ray(4, resources={"GPU": 1}, spares=1,  # doctest: +SKIP
            ...                  strategy="STRICT_SPREAD", address="auto") as cluster:
            ...     pipe = cluster.deploy(model)
        """
        from jaxdist.launch.ray import start_workers  # Ray is optional: imported here

        if spares < 0:
            raise TransportError(f"spares={spares}: expected a number of spare workers >= 0")
        ctor: dict[str, Any] = {k: kwargs.pop(k) for k in ("timeout", "heartbeat_timeout",
                                                           "lease_s", "insecure_token",
                                                           "data_path")
                                if k in kwargs}
        auth = client_auth(**{k: kwargs[k] for k in ("token_file", "tls_cert", "tls_key",
                                                       "tls_ca") if kwargs.get(k)})
        ctor.update(auth=auth)
        group = start_workers(n + spares, resources=resources, strategy=strategy,
                              address=address, **kwargs)
        try:
            cluster = cls(group.addresses[:n], spares=group.addresses[n:], **ctor)
        except BaseException:
            group.close()
            raise
        cluster._ray = group
        return cluster

    @property
    def ray_workers(self) -> list[RayWorker]:
        """The workers :meth:`ray` started, spares included, in the order it started them."""
        return list(self._ray.workers) if self._ray is not None else []

    def info(self) -> list[pb.InfoReply]:
        return [c.info() for c in self.clients]

    def deploy(self, model: Model | Manifest, *, stages: int | None = None,
               split: Sequence[int] | None = None, workers: Sequence[str] | None = None,
               platforms: Sequence[str] = ("cpu", "cuda", "tpu"), device: str = "auto",
               capacities: Sequence[float] | None = None,
               progress: Progress | None = None, **manifest_options: Any) -> Pipeline:
        """Partition, export, ship and load a model; return a running pipeline.

        Given a :class:`~jaxdist.registry.manifest.Manifest` instead of a model, this is
        :meth:`deploy_manifest` (no tracing); pass its ``registry`` and ``model_path`` here.

        Args:
            model: the units and input signature.
            stages: number of stages (default: one per worker, at most one per unit).
            split: explicit unit counts per stage, e.g. ``[3, 2]``; overrides ``stages``.
            workers: addresses to place stages on, in order (default: the cluster's). Stage k
                lands on ``workers[k % len(workers)]``.
            platforms: platforms to export for.
            device: the device directive every stage carries.
            capacities: relative capacity of each stage's worker for balancing (e.g. memory).
            progress: ``progress(what, done, total)`` callback.

        Raises:
            SpecError: impossible split. Typed errors of the workers (WeightError, DeviceError,
                ArtifactError, ...) name the worker that raised them.
        """
        if isinstance(model, Manifest):
            if stages is not None or split is not None or capacities is not None:
                raise SpecError(f"manifest of {model.model.name!r} is partitioned already "
                                f"({len(model.stages)} stages); stages, split and capacities "
                                f"apply when exporting (jaxdist export --stages)")
            return self.deploy_manifest(model, workers=workers, device=device,
                                        progress=progress, **manifest_options)
        if manifest_options:
            raise SpecError(f"deploy of a Model takes no {sorted(manifest_options)}; those "
                            f"options are for a Manifest")
        progress = progress or log_progress
        order = self._order(workers)
        ranges = plan_stages(model, stages=stages or min(len(order), len(model.units)),
                             split=split, capacities=capacities)
        unpack = self._check_placement(model, ranges, order)
        built = self._export(model, ranges, platforms, progress, unpack)
        by_digest = {b.artifact.digest: b.artifact.data for b in built}
        pipeline_id = f"{model.name or 'model'}-{uuid.uuid4().hex[:8]}"
        return self._ship(pipeline_id, [b.spec for b in built], order, device,
                          by_digest.__getitem__, progress, model=model)

    def _export(self, model: Model, ranges: Sequence[range], platforms: Sequence[str],
                progress: Progress, unpack: Sequence[bool]) -> list[BuiltStage]:
        """:func:`~jaxdist.export.stages.build_stage_specs`, stopped by Ctrl-C or
        :meth:`interrupt` with a :class:`LoadInterrupted` that names the stage."""
        stage = "the model"

        def seen(what: str, done: int, total: int) -> None:
            nonlocal stage
            if what.startswith("export "):
                stage = what.removeprefix("export ")
            progress(what, done, total)

        if self._interrupted.is_set():
            raise LoadInterrupted("interrupted before exporting")
        me = threading.get_ident()
        with self._exporting_lock:
            self._exporting.add(me)
        try:
            return build_stage_specs(model, ranges, platforms=platforms, progress=seen,
                                     unpack=unpack)
        except KeyboardInterrupt:
            raise LoadInterrupted(f"interrupted while exporting {stage}") from None
        finally:
            with self._exporting_lock:
                self._exporting.discard(me)

    def deploy_manifest(self, manifest: Manifest | str, *, registry: Any = None,
                        model_path: str | None = None, workers: Sequence[str] | None = None,
                        device: str = "auto", progress: Progress | None = None,
                        pin: bool = False) -> Pipeline:
        """Deploy an exported model from its manifest and registry; nothing is traced.

        Digest first: each artifact is fetched from the registry (and checked) and uploaded
        only to workers that lack it, so a warm worker costs one ``HasArtifact`` per stage.

        Args:
            manifest: a :class:`~jaxdist.registry.manifest.Manifest`, or a reference
                :func:`~jaxdist.registry.manifest.open_manifest` understands (path, URL, or a name or
                digest in ``registry``).
            registry: where the artifacts are: a registry object, a directory or a URL.
                Default: the registry the manifest was read from.
            model_path: where the workers hold the model (relative to a weights root, or
                absolute); substitutes ``{model}`` in the weight URIs. Default: the path the
                manifest recorded at export.
            workers: addresses to place stages on, in order; stage k lands on
                ``workers[k % len(workers)]``.
            device: the device directive every stage carries.
            pin: keep the stages loaded until they are unloaded (``jaxdist deploy``). By
                default they are leased (:data:`~jaxdist.core.defaults.LEASE_S`): the workers
                unload them once this coordinator has been gone that long.
            progress: ``progress(what, done, total)`` callback.

        Returns:
            The running :class:`~jaxdist.coordinator.pipeline.Pipeline`; its stages stay loaded until it is
            closed with ``unload=True`` (``Cluster.close`` leaves them loaded).

        Raises:
            SpecError: malformed manifest, or a model path it cannot take.
            ArtifactError: an artifact is missing from the registry or corrupt there, or a
                worker refuses it (version window, platform, custom call).

        Example:
            >>> pipe = cluster.deploy_manifest(  # doctest: +SKIP
            ...     "reg/manifests/mlp-ab12...json", model_path="models/mlp.safetensors")
        """
        progress = progress or log_progress
        store = open_registry(registry) if isinstance(registry, (str, os.PathLike)) else registry
        if not isinstance(manifest, Manifest):
            manifest, _, found = open_manifest(str(manifest), store)
            store = store or found
        specs = manifest.stage_specs(model_path)
        fetched: dict[str, bytes] = {}
        fetch_lock = threading.Lock()

        def fetch(digest: str) -> bytes:
            if store is None:
                raise ArtifactError(
                    f"artifact {digest} is not on the worker, and no registry was given to fetch "
                    f"it from; pass registry= (--registry DIR|URL)")
            with fetch_lock:  # one fetch per digest, however many workers need it
                if digest not in fetched:
                    fetched[digest] = store.get(digest)
                return fetched[digest]

        name = manifest.model.name or "model"
        pipeline_id = f"{name}-{uuid.uuid4().hex[:8]}"
        return self._ship(pipeline_id, specs, self._order(workers), device, fetch, progress,
                          lease_s=0.0 if pin else self.lease_s)

    def attach(self, pipeline_id: str, manifest: Manifest | None = None,
               model_path: str | None = None) -> Pipeline:
        """A :class:`Pipeline` for stages already loaded on the workers (e.g. by ``jaxdist
        deploy``), found through ``Info``. With a manifest, the stages' digests are checked
        against it and the pipeline carries its specs.

        Raises:
            SpecError: the pipeline is not loaded, has missing stages, or runs other artifacts
                than the manifest's.
        """
        found: dict[int, tuple[WorkerClient, str]] = {}
        for c in self.clients:
            for st in c.info().stages:
                if st.pipeline_id == pipeline_id:
                    found[st.stage_index] = (c, st.artifact_digest)
        if not found:
            raise SpecError(f"pipeline {pipeline_id!r} is not loaded on any of "
                            f"{self.addresses} (jaxdist status lists what is)")
        n = max(found) + 1
        missing = [k for k in range(n) if k not in found]
        if missing or (manifest is not None and len(manifest.stages) != n):
            raise SpecError(f"pipeline {pipeline_id!r}: stages {missing or list(range(n))} are "
                            f"loaded on {self.addresses}, which does not make a whole pipeline"
                            + (f" of the manifest's {len(manifest.stages)}" if manifest else ""))
        specs: list[StageSpec] = []
        if manifest is not None:
            for k, spec in enumerate(manifest.stage_specs(model_path)):
                if spec.artifact_digest != found[k][1]:
                    raise SpecError(f"pipeline {pipeline_id!r} stage {k} runs "
                                    f"{found[k][1][:19]}.., the manifest says "
                                    f"{spec.artifact_digest[:19]}..")
                specs.append(spec.replace(stage_id=f"{pipeline_id}/{k}"))
        pipe = Pipeline(self, pipeline_id, specs, [found[k][0] for k in range(n)],
                        heartbeat_timeout=self.heartbeat_timeout)
        self._pipelines.append(pipe)
        return pipe

    def _check_placement(self, model: Model, ranges: Sequence[range], order: Sequence[str]
                         ) -> list[bool]:
        """Per stage: whether its packed weights must be bound dequantized, because its CPU
        worker advertises no kernels (logged). Refuses bfloat16/float16 weights on a CPU
        worker, which would run several times slower than float32.

        Raises:
            SpecError: a half-precision stage placed on a CPU worker.
        """
        infos = {a: c.info() for a, c in ((a, self._client(a)) for a in dict.fromkeys(order))}
        unpack = []
        for k, rng in enumerate(ranges):
            address = order[k % len(order)]
            info = infos[address]
            platform = info.default_device.partition(":")[0]
            params = [p for i in rng for p in model.units[i].params.values()]
            if platform != "cpu":
                unpack.append(False)
                continue
            slow = sorted({p.dtype for p in params if not p.packed
                           and codec.canonical_dtype(p.dtype) in ("bfloat16", "float16")})
            if slow:
                raise SpecError(
                    f"stage {k} of {model.name!r} binds {'/'.join(slow)} weights on CPU worker "
                    f"{address}: XLA:CPU has no fast half-precision matmul, so it would run "
                    f"several times slower than float32. Use dtype float32 (the default); a "
                    f"quantized GGUF keeps its blocks as stored either way")
            missing = sorted(kernels.OWN_TARGETS - set(info.kernels.targets))
            packed = [p for p in params if p.packed]
            if packed and missing:
                log.warning("worker %s advertises no CPU kernels (%s): stage %d binds its %d "
                            "quantized weights dequantized to float32",
                            address, info.kernels.unavailable_reason or "other ABI", k,
                            len(packed))
            unpack.append(bool(packed and missing))
        return unpack

    def _client(self, address: str) -> WorkerClient:
        return next(c for c in self.clients if c.address == address)

    def _order(self, workers: Sequence[str] | None) -> list[str]:
        order = list(workers) if workers else self.addresses
        unknown = [a for a in order if a not in self.addresses]
        if unknown:
            raise TransportError(f"workers {unknown} are not in this cluster ({self.addresses})")
        return order

    def _ship(self, pipeline_id: str, built: Sequence[StageSpec], order: Sequence[str],
              device: str, fetch: Callable[[str], bytes], progress: Progress, *,
              model: Model | None = None, lease_s: float | None = None) -> Pipeline:
        """Place specs, load every stage (see :meth:`load_stages`), start the pipeline."""
        clients = {c.address: c for c in self.clients}
        placed = [clients[order[k % len(order)]] for k in range(len(built))]
        specs = [spec.replace(device=device, stage_id=f"{pipeline_id}/{k}")
                 for k, spec in enumerate(built)]
        lease_s = self.lease_s if lease_s is None else lease_s
        # Pinned stages are shared (jaxdist deploy: any holder of the token attaches to them);
        # others are this coordinator's alone.
        key = b"" if lease_s == 0 else new_pipeline_key()
        specs = self.load_stages(pipeline_id, specs, placed, fetch, progress, lease_s=lease_s,
                                 key=key)
        pipe = Pipeline(self, pipeline_id, specs, placed,
                        heartbeat_timeout=self.heartbeat_timeout, model=model, fetch=fetch,
                        lease_s=lease_s, key=key)
        self._pipelines.append(pipe)
        return pipe

    def load_stages(self, pipeline_id: str, specs: Sequence[StageSpec],
                    placed: Sequence[WorkerClient], fetch: Callable[[str], bytes] | None,
                    progress: Progress | None = None, *, lease_s: float | None = None,
                    key: bytes = b"") -> list[StageSpec]:
        """Load stage k on ``placed[k]``, linked to the next stage's worker; all in parallel.

        Digest first: an artifact is fetched and uploaded only to a worker that lacks it. While
        the stages load, ``progress`` shows each one's live phase (uploading, loading,
        compiling, binding weights: :mod:`jaxdist.coordinator.loading`). When one stage fails,
        or on Ctrl-C or :meth:`interrupt`, the other calls are cancelled and the stages loaded
        by this call are unloaded again. ``key`` is the pipeline's key (empty: shared).

        Returns:
            The specs as loaded (their ``next_hop`` set).

        Raises:
            LoadInterrupted: Ctrl-C or :meth:`interrupt`; names what was under way.
            ArtifactError: the worker refused an artifact, or it is missing and ``fetch`` is
                ``None``. Other typed errors of the workers name the worker.
        """
        progress = progress or log_progress
        specs = [spec.replace(next_hop=placed[k + 1].address if k + 1 < len(specs) else "",
                              next_data_hop=self._data_hop(k, placed[k + 1])
                              if k + 1 < len(specs) else "")
                 for k, spec in enumerate(specs)]
        shipped = load_stages(pipeline_id, specs, placed, fetch, progress, self._interrupted,
                              self.lease_s if lease_s is None else lease_s, key)
        self._loads[pipeline_id] = [
            StageLoad(k, placed[k].address, specs[k].artifact_digest, s.uploaded,
                      s.reply.already_loaded, s.reply.bind_s, s.reply.compile_s,
                      s.reply.weight_bytes, "tcp" if specs[k].next_data_hop else "grpc",
                      s.reply.load_s)
            for k, s in enumerate(shipped)]
        return specs

    @staticmethod
    def _data_hop(stage: int, nxt: WorkerClient) -> str:
        """Where stage ``stage`` sends its frames: the data port of the next stage's worker
        ``nxt`` (``HOST:PORT`` on the host this coordinator dials it at), or ``""`` (logged)
        when it has none: then over gRPC, a slower hop."""
        port = nxt.info().data_port
        if port:
            return data_address(nxt.address, port)
        log.warning("stage %d sends to stage %d over gRPC: worker %s has no data port (started "
                    "with --data-listen off); a gRPC hop costs more per frame (docs/design.md, "
                    "'The data path')", stage, stage + 1, nxt.address)
        return ""

    def answers(self, client: WorkerClient, timeout: float) -> bool:
        """Whether a worker answers ``Info`` within ``timeout`` seconds."""
        try:
            client.info(timeout=timeout)
            return True
        except JaxdistError:
            return False

    def add_spare(self, address: str, *, wait: float = 10.0) -> None:
        """Hold one more running worker as a spare (a restarted one, say): it gets stages when
        a pipeline fails over. It must answer ``Info`` within ``wait`` seconds.

        Raises:
            TransportError: the address is a worker or spare already, or it does not answer.
        """
        with self._spare_lock:
            if address in self.addresses or address in self.spares:
                raise TransportError(f"worker {address} is in the cluster already")
        client = WorkerClient(address, **self._client_args)
        try:
            client.wait_ready(wait)
            client.info()
        except BaseException:
            client.close()
            raise
        with self._spare_lock:
            self.spare_clients.append(client)

    def take_spare(self, failed: str, timeout: float = 5.0) -> WorkerClient:
        """Put the first spare that answers in place of the worker ``failed``.

        Raises:
            TransportError: no spare left that answers.
        """
        with self._spare_lock:
            tried = []
            while self.spare_clients:
                spare = self.spare_clients.pop(0)
                if self.answers(spare, timeout):
                    self.clients = [spare if c.address == failed else c for c in self.clients]
                    return spare
                tried.append(spare.address)
                spare.close()
            raise TransportError(
                f"worker {failed} is dead and no spare worker is left to take its stages"
                + (f" (spares {tried} did not answer)" if tried else
                   " (give the cluster spares=[...] to fail over)"))

    def retire(self, client: WorkerClient) -> None:
        """Close the client of a worker a failover replaced (:meth:`take_spare`), once no
        pipeline of this cluster and no place in :attr:`clients` or :attr:`spare_clients` holds
        it: its channel would otherwise keep a socket and try to reconnect for as long as the
        coordinator runs."""
        with self._spare_lock:
            used = [*self.clients, *self.spare_clients,
                    *(c for p in self._pipelines for c in p.clients)]
            if any(c is client for c in used):
                return
        client.close()
        gone = [w for w in self._local if w.address == client.address and not w.alive()]
        if gone:  # a local worker that died: reap it, and close its pipes
            stop_workers(gone)
            self._local = [w for w in self._local if w not in gone]

    def interrupt(self) -> None:
        """Stop loading stages, from any thread (``jaxdist serve`` on SIGINT): a
        :meth:`load_stages` under way (a deploy, a failover) cancels its calls, unloads what
        it loaded and raises :class:`LoadInterrupted`, and so does every later one. An export
        under way in :meth:`deploy` stops too, within a stage, with a :class:`LoadInterrupted`
        in the thread that exports. Running pipelines are not touched."""
        self._interrupted.set()
        # Tracing is Python in the deploying thread, and only the main thread gets Ctrl-C: the
        # exception is raised in that thread at its next bytecode, as Ctrl-C would be. Each
        # thread gets it once (it leaves the set here), so none is interrupted a second time
        # after its export ended. Under the lock: a thread in the set has not yet left
        # _export's `finally` (which takes the lock), so the exception lands inside _export.
        with self._exporting_lock:
            threads, self._exporting = self._exporting - {threading.get_ident()}, set()
            for thread in threads:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                           ctypes.py_object(_ExportInterrupted))

    def stage_loads(self, pipeline_id: str) -> list[StageLoad]:
        """How each stage of a pipeline this cluster deployed was loaded (upload, bind, compile).

        Raises:
            SpecError: this cluster did not deploy ``pipeline_id``.
        """
        if pipeline_id not in self._loads:
            raise SpecError(f"pipeline {pipeline_id!r} was not deployed by this cluster")
        return list(self._loads[pipeline_id])

    def close(self) -> None:
        for p in self._pipelines:
            p.close(unload=False)
        self._pipelines.clear()
        for c in self.clients + self.spare_clients:
            c.close()
        if self._local:
            stop_workers(self._local)
            self._local = []
        if self._ray is not None:
            self._ray.close()
            self._ray = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
