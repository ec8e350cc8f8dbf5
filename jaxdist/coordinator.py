"""The coordinator: deploy a model across workers and run it.

The coordinator only dials out. It streams frames to stage 0 over one long-lived ``Push`` stream
and holds one ``Subscribe`` stream per worker of the pipeline. Results come straight from the last
stage on its subscription; an error in any stage comes from that stage's worker on its own
subscription, with the stage index, the address and the remote traceback. Heartbeats on every
subscription tell a frozen worker from a slow one, and a broken subscription names a dead worker
within seconds.

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
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import jax
import numpy as np

from jaxdist import artifacts
from jaxdist.errors import JaxdistError, RemoteStageError, SpecError, TransportError
from jaxdist.local import LocalWorker, spawn_workers, stop_workers
from jaxdist.model import Model, Unit
from jaxdist.partition import balanced_split, explicit_split
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.spec import ShapeBucket, StageSpec, StateSig, TensorSig, Versions
from jaxdist.transport.client import WorkerClient
from jaxdist.transport.frames import FrameAssembler, FrameHeader, split_frame

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


# ---------------------------------------------------------------------------------------------
# A running pipeline


@dataclass
class _Pending:
    future: concurrent.futures.Future[dict[str, np.ndarray]]
    session_id: str
    step: int


class Pipeline:
    """A deployed model: submit inputs, get outputs. Thread-safe.

    Created by :meth:`Cluster.deploy`. For stateful models use :meth:`session`.
    """

    def __init__(self, cluster: Cluster, pipeline_id: str, specs: Sequence[StageSpec],
                 clients: Sequence[WorkerClient], *, heartbeat_timeout: float = 5.0,
                 model: Model | None = None) -> None:
        self.cluster = cluster
        self.pipeline_id = pipeline_id
        self.specs = list(specs)
        self.clients = list(clients)
        self.model = model
        self.reply_to = uuid.uuid4().hex
        self.heartbeat_timeout = heartbeat_timeout
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._broken: JaxdistError | None = None
        self._closed = False
        self._stage_of = {}
        for k, c in enumerate(self.clients):
            self._stage_of.setdefault(c.address, []).append(k)
        self._unique = list({c.address: c for c in self.clients}.values())
        self._last_seen = {c.address: time.monotonic() for c in self._unique}
        self._subs = []
        self._threads = []
        for c in self._unique:
            call = c.subscribe(pipeline_id, self.reply_to)
            self._subs.append(call)
            t = threading.Thread(target=self._listen, args=(c.address, call),
                                 name=f"sub-{c.address}", daemon=True)
            t.start()
            self._threads.append(t)
        self._sender = self.clients[0].sender(on_error=lambda e: self._fail_worker(
            self.clients[0].address, str(e)))
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()

    # -- receiving --------------------------------------------------------------------------

    def _listen(self, address: str, call: Any) -> None:
        asm = FrameAssembler()
        try:
            for event in call:
                self._last_seen[address] = time.monotonic()
                kind = event.WhichOneof("kind")
                if kind == "result":
                    done = asm.add(event.result)
                    if done is not None:
                        header, tensors = done
                        self._resolve(header.request_id, tensors)
                elif kind == "error":
                    e = event.error
                    self._reject(event.request_id, RemoteStageError(
                        e.message, stage=e.stage, address=e.address or address,
                        remote_type=e.type, remote_traceback=e.traceback))
        except grpc.RpcError as exc:
            if self._closed:
                return
            self._fail_worker(address, f"{exc.code().name}: {exc.details()}")
            return
        except JaxdistError as exc:  # a malformed result frame
            self._fail_worker(address, f"sent a malformed result: {exc}")
            return
        if not self._closed:
            self._fail_worker(address, "closed its event stream")

    def _resolve(self, request_id: int, tensors: dict[str, np.ndarray]) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.set_result(tensors)

    def _reject(self, request_id: int, error: JaxdistError) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.future.set_exception(error)
        else:
            log.warning("error for unknown request %d: %s", request_id, error)

    def _fail_worker(self, address: str, reason: str) -> None:
        stages = self._stage_of.get(address, [])
        stage = stages[0] if stages else -1
        error = RemoteStageError(f"worker died or became unreachable: {reason}",
                                 stage=stage, address=address, remote_type="TransportError")
        with self._lock:
            if self._broken is None:
                self._broken = error
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)

    def _watch(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            now = time.monotonic()
            for address, seen in list(self._last_seen.items()):
                if now - seen > self.heartbeat_timeout and self._broken is None:
                    self._fail_worker(address, f"no heartbeat for {now - seen:.1f}s (frozen, "
                                               f"overloaded or partitioned)")

    # -- sending ----------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Send one step; the future resolves to the last stage's outputs (numpy arrays).

        Raises:
            RemoteStageError: the pipeline already lost a worker.
        """
        if self._closed:
            raise TransportError(f"pipeline {self.pipeline_id} is closed")
        if self._broken is not None:
            raise self._broken
        future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._lock:
            self._pending[request_id] = _Pending(future, session_id, step)
        header = FrameHeader(self.pipeline_id, session_id, step, 0, request_id, self.reply_to)
        try:
            with self._send_lock:
                for msg in split_frame(header, inputs):
                    self._sender.send(msg, timeout=self.heartbeat_timeout * 4)
        except JaxdistError as exc:
            with self._lock:
                self._pending.pop(request_id, None)
            if isinstance(exc, TransportError):
                self._fail_worker(self.clients[0].address, str(exc))
                raise self._broken or exc from None
            raise
        return future

    def call(self, inputs: Mapping[str, Any] | None = None, *, session_id: str = "",
             step: int = 0, timeout: float | None = None, **kw_inputs: Any
             ) -> dict[str, np.ndarray]:
        """Run one step and wait for the outputs."""
        data = dict(inputs or {}, **kw_inputs)
        return self.submit(data, session_id=session_id, step=step).result(timeout)

    __call__ = call

    def stream(self, batches: Iterable[Mapping[str, Any]], *, depth: int = 4
               ) -> Iterator[dict[str, np.ndarray]]:
        """Run microbatches with up to ``depth`` in flight (pipelined); yield outputs in order."""
        window: list[concurrent.futures.Future[dict[str, np.ndarray]]] = []
        for batch in batches:
            window.append(self.submit(batch))
            if len(window) >= depth:
                yield window.pop(0).result()
        for f in window:
            yield f.result()

    def session(self, session_id: str | None = None) -> Session:
        """A stateful session: its state stays on the workers until it is closed."""
        return Session(self, session_id or uuid.uuid4().hex)

    def end_session(self, session_id: str) -> int:
        """Free a session's state on every worker. Returns the bytes freed."""
        freed = 0
        for c in self._unique:
            try:
                freed += c.end_session(self.pipeline_id, session_id).freed_bytes
            except JaxdistError as exc:
                log.warning("could not end session %s on %s: %s", session_id, c.address, exc)
        return freed

    @property
    def broken(self) -> JaxdistError | None:
        return self._broken

    def close(self, *, unload: bool = True) -> None:
        """Stop streaming; with ``unload``, also unload the stages from the workers."""
        if self._closed:
            return
        self._closed = True
        self._sender.close(cancel=self._broken is not None)
        for call in self._subs:
            call.cancel()
        if unload and self._broken is None:
            for c in self._unique:
                try:
                    c.unload_stage(self.pipeline_id)
                except JaxdistError as exc:
                    log.warning("could not unload %s from %s: %s", self.pipeline_id, c.address, exc)
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            p.future.set_exception(TransportError(f"pipeline {self.pipeline_id} was closed"))

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """Consecutive steps of one sequence; its state (KV cache) stays on the workers."""

    def __init__(self, pipeline: Pipeline, session_id: str) -> None:
        self.pipeline = pipeline
        self.session_id = session_id
        self.step = 0

    def submit(self, inputs: Mapping[str, Any]) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        future = self.pipeline.submit(inputs, session_id=self.session_id, step=self.step)
        self.step += 1
        return future

    def __call__(self, inputs: Mapping[str, Any] | None = None, **kw: Any) -> dict[str, np.ndarray]:
        return self.submit(dict(inputs or {}, **kw)).result()

    def close(self) -> None:
        if self.step:
            self.pipeline.end_session(self.session_id)
        self.step = 0

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

