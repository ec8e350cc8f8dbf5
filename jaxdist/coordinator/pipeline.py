"""A deployed, running pipeline: stream inputs to its stages and collect their outputs.

A :class:`Pipeline` is made by :meth:`jaxdist.coordinator.cluster.Cluster.deploy`. It only
dials out. It streams frames to stage 0 over one long-lived connection and holds one
subscription per worker of the pipeline: data connections to the workers' data ports, all on
the process's one data loop (:mod:`jaxdist.coordinator.datapath`), or gRPC ``Push`` and
``Subscribe`` streams to a worker without a data port (:attr:`Pipeline.links` says which).
Results come straight from the last stage on its subscription; an error in any stage comes
from that stage's worker on its own subscription, with the stage index, the address and the
remote traceback. Heartbeats on every subscription tell a frozen worker from a slow one, and a
broken subscription names a dead worker within seconds. A :class:`Session` runs consecutive
steps of one sequence whose state stays on the workers.

When a worker dies, :meth:`Pipeline.recover` moves its stages to one of the cluster's spare
workers and reconnects; the session state is gone, and the caller rebuilds it on a new
session (the generation engine prefills its running requests again, see
:mod:`jaxdist.coordinator.engine`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import grpc
import numpy as np

from jaxdist.coordinator.datapath import DataAuth, TcpEvents, TcpSender
from jaxdist.core import control
from jaxdist.core.defaults import HEARTBEAT_TIMEOUT_S
from jaxdist.core.errors import (
    CodecError,
    JaxdistError,
    LimitError,
    PipelineKeyError,
    RemoteStageError,
    TransportError,
)
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport.channel import FrameSender
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.dataconn import data_address
from jaxdist.core.transport.frames import EventView, FrameAssembler, FrameHeader, split_frame
from jaxdist.core.transport.hop import credential as hop_credential
from jaxdist.core.transport.hop import metadata as hop_metadata
from jaxdist.export.model import Model
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["Failover", "Pipeline", "Placement", "Session"]

log = logging.getLogger(__name__)


class Placement(Protocol):
    """What a pipeline needs of the cluster that placed it, to fail over to a spare worker.

    :class:`jaxdist.coordinator.cluster.Cluster` implements it; the pipeline depends on this
    interface only, so imports run one way (coordinator -> pipeline).
    """

    spare_clients: list[WorkerClient]
    data_auth: DataAuth | None  # how to reach the workers' data ports; None: gRPC only
    data_auth_why: str  # why data_auth is None

    def answers(self, client: WorkerClient, timeout: float) -> bool:
        """Whether a worker answers within ``timeout`` seconds."""
        ...

    def take_spare(self, failed: str, timeout: float = 5.0) -> WorkerClient:
        """A spare that answers, put in place of the worker ``failed``."""
        ...

    def retire(self, client: WorkerClient) -> None:
        """Close the client of a worker that was replaced, once nothing of the cluster uses it."""
        ...

    def load_stages(self, pipeline_id: str, specs: Sequence[StageSpec],
                    placed: Sequence[WorkerClient], fetch: Callable[[str], bytes] | None,
                    progress: Callable[[str, int, int], None] | None = None, *,
                    lease_s: float | None = None, key: bytes = b"") -> list[StageSpec]:
        """Load stage k on ``placed[k]``, linked to the next one; returns the loaded specs."""
        ...


@dataclass(frozen=True)
class Failover:
    """One worker replaced by :meth:`Pipeline.recover`.

    Attributes:
        stages: the stages that moved.
        failed: the worker that stopped answering.
        spare: the spare worker that took its stages.
        seconds: how long the whole recovery took (probe, reload, reconnect).
    """

    stages: tuple[int, ...]
    failed: str
    spare: str
    seconds: float


@dataclass
class _Pending:
    future: concurrent.futures.Future[dict[str, np.ndarray]]
    session_id: str
    step: int


class Pipeline:
    """A deployed model: submit inputs, get outputs. Thread-safe.

    Created by :meth:`Cluster.deploy`. For stateful models use :meth:`session`.

    Attributes:
        links: how this coordinator reaches each worker of the pipeline, by address:
            ``"tcp"`` (its data port, on the process's data loop) or ``"grpc"`` (``Push`` and
            ``Subscribe`` streams: the worker has no data port, or the cluster was made with
            ``data_path="grpc"``; logged when chosen).

    Example:
        >>> pipe = cluster.deploy(model)                                  # doctest: +SKIP
        >>> y = pipe.call(x=x)["x"]  # one step; waits for the last stage  # doctest: +SKIP
        >>> ys = list(pipe.stream([{"x": x}] * 16, depth=4))  # pipelined  # doctest: +SKIP
    """

    def __init__(self, cluster: Placement, pipeline_id: str, specs: Sequence[StageSpec],
                 clients: Sequence[WorkerClient], *, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 model: Model | None = None, fetch: Callable[[str], bytes] | None = None,
                 lease_s: float = 0.0, key: bytes = b"") -> None:
        self.cluster = cluster
        self.pipeline_id = pipeline_id
        # The pipeline's key, presented with its loads, subscriptions, frames and session ends;
        # empty: a shared pipeline (jaxdist deploy). Kept on failover.
        self.key = key
        self.model = model
        self.reply_to = uuid.uuid4().hex
        self.heartbeat_timeout = heartbeat_timeout
        self.lease_s = lease_s  # the stages' lease on the workers (0: pinned); kept on failover
        self.failovers: list[Failover] = []
        self._fetch = fetch
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._recover_lock = threading.RLock()
        self._ids = itertools.count(1)
        self._closed = False
        self._recovering = False
        self._epoch = 0
        self._connect(specs, clients)
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()

    def _connect(self, specs: Sequence[StageSpec], clients: Sequence[WorkerClient]) -> None:
        """Open the subscriptions and the input stream to the workers holding the stages."""
        self.specs = list(specs)
        self.clients = list(clients)
        self._broken: JaxdistError | None = None
        self._stage_of: dict[str, list[int]] = {}
        for k, c in enumerate(self.clients):
            self._stage_of.setdefault(c.address, []).append(k)
        self._unique = list({c.address: c for c in self.clients}.values())
        self._last_seen = {c.address: time.monotonic() for c in self._unique}
        self._subs: list[Any] = []
        self._key_refused: PipelineKeyError | None = None
        epoch = self._epoch
        # Set by a subscription's first event: the worker sends it once the subscription is
        # registered, so a result published after that has somewhere to go.
        self._subscribed = {c.address: threading.Event() for c in self._unique}
        hops = {c.address: self._data_hop(c) for c in self._unique}
        self.links = {a: "tcp" if hop else "grpc" for a, hop in hops.items()}
        request = pb.SubscribeRequest(pipeline_id=self.pipeline_id, reply_to=self.reply_to,
                                      pipeline_key=self.key)
        auth = self.cluster.data_auth
        for c in self._unique:
            hop = hops[c.address]
            if hop and auth is not None:
                asm = FrameAssembler()
                self._subs.append(TcpEvents(
                    hop, c.address, auth, request,
                    on_event=functools.partial(self._on_event, c.address, epoch, asm),
                    on_end=functools.partial(self._on_end, c.address, epoch)))
                continue
            call = c.subscribe(self.pipeline_id, self.reply_to, self.key)
            self._subs.append(call)
            threading.Thread(target=self._listen, args=(c.address, call, epoch),
                             name=f"sub-{c.address}", daemon=True).start()
        deadline = time.monotonic() + max(self.heartbeat_timeout, 10.0)
        for address, subscribed in self._subscribed.items():
            if not subscribed.wait(max(0.0, deadline - time.monotonic())):
                log.warning("worker %s has not confirmed the result subscription of pipeline "
                            "%s; the heartbeat watchdog takes over", address, self.pipeline_id)
        if self._key_refused is not None:  # not ours to use: say so, rather than fail over
            for call in self._subs:
                call.cancel()
            raise self._key_refused
        first = self.clients[0].address
        on_error = functools.partial(self._sender_failed, first, epoch)
        # The input stream proves the pipeline's key (its hop credential), so the worker counts
        # it under this pipeline, apart from every other client's streams on this host.
        proof = hop_credential(self.pipeline_id, self.key, None) if self.key else None
        if hops[first] and auth is not None:
            sender = TcpSender(hops[first], first, auth, on_error=on_error,
                               pipeline=(self.pipeline_id, proof) if proof else None)
            # Connected before the pipeline is handed out, as the subscriptions are: a
            # failure is the first submit's error.
            sender.wait_connected(max(0.0, deadline - time.monotonic()))
            self._sender: TcpSender | FrameSender = sender
        else:
            self._sender = self.clients[0].sender(
                on_error=on_error, metadata=hop_metadata(self.pipeline_id, proof))

    def _data_hop(self, client: WorkerClient) -> str:
        """The data port of ``client``'s worker to reach it on, or ``""`` (logged): gRPC."""
        why = self.cluster.data_auth_why
        if self.cluster.data_auth is not None:
            try:
                port = client.info().data_port
            except JaxdistError as exc:  # its subscription then says what is wrong
                why = f"its Info failed ({type(exc).__name__}: {str(exc)[:200]})"
            else:
                if port:
                    return data_address(client.address, port)
                why = "it has no data port (--data-listen off)"
        log.warning("pipeline %s reaches worker %s over gRPC, which costs more per frame than "
                    "its data port: %s", self.pipeline_id, client.address, why)
        return ""

    def _sender_failed(self, address: str, epoch: int, error: TransportError) -> None:
        self._fail_worker(address, str(error), epoch)

    # -- receiving --------------------------------------------------------------------------

    def _listen(self, address: str, call: Any, epoch: int) -> None:
        """A gRPC subscription's thread (a worker without a data port)."""
        asm = FrameAssembler()
        try:
            for view in call:  # frames.EventView (see jaxdist.core.transport.wire)
                if not self._on_event(address, epoch, asm, view):
                    return
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                self._on_end(address, epoch, PipelineKeyError(f"worker {address}: "
                                                              f"{exc.details()}"))
            else:
                self._on_end(address, epoch, TransportError(f"{exc.code().name}: "
                                                            f"{exc.details()}"))
            return
        except JaxdistError as exc:  # a malformed event
            self._on_end(address, epoch, exc)
            return
        finally:  # a subscription that failed at once must not hold up _connect
            self._subscribed[address].set()
        self._on_end(address, epoch, TransportError("closed its event stream"))

    def _on_event(self, address: str, epoch: int, asm: FrameAssembler, view: EventView
                  ) -> bool:
        """One event of ``address``'s subscription; False: stop listening to it."""
        if epoch != self._epoch:
            return False  # a failover replaced this subscription
        self._last_seen[address] = time.monotonic()
        self._subscribed[address].set()
        if view.result is not None:
            try:
                done = asm.add(view.result)
            except LimitError as exc:  # a result larger than this coordinator assembles
                self._fail_worker(address, f"sent a result over the coordinator's limit: {exc}",
                                  epoch)
                return False
            except JaxdistError as exc:  # a malformed result frame
                self._fail_worker(address, f"sent a malformed result: {exc}", epoch)
                return False
            if done is not None:
                header, tensors = done
                self._resolve(header.request_id, tensors)
            return True
        event = view.msg
        if event.WhichOneof("kind") == "error":
            e = event.error
            hop = self._unreachable_hop(e.stage, e.code)
            if hop is not None:
                # Stage k could not reach stage k+1: that worker is down. Mark the
                # pipeline broken before the step's future fails, so whoever wakes
                # on it sees a broken pipeline and fails over (never the reverse).
                self._fail_worker(hop, f"stage {e.stage} at {e.address or address} "
                                       f"could not reach it: {e.message}", epoch)
                return True  # the step failed with the pipeline's error, naming the hop
            self._reject(event.request_id, RemoteStageError(
                e.message, stage=e.stage, address=e.address or address,
                remote_type=e.type, remote_traceback=e.traceback, code=e.code or None))
        return True

    def _on_end(self, address: str, epoch: int, error: JaxdistError) -> None:
        """``address``'s subscription ended by itself, for ``error``."""
        self._subscribed[address].set()
        if isinstance(error, PipelineKeyError):
            # Not a dead worker: this pipeline is another coordinator's (its key differs).
            with self._lock:
                self._key_refused = self._key_refused or error
        elif isinstance(error, CodecError):
            error = CodecError(f"sent a malformed event: {error}")
        self._fail_worker(address, str(error), epoch)

    def _unreachable_hop(self, stage: int, code: str) -> str | None:
        """The address of stage ``stage + 1`` when stage ``stage`` reports it unreachable."""
        if code != "UNAVAILABLE" or not 0 <= stage < len(self.clients) - 1:
            return None
        return self.clients[stage + 1].address

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

    def _fail_worker(self, address: str, reason: str, epoch: int | None = None) -> None:
        if self._closed or (epoch is not None and epoch != self._epoch):
            return  # closing, or a stream a failover has replaced
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
            if self._recovering:
                continue  # recover() replaces the streams and their clocks
            epoch = self._epoch
            for address, seen in list(self._last_seen.items()):
                if now - seen > self.heartbeat_timeout and self._broken is None:
                    self._fail_worker(address, f"no heartbeat for {now - seen:.1f}s (frozen, "
                                               f"overloaded or partitioned)", epoch)

    # -- failover ---------------------------------------------------------------------------

    def recover(self) -> list[Failover]:
        """Replace the pipeline's dead workers with the cluster's spares and load it again.

        Every worker of the pipeline is probed with ``Info`` (deadline: the heartbeat timeout,
        at most 5 s). The stages of each worker that does not answer move to a spare worker
        (:class:`~jaxdist.coordinator.cluster.Cluster` ``spares=``); the artifact is uploaded
        there when the spare lacks it. The stages on the workers that answered are loaded again
        too: the next hop of the stage before a moved one changes, and their session state is
        lost with the rest of the pipeline's anyway. With a warm worker that is a bind and a
        compilation-cache hit per stage. When every worker answers (a dropped connection, not a
        dead worker), the stages are reloaded where they are.

        Session state (KV caches) does not survive a failover: the caller rebuilds it on a new
        session. :class:`~jaxdist.coordinator.engine.Engine` does that by itself (it prefills
        each running request's prompt again and decodes its generated tokens again).

        Steps still in flight fail with the error that broke the pipeline. Do not submit while
        this runs: :meth:`submit` refuses until it returns.

        Returns:
            One :class:`Failover` per replaced worker (empty when none was dead).

        Raises:
            TransportError: a dead worker and no spare left that answers.
            JaxdistError: a stage failed to load on its new worker (the pipeline stays broken).
        """
        with self._recover_lock:
            if self._closed:
                raise TransportError(f"pipeline {self.pipeline_id} is closed")
            if len(self.specs) != len(self.clients):
                raise TransportError(f"pipeline {self.pipeline_id} was attached without its "
                                     f"manifest, so its stage specs are unknown here and it "
                                     f"cannot fail over (Cluster.attach(..., manifest=...))")
            t0 = time.monotonic()
            cause = self._broken or TransportError(
                f"pipeline {self.pipeline_id} is failing over; the step was lost")
            self._recovering = True
            self._epoch += 1  # the old streams' errors are no longer news
            try:
                self._sender.close(cancel=True)
                for call in self._subs:
                    call.cancel()
                with self._lock:
                    pending = list(self._pending.values())
                    self._pending.clear()
                for p in pending:
                    if not p.future.done():
                        p.future.set_exception(cause)
                probe = min(self.heartbeat_timeout, 5.0)
                dead = [c.address for c in self._unique if not self.cluster.answers(c, probe)]
                old = {c.address: c for c in self._unique}
                moved = {a: self.cluster.take_spare(a, probe) for a in dead}
                clients = [moved.get(c.address, c) for c in self.clients]
                for c in self._unique:
                    if c.address not in moved:
                        try:
                            c.unload_stage(self.pipeline_id)
                        except JaxdistError as exc:
                            log.warning("failover: could not unload %s from %s: %s",
                                        self.pipeline_id, c.address, exc)
                specs = self.cluster.load_stages(self.pipeline_id, self.specs, clients,
                                                 self._fetch, lease_s=self.lease_s,
                                                 key=self.key)
                self._connect(specs, clients)
                for a in moved:
                    self.cluster.retire(old[a])
            except BaseException as exc:
                self._broken = exc if isinstance(exc, JaxdistError) else cause
                raise
            finally:
                self._recovering = False
            seconds = time.monotonic() - t0
            done = [Failover(tuple(k for k, c in enumerate(self.clients)
                                   if c.address == spare.address), a, spare.address, seconds)
                    for a, spare in moved.items()]
            for f in done:
                log.warning("pipeline %s: stages %s moved from %s to spare %s in %.1fs",
                            self.pipeline_id, list(f.stages), f.failed, f.spare, seconds)
            self.failovers.extend(done)
            return done

    # -- sending ----------------------------------------------------------------------------

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Send one step; the future resolves to the last stage's outputs (numpy arrays).

        Raises:
            RemoteStageError: the pipeline already lost a worker.
        """
        if self._closed:
            raise TransportError(f"pipeline {self.pipeline_id} is closed")
        if self._recovering:
            raise TransportError(f"pipeline {self.pipeline_id} is failing over to a spare "
                                 f"worker; submit again once recover() has returned")
        if self._broken is not None:
            raise self._broken
        # Per-step control (slot, pos, ...) goes in the frame's header, read by every stage.
        tensors, ctl = control.split(inputs, self.specs[0].control)
        future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._lock:
            self._pending[request_id] = _Pending(future, session_id, step)
        header = FrameHeader(self.pipeline_id, session_id, step, 0, request_id, self.reply_to,
                             control=ctl, key=self.key)
        try:
            with self._send_lock:
                self._sender.send_frame(list(split_frame(header, tensors)),
                                        timeout=self.heartbeat_timeout * 4)
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
        """Run one step and wait for the outputs.

        A call without a session holds no state on the workers, so when a worker dies under it
        and the cluster has spare workers, the pipeline fails over (:meth:`recover`, logged) and
        the call runs again, once. A call in a session raises: its state is gone, and only the
        caller can replay it.
        """
        data = dict(inputs or {}, **kw_inputs)
        epoch = self._epoch
        try:
            return self.submit(data, session_id=session_id, step=step).result(timeout)
        except RemoteStageError:
            if session_id or self._broken is None or not self.cluster.spare_clients:
                raise
            self._recover_once(epoch)
        return self.submit(data).result(timeout)

    def _recover_once(self, epoch: int) -> None:
        """:meth:`recover`, unless another thread already did since ``epoch``."""
        with self._recover_lock:
            if self._epoch != epoch and self._broken is None:
                return
            self.recover()

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
                freed += c.end_session(self.pipeline_id, session_id, self.key).freed_bytes
            except JaxdistError as exc:
                log.warning("could not end session %s on %s: %s", session_id, c.address, exc)
        return freed

    def heartbeat_ages(self) -> dict[str, float]:
        """Seconds since each worker's last event on its subscription (a heartbeat or a
        result), by address."""
        now = time.monotonic()
        return {address: now - seen for address, seen in list(self._last_seen.items())}

    def stage_memory(self) -> list[dict[str, Any]]:
        """What each stage binds on its worker, from ``Info``: one dict per stage with
        ``stage``, ``address``, ``weight_bytes`` (on the device), ``packed_bytes`` (of those,
        GGML blocks bound as stored) and ``dequantized_types``."""
        found: dict[int, dict[str, Any]] = {}
        for c in self._unique:
            for st in c.info().stages:
                if st.pipeline_id == self.pipeline_id:
                    found[st.stage_index] = {
                        "stage": st.stage_index, "address": c.address,
                        "weight_bytes": st.weight_bytes, "packed_bytes": st.packed_bytes,
                        "dequantized_types": list(st.dequantized_types)}
        return [found[k] for k in sorted(found)]

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """Consecutive steps of one sequence; its state (KV cache) stays on the workers.

    Example:
        >>> with pipe.session() as s:  # doctest: +SKIP
        ...     s(x=step0)             # step 0 creates the state on every worker
        ...     y = s(x=step1)["x"]    # step 1 reads it; closing the session frees it
    """

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

