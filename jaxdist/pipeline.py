"""A deployed, running pipeline: stream inputs to its stages and collect their outputs.

A :class:`Pipeline` is made by :meth:`jaxdist.coordinator.Cluster.deploy`. It only dials out. It
streams frames to stage 0 over one long-lived ``Push`` stream and holds one ``Subscribe`` stream
per worker of the pipeline. Results come straight from the last stage on its subscription; an
error in any stage comes from that stage's worker on its own subscription, with the stage index,
the address and the remote traceback. Heartbeats on every subscription tell a frozen worker from a
slow one, and a broken subscription names a dead worker within seconds. A :class:`Session` runs
consecutive steps of one sequence whose state stays on the workers.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from jaxdist.errors import JaxdistError, RemoteStageError, TransportError
from jaxdist.model import Model
from jaxdist.spec import StageSpec
from jaxdist.transport.client import WorkerClient
from jaxdist.transport.frames import FrameAssembler, FrameHeader, split_frame

if TYPE_CHECKING:  # only for the annotation: jaxdist.coordinator imports this module
    from jaxdist.coordinator import Cluster

__all__ = ["Pipeline", "Session"]

log = logging.getLogger(__name__)


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
        # Set by a subscription's first event: the worker sends it once the subscription is
        # registered, so a result published after that has somewhere to go.
        self._subscribed = {c.address: threading.Event() for c in self._unique}
        for c in self._unique:
            call = c.subscribe(pipeline_id, self.reply_to)
            self._subs.append(call)
            t = threading.Thread(target=self._listen, args=(c.address, call),
                                 name=f"sub-{c.address}", daemon=True)
            t.start()
            self._threads.append(t)
        deadline = time.monotonic() + max(heartbeat_timeout, 10.0)
        for address, subscribed in self._subscribed.items():
            if not subscribed.wait(max(0.0, deadline - time.monotonic())):
                log.warning("worker %s has not confirmed the result subscription of pipeline "
                            "%s; the heartbeat watchdog takes over", address, pipeline_id)
        self._sender = self.clients[0].sender(on_error=lambda e: self._fail_worker(
            self.clients[0].address, str(e)))
        self._watchdog = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._watchdog.start()

    # -- receiving --------------------------------------------------------------------------

    def _listen(self, address: str, call: Any) -> None:
        try:
            self._receive(address, call)
        finally:  # a subscription that failed at once must not hold up __init__
            self._subscribed[address].set()

    def _receive(self, address: str, call: Any) -> None:
        asm = FrameAssembler()
        try:
            for view in call:  # frames.EventView (see jaxdist.transport.wire)
                self._last_seen[address] = time.monotonic()
                self._subscribed[address].set()
                if view.result is not None:
                    done = asm.add(view.result)
                    if done is not None:
                        header, tensors = done
                        self._resolve(header.request_id, tensors)
                    continue
                event = view.msg
                if event.WhichOneof("kind") == "error":
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

