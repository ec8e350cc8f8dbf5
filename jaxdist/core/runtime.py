"""A loaded stage, running frames on an event loop, and the one interface its frames leave by.

The data path has one seam: a stage receives a frame through :meth:`StageRuntime.process` and
sends it on through a :class:`Route`, the edge of its own pipeline. Transports implement the
route; the stage runtime and the pipeline never name one:

* TCP between workers (:class:`jaxdist.worker.tcp_route.TcpRoute`): one data connection per
  pipeline edge to the next worker's data port (:mod:`jaxdist.core.transport.stream`);
* gRPC between workers (:class:`jaxdist.worker.runtime.GrpcRoute`): one ``Push`` stream per
  pipeline edge, when the next worker has no data port; with either, results and errors go on
  the caller's ``Subscribe`` stream;
* in one process (:class:`jaxdist.coordinator.inprocess.InProcessPipeline`): the next stage's
  ``process`` is called directly, and device arrays are handed over as they are.

A further transport (shared memory between the workers of one host, device to device) is one
more :class:`Route`. Each route belongs to one stage of one pipeline, so a slow or stuck edge
holds up only that pipeline.

Per frame, on the loop::

    process: compiled? -- no --> compile in a thread of the shared pool
             run: in the stage's own step thread (its lane)
             ready on the host? -- yes, and nothing queued --> route.forward        (inline)
                                `-- otherwise --> [egress queue] -> egress task:
                                                  wait in the stage's host thread, route.forward

On a worker a step never runs on the loop: each stage has a thread of its own for its steps
(one at a time, in frame order) and one for waiting on device results, so one stage's long step
holds up only its own later steps. The loop parses, forwards and beats, so another pipeline's
frame waits for the loop's own per-frame work and never for a step, and the heartbeats go out
on time whatever the steps do (XLA releases the GIL while it computes). The handoff costs ~16 us
of context switches each way on these machines, which a decode step of SmolLM2 does not show
(measured: bench/NOTES.md, "Steps off the loop"). A frame whose outputs are ready when the step
returns (on XLA:CPU, every step) goes out at once from the task that read it. An in-process
pipeline (``inline_steps``), whose loop serves it alone, runs its steps on the loop: a plain
``jax.jit`` call needs no handoff, and neither does the baseline. The egress queue keeps a
stage's frames in order; it is bounded, and when it is full the caller of ``process`` waits
(for gRPC: the Push stream stops reading and flow control pushes back to the sender).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import logging
import math
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from jaxdist.core import control
from jaxdist.core.errors import JaxdistError, LimitError, SessionError, SpecError
from jaxdist.core.sessions import SessionStore
from jaxdist.core.stage import WorkerStage
from jaxdist.core.transport import status
from jaxdist.core.transport.frames import FrameHeader
from jaxdist.core.weights.uri import clip
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["QUEUE_DEPTH", "Route", "ShapeBudget", "StageRuntime", "call_in_loop",
           "remote_error"]

log = logging.getLogger(__name__)

QUEUE_DEPTH = 32  # frames buffered per stage on egress
# Upper bounds (s) of the step-time counts a stage keeps, the worker's metrics histogram
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0)

Shapes = tuple[tuple[int, ...], ...]


class Route(Protocol):
    """Where one stage's frames go: the edge from this stage to the next, or to the caller.

    Called on the stage's event loop only. ``forward`` may wait (back-pressure), and raises
    :class:`~jaxdist.core.errors.TransportError` naming the peer when the edge is broken; the
    runtime then reports the frame's failure through ``fail``.
    """

    wants_host: bool
    """Whether ``forward`` needs host (numpy) arrays. False: device arrays are handed over as
    they are (same process, or a device-to-device transport)."""

    async def forward(self, header: FrameHeader, outputs: Mapping[str, Any]) -> None:
        """Send the outputs on. ``header.stage`` is the index of the stage they are for: the
        next stage, or ``num_stages`` for the result of the last stage."""
        ...

    async def fail(self, header: FrameHeader, error: BaseException) -> None:
        """Tell the frame's caller that it failed on this stage; never raises."""
        ...

    async def close(self) -> None:
        """Finish the frames already forwarded and release the edge."""
        ...


class ShapeBudget(Protocol):
    """The input shapes the stages of one pipeline may have compiled on one worker together
    (``--max-compiled-shapes``): a stage charges each shape it compiles, and gives them back
    when it is unloaded. Thread-safe."""

    limit: int
    """The bound; 0: none."""

    def held(self) -> int:
        """Shapes charged now, by every stage of the pipeline."""
        ...

    def charge(self, n: int) -> bool:
        """Take ``n`` more shapes; False, and nothing taken, when that would pass the limit."""
        ...

    def refund(self, n: int) -> None:
        """Give back ``n`` shapes."""
        ...


def remote_error(exc: BaseException, *, stage: int, address: str) -> pb.RemoteError:
    """Describe an exception for the coordinator (status code, class, message, traceback)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return pb.RemoteError(code=status.code_for(exc).name, type=type(exc).__name__,
                          message=str(exc), traceback=tb, stage=stage, address=address)


def call_in_loop(loop: asyncio.AbstractEventLoop | None, fn: Any, timeout: float) -> None:
    """Run coroutine function ``fn`` on ``loop`` from another thread and wait for it."""
    if loop is None or loop.is_closed():
        return
    future = asyncio.run_coroutine_threadsafe(fn(), loop)
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()


def _ready_on_host(outputs: Mapping[str, Any]) -> bool:
    for x in outputs.values():
        is_ready = getattr(x, "is_ready", None)
        if is_ready is not None and not is_ready():
            return False
    return True


def _nbytes(x: Any) -> int:
    """An array's bytes; for a ``jax.Array`` from its shape (its ``nbytes`` costs ~4x that)."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    shape: tuple[int, ...] = x.shape
    itemsize: int = x.dtype.itemsize
    return math.prod(shape) * itemsize


def _lane(name: str) -> concurrent.futures.ThreadPoolExecutor:
    """One thread, its calls run in the order they were submitted (a stage's steps, its waits
    for device results)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)


def _to_host(outputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Wait for the outputs and copy them to host memory (the stage's one device->host copy)."""
    return {k: np.asarray(v) for k, v in outputs.items()}


class StageRuntime:
    """A loaded stage, run from an event loop, with its egress queue and its route.

    Args:
        stage: the compiled stage.
        stage_id: unique id of this stage deployment.
        pipeline_id: the pipeline it belongs to.
        sessions: the session store its state lives in.
        route: where its frames go (see :class:`Route`).
        pool: threads that compile new shapes (shared by the stages of a worker).
        inline_steps: run the steps on the loop (an in-process pipeline, whose loop serves
            nothing else), not in the stage's own thread.
        budget: the compiled shapes its pipeline may hold on this worker. The stage holds the
            shapes compiled already (its buckets, charged by whoever loaded it), and charges
            each further one before it compiles it; a frame of a shape over the budget is
            refused. :meth:`stop` gives them all back. None: no bound.
    """

    def __init__(self, stage: WorkerStage, *, stage_id: str, pipeline_id: str,
                 sessions: SessionStore, route: Route,
                 pool: concurrent.futures.Executor | None = None,
                 budget: ShapeBudget | None = None, inline_steps: bool = False) -> None:
        self.stage = stage
        self.spec = stage.spec
        self.stage_id = stage_id
        self.pipeline_id = pipeline_id
        self.route = route
        self._sessions = sessions
        self._pool = pool
        self._budget = budget
        # The shapes this stage holds of its pipeline's budget; none once stopped
        self._charged: set[Shapes] = set(stage.compiled_shapes)
        self._charge_lock = threading.Lock()
        self._released = False
        self._stateful = bool(self.spec.state)
        # On the host already: outputs that are ready need no thread to reach the route.
        self._on_host = stage.platform == "cpu"
        self._inline_steps = inline_steps
        # The stage's lanes, started on first use: its steps, one at a time in frame order,
        # and its waits for device results (so a step's copy to the host never waits behind
        # the next step, nor behind another stage's).
        self._steps: concurrent.futures.ThreadPoolExecutor | None = None
        self._host: concurrent.futures.ThreadPoolExecutor | None = None
        self._egress: asyncio.Queue[tuple[FrameHeader, dict[str, Any]] | None] | None = None
        self._egress_task: asyncio.Task[None] | None = None
        self._egress_busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.frames_done = 0
        # Read by the worker's metrics at scrape time; updated on the loop only.
        self.bytes_in = 0  # tensor bytes of the frames run
        self.bytes_out = 0  # tensor bytes of the frames sent on (frames_done)
        self.compute_s = 0.0  # seconds of the steps run
        self.step_counts = [0] * (len(STEP_SECONDS_BUCKETS) + 1)  # steps by bucket; last: over
        self.compile_hits = 0  # frames whose shapes were compiled already
        self.compile_misses = 0  # frames that waited for their shapes to compile
        self._inflight = 0
        self._inflight_lock = threading.Condition()

    @property
    def in_flight(self) -> int:
        """Frames taken in by :meth:`process` and not yet sent on (or failed): queue depth."""
        with self._inflight_lock:
            return self._inflight

    # -- ingress ----------------------------------------------------------------------------

    def accept(self, header: FrameHeader, tensors: dict[str, Any]) -> tuple[dict[str, Any], Shapes]:
        """The inputs of a frame for this stage, checked against its spec, and their shapes.

        The inputs are the frame's tensors plus the fields of its control header that the spec
        reads (``StageSpec.control``).

        Raises:
            SpecError: an input is missing, or has the wrong dtype or shape; CodecError: a
                malformed control header.
        """
        names = self.spec.control
        if names:
            given = [n for n in names if n in tensors]
            if given:
                raise SpecError(f"stage {self.spec.stage_index}: {given} came as tensors; this "
                                f"stage reads them from the frame's step-control header")
            fields = control.decode(header.control)
            missing = [n for n in names if n not in fields]
            if missing:
                raise SpecError(f"stage {self.spec.stage_index}: the frame's step-control header "
                                f"lacks {missing} (it has {sorted(fields)}); send them as step "
                                f"control, not as tensors")
            tensors = {**tensors, **{n: fields[n] for n in names}}
        return tensors, self.stage.check_inputs(tensors)

    async def process(self, header: FrameHeader, tensors: dict[str, Any], shapes: Shapes) -> None:
        """Run one frame and send its outputs on, in frame order (call it on the loop).

        Waits while the egress queue is full (back-pressure). Failures go to the route's
        ``fail``, never raised.
        """
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._inflight_lock:
            self._inflight += 1
        queued = False
        try:
            try:
                outputs = await self._run(header, tensors, shapes)
            except Exception as exc:  # noqa: BLE001 - every frame failure goes to the caller
                await self._failed(header, exc)
                return
            nxt = FrameHeader(header.pipeline_id, header.session_id, header.step,
                              self.spec.stage_index + 1, header.request_id, header.reply_to,
                              control=header.control, key=header.key)
            if (not self._egress_busy and (self._egress is None or self._egress.empty())
                    and (not self.route.wants_host or (self._on_host
                                                       and _ready_on_host(outputs)))):
                self._egress_busy = True
                try:
                    await self._emit(nxt, outputs)
                finally:
                    self._egress_busy = False
                return
            await self._queue().put((nxt, outputs))
            queued = True  # the egress task owns the frame now
        finally:
            if not queued:  # done, failed, or cancelled under us
                self._done_one()

    @property
    def shapes_held(self) -> int:
        """Compiled shapes this stage holds of its pipeline's budget."""
        with self._charge_lock:
            return len(self._charged)

    def _charge(self, shapes: Shapes) -> None:
        """Charge a shape to the pipeline's budget before it compiles (once per shape).

        Raises:
            LimitError: the pipeline has as many compiled shapes here as the budget allows.
            SessionError: the stage was unloaded meanwhile.
        """
        with self._charge_lock:
            if shapes in self._charged:  # charged already: another frame compiles it
                return
            if self._released:
                raise SessionError(f"stage {self.stage_id!r} was unloaded; its frame of new "
                                   f"input shapes {shapes} was not run")
            budget = self._budget
            if budget is not None and not budget.charge(1):
                compiled = self.stage.compiled_shapes
                raise LimitError(
                    f"stage {self.spec.stage_index} of pipeline {clip(self.pipeline_id, 64)!r}: "
                    f"input shapes {shapes} would be compiled shape number "
                    f"{budget.held() + 1} of the pipeline on this worker, over its limit "
                    f"(--max-compiled-shapes={budget.limit}, per pipeline); pad the inputs to "
                    f"a shape it has compiled, such as {compiled[:3]}")
            self._charged.add(shapes)

    def _uncharge(self, shapes: Shapes) -> None:
        """Give a shape back whose compile failed (nothing was kept)."""
        with self._charge_lock:
            if shapes not in self._charged or self.stage.is_compiled(shapes) or self._released:
                return
            self._charged.discard(shapes)
        if self._budget is not None:
            self._budget.refund(1)

    def release_shapes(self) -> None:
        """Give every shape this stage holds back to its pipeline's budget (once); it compiles
        no new shape after this."""
        with self._charge_lock:
            if self._released:
                return
            self._released = True
            n = len(self._charged)
            self._charged.clear()
        if self._budget is not None and n:
            self._budget.refund(n)

    async def _run(self, header: FrameHeader, tensors: dict[str, Any], shapes: Shapes
                   ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if not self.stage.is_compiled(shapes):  # seconds: keep the loop serving
            self._charge(shapes)
            self.compile_misses += 1
            try:
                await loop.run_in_executor(self._pool, self.stage.compile_shapes, shapes)
            except Exception:
                self._uncharge(shapes)
                raise
        else:
            self.compile_hits += 1
        if self._inline_steps:
            outputs, took = self._timed(header, tensors, shapes)
        else:
            self._steps = self._steps or _lane(f"step-{self.spec.stage_index}")
            outputs, took = await loop.run_in_executor(self._steps, self._timed, header,
                                                       tensors, shapes)
        self.compute_s += took
        self.step_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, took)] += 1
        self.bytes_in += sum(t.nbytes for t in tensors.values())
        return outputs

    async def _failed(self, header: FrameHeader, exc: Exception) -> None:
        if not isinstance(exc, JaxdistError):
            log.error("stage %d failed on a frame", self.spec.stage_index, exc_info=exc)
        log.info("stage %d: %s for session %r step %d: %s", self.spec.stage_index,
                 type(exc).__name__, header.session_id, header.step, exc)
        await self.route.fail(header, exc)

    # -- execution --------------------------------------------------------------------------

    def _timed(self, h: FrameHeader, tensors: dict[str, Any], shapes: Shapes
               ) -> tuple[dict[str, Any], float]:
        """:meth:`_execute`, and the seconds it took in the thread that ran it."""
        t0 = time.perf_counter()
        outputs = self._execute(h, tensors, shapes)
        return outputs, time.perf_counter() - t0

    def _execute(self, h: FrameHeader, tensors: dict[str, Any], shapes: Shapes
                 ) -> dict[str, Any]:
        if not self._stateful:
            outputs, _ = self.stage.run(tensors, shapes=shapes)
            return outputs
        if h.step == 0:  # refused here, under the limits, before any state is allocated
            sess = self._sessions.open(self.stage_id, h.session_id, self.spec.state_bytes)
            try:
                state = self.stage.init_state()
            except Exception:
                self._sessions.end(h.session_id, [self.stage_id])
                raise
        else:
            sess = self._sessions.take(self.stage_id, h.session_id, h.step)
            state, sess.state = sess.state, {}  # donated below: leave no dangling buffers
        try:
            outputs, new_state = self.stage.run(tensors, state, shapes=shapes)
        except Exception as exc:  # the state may be donated already: the session is lost
            self._sessions.lose(self.stage_id, h.session_id,
                                f"was lost: step {h.step} failed on this stage "
                                f"({type(exc).__name__}), and its state was given to that step")
            raise
        sess.state, sess.step = new_state, h.step
        return outputs

    # -- egress -----------------------------------------------------------------------------

    def _queue(self) -> asyncio.Queue[tuple[FrameHeader, dict[str, Any]] | None]:
        if self._egress is None:
            self._egress = asyncio.Queue(maxsize=QUEUE_DEPTH)
            self._egress_task = asyncio.get_running_loop().create_task(self._egress_loop(self._egress),
                                                       name=f"egress-{self.stage_id}")
        return self._egress

    async def _egress_loop(self, q: asyncio.Queue[tuple[FrameHeader, dict[str, Any]] | None]
                           ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await q.get()
            if item is None:
                return
            header, outputs = item
            self._egress_busy = True
            try:
                if self.route.wants_host and not (self._on_host and _ready_on_host(outputs)):
                    self._host = self._host or _lane(f"host-{self.spec.stage_index}")
                    outputs = await loop.run_in_executor(self._host, _to_host, outputs)
                await self._emit(header, outputs)
            except Exception as exc:  # noqa: BLE001 - the device computation itself failed
                await self._failed(header, exc)
            finally:
                self._egress_busy = False
                self._done_one()

    async def _emit(self, header: FrameHeader, outputs: dict[str, Any]) -> None:
        try:
            await self.route.forward(header, outputs)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, never raised
            await self._failed(header, exc)
            return
        self.frames_done += 1
        self.bytes_out += sum(_nbytes(t) for t in outputs.values())

    def _done_one(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._inflight_lock.notify_all()

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted frame has left the stage (from a thread other than the
        loop). True when drained."""
        with self._inflight_lock:
            return self._inflight_lock.wait_for(lambda: self._inflight <= 0, timeout)

    async def aclose(self) -> None:
        """Send the queued frames, end the egress task and close the route (on the loop)."""
        if self._egress is not None and self._egress_task is not None:
            await self._egress.put(None)
            await self._egress_task
        await self.route.close()
        for lane in (self._steps, self._host):
            if lane is not None:
                lane.shutdown(wait=False)  # its thread ends once its last call returns

    def stop(self) -> None:
        """Give the compiled shapes back to the pipeline's budget (:meth:`release_shapes`),
        :meth:`aclose` on the loop, from another thread, then drop the sessions."""
        self.release_shapes()
        call_in_loop(self._loop, self.aclose, timeout=10)
        self.drop_sessions()

    def drop_sessions(self) -> None:
        dropped = self._sessions.drop_stage(self.stage_id)
        if dropped:
            log.info("stage %s unloaded with %d live sessions", self.stage_id, dropped)
