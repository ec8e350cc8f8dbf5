"""The coordinator: deploy a model across workers.

:class:`Cluster` holds the workers. :meth:`Cluster.deploy` partitions a model into stages, exports
each (:func:`build_stage_specs`), ships the artifacts and loads the stages, and returns a running
:class:`~jaxdist.pipeline.Pipeline`. The running side (streaming, subscriptions, heartbeats,
sessions) lives in :mod:`jaxdist.pipeline`; ``Pipeline`` and ``Session`` are re-exported here.

Example:
    >>> with Cluster.local(2, weights_roots=[root]) as cluster:      # doctest: +SKIP
    ...     pipe = cluster.deploy(model)
    ...     out = pipe.call({"x": x})
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import jax

from jaxdist import artifacts
from jaxdist.errors import JaxdistError, SpecError, TransportError
from jaxdist.local import LocalWorker, spawn_workers, stop_workers
from jaxdist.model import Model, Unit
from jaxdist.partition import balanced_split, explicit_split
from jaxdist.pipeline import Pipeline, Session
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.spec import ShapeBucket, StageSpec, StateSig, TensorSig, Versions
from jaxdist.transport.client import WorkerClient

__all__ = ["Cluster", "Pipeline", "Session", "Progress", "build_stage_specs"]

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""``progress(what, done, total)``: called as deploy advances; the CLI draws a bar with it."""


def _no_progress(what: str, done: int, total: int) -> None:
    log.info("%s (%d/%d)", what, done, total)


# ---------------------------------------------------------------------------------------------
# Building stages


def _stage_fn(units: Sequence[Unit]) -> Callable[..., Any]:
    def stage(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        new_state: dict[str, Any] = {}
        for u in units:
            p = {k: params[f"{u.name}.{k}"] for k in u.params}
            s = {k: state[f"{u.name}.{k}"] for k in u.state}
            carry, ns = u.fn(p, s, dict(carry))
            missing = set(u.state) - set(ns)
            if missing:
                raise SpecError(f"unit {u.name!r} did not return new state for {sorted(missing)}")
            new_state.update({f"{u.name}.{k}": ns[k] for k in u.state})
        return carry, new_state

    stage.__name__ = f"stage_{units[0].name}_{units[-1].name}"
    return stage


@dataclass(frozen=True)
class BuiltStage:
    """An exported stage and its spec, not yet placed (no device, next hop or stage id)."""

    artifact: artifacts.Artifact
    spec: StageSpec


def build_stage_specs(model: Model, ranges: Sequence[range], *,
                      platforms: Sequence[str] = ("cpu", "cuda", "tpu"),
                      progress: Progress = _no_progress) -> list[BuiltStage]:
    """Export each stage of ``model`` (its units in ``ranges``) and describe it as a spec."""
    inputs: dict[str, tuple[str, str]] = dict(model.inputs)
    built = []
    for k, rng in enumerate(ranges):
        progress(f"export stage {k}", k, len(ranges))
        units = [model.units[i] for i in rng]
        params = {f"{u.name}.{n}": p for u in units for n, p in u.params.items()}
        state = {f"{u.name}.{n}": sd for u in units for n, sd in u.state.items()}
        art = artifacts.export_stage(
            _stage_fn(units),
            params={n: jax.ShapeDtypeStruct(tuple(p.shape), jax.numpy.dtype(p.ref(n).dtype))
                    for n, p in params.items()},
            state={n: jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype))
                   for n, (shape, dtype) in state.items()},
            inputs=inputs, platforms=platforms, symbolic_constraints=tuple(model.constraints))
        meta = art.meta
        symbols = {d for t in meta.inputs for d in t.dims if not d.isdigit()}
        buckets = []
        for b in model.buckets:
            dims = {s: int(v) for s, v in b.items() if s in symbols}
            if dims and ShapeBucket(dims) not in buckets:
                buckets.append(ShapeBucket(dims))
        spec = StageSpec(
            artifact_digest=art.digest,
            inputs=tuple(TensorSig(t.name, t.dtype, tuple(int(d) if d.isdigit() else d
                                                          for d in t.dims)) for t in meta.inputs),
            outputs=tuple(TensorSig(t.name, t.dtype, tuple(int(d) if d.isdigit() else d
                                                           for d in t.dims)) for t in meta.outputs),
            weights=tuple(p.ref(n) for n, p in params.items()),
            state=tuple(StateSig(n, jax.numpy.dtype(dt).name, tuple(sh))
                        for n, (sh, dt) in state.items()),
            stage_index=k, num_stages=len(ranges), buckets=tuple(buckets),
            platforms=meta.platforms, model=model.name,
            versions=Versions(jax=meta.jax_version, jaxlib=meta.jaxlib_version,
                              serialization_version=meta.serialization_version,
                              calling_convention_version=meta.calling_convention_version,
                              stablehlo=meta.stablehlo_version))
        built.append(BuiltStage(art, spec))
        inputs = {t.name: (", ".join(t.dims), t.dtype) for t in meta.outputs}
    progress("exported", len(ranges), len(ranges))
    return built


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
    """

    def __init__(self, addresses: Sequence[str], *, timeout: float = 10.0,
                 heartbeat_timeout: float = 5.0, metadata: tuple[tuple[str, str], ...] = (),
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        if not addresses:
            raise TransportError("a cluster needs at least one worker address")
        self.clients = [WorkerClient(a, timeout=timeout, metadata=metadata,
                                     credentials=credentials) for a in addresses]
        self.heartbeat_timeout = heartbeat_timeout
        self._local: list[LocalWorker] = []
        self._pipelines: list[Pipeline] = []

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.clients]

    @classmethod
    def connect(cls, addresses: Sequence[str] | str, *, wait: float = 10.0, **kwargs: Any
                ) -> Cluster:
        """Connect to running workers; checks each answers ``Info`` within ``wait`` seconds."""
        if isinstance(addresses, str):
            addresses = [a.strip() for a in addresses.split(",") if a.strip()]
        cluster = cls(addresses, **kwargs)
        try:
            for c in cluster.clients:
                c.wait_ready(wait)
                c.info()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @classmethod
    def local(cls, n: int, *, weights_roots: Sequence[str] = (), device: str = "cpu",
              **kwargs: Any) -> Cluster:
        """Spawn ``n`` worker processes on loopback; they stop when the cluster closes.

        Extra keyword arguments go to :func:`jaxdist.local.spawn_workers` (``artifact_cache``,
        ``compilation_cache``, ``max_sessions``, ``pin_cpus``, ``log_level``, ``env``) or to the
        constructor (``timeout``, ``heartbeat_timeout``).
        """
        ctor = {k: kwargs.pop(k) for k in ("timeout", "heartbeat_timeout") if k in kwargs}
        workers = spawn_workers(n, weights_roots=[str(r) for r in weights_roots], device=device,
                                **kwargs)
        try:
            cluster = cls([w.address for w in workers], **ctor)
        except BaseException:
            stop_workers(workers)
            raise
        cluster._local = workers
        return cluster

    @property
    def local_workers(self) -> list[LocalWorker]:
        return list(self._local)

    def info(self) -> list[pb.InfoReply]:
        return [c.info() for c in self.clients]

    def deploy(self, model: Model, *, stages: int | None = None,
               split: Sequence[int] | None = None, workers: Sequence[str] | None = None,
               platforms: Sequence[str] = ("cpu", "cuda", "tpu"), device: str = "auto",
               capacities: Sequence[float] | None = None,
               progress: Progress | None = None) -> Pipeline:
        """Partition, export, ship and load a model; return a running pipeline.

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
        progress = progress or _no_progress
        order = list(workers) if workers else self.addresses
        clients = {c.address: c for c in self.clients}
        unknown = [a for a in order if a not in clients]
        if unknown:
            raise TransportError(f"workers {unknown} are not in this cluster ({self.addresses})")
        n_units = len(model.units)
        if split is not None:
            ranges = explicit_split(n_units, split)
        else:
            n = stages or min(len(order), n_units)
            costs = [u.weight_bytes + u.state_bytes + 1 for u in model.units]
            ranges = balanced_split(costs, n, capacities)
        built = build_stage_specs(model, ranges, platforms=platforms, progress=progress)
        pipeline_id = f"{model.name or 'model'}-{uuid.uuid4().hex[:8]}"
        placed = [order[k % len(order)] for k in range(len(built))]
        specs = []
        for k, b in enumerate(built):
            specs.append(b.spec.replace(
                device=device, stage_id=f"{pipeline_id}/{k}",
                next_hop=placed[k + 1] if k + 1 < len(built) else ""))
        done = itertools.count(1)
        total = len(specs)
        lock = threading.Lock()

        def ship(k: int) -> pb.LoadStageReply:
            client, art = clients[placed[k]], built[k].artifact
            if not client.has_artifact(art.digest):
                client.upload_artifact(art.digest, art.data)
            reply = client.load_stage(specs[k], pipeline_id)
            with lock:
                progress(f"stage {k} loaded on {placed[k]} ({reply.weight_bytes / 1e6:.1f} MB, "
                         f"compile {reply.compile_s:.1f}s)", next(done), total)
            return reply

        progress("shipping stages", 0, total)
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, total)) as pool:
            futures = [pool.submit(ship, k) for k in range(total)]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            for k in range(total):
                if errors[k] is None:
                    try:
                        clients[placed[k]].unload_stage(specs[k].stage_id)
                    except JaxdistError:
                        pass
            raise first
        pipe = Pipeline(self, pipeline_id, specs, [clients[a] for a in placed],
                        heartbeat_timeout=self.heartbeat_timeout, model=model)
        self._pipelines.append(pipe)
        return pipe

    def close(self) -> None:
        for p in self._pipelines:
            p.close(unload=False)
        self._pipelines.clear()
        for c in self.clients:
            c.close()
        if self._local:
            stop_workers(self._local)
            self._local = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
