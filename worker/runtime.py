"""The running side of a worker: stages, their egress, and the coordinator subscriptions.

All of it runs on the worker's data-plane event loop (one thread, see ``server.py``), which
serves the ``Push`` and ``Subscribe`` streams and writes the streams to next hops. Per frame:

    Push stream: assemble, check, dispatch --ready on the host?--> encode, send      (inline)
                                           `--otherwise--> [egress queue] -> egress task:
                                                           wait in a thread, encode, send

A frame whose outputs are ready when the dispatch returns (on XLA:CPU, every small step) goes
out at once from the task that read it: no thread handoff on the way through a worker (each
costs ~16 us of context switches on these machines, and a 4 KB hop is ~0.1 ms of work in all).
A frame still computing (an accelerator, or a large CPU step) waits in a thread, so the loop
reads and dispatches the next frame meanwhile (compute overlaps the wire) and keeps serving
heartbeats. One egress queue per stage keeps its frames in order: a frame goes inline only when
nothing of that stage is queued or in flight. The queue is bounded; when it is full the Push
stream stops reading and gRPC's flow control pushes back to the sender.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import traceback
from typing import Any

import numpy as np

from jaxdist.core.errors import JaxdistError, TransportError
from jaxdist.core.stage import WorkerStage
from jaxdist.core.transport import status, wire
from jaxdist.core.transport.channel import AsyncFrameSender, make_aio_channel
from jaxdist.core.transport.frames import FrameHeader, result_events, split_frame
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.sessions import SessionStore

__all__ = ["HEARTBEAT", "Hub", "PeerPool", "StageRuntime", "remote_error"]

log = logging.getLogger(__name__)

QUEUE_DEPTH = 32  # frames buffered per stage on egress
SEND_TIMEOUT_S = 60.0  # a next hop that takes no frame for this long is reported as stuck
PUBLISH_TIMEOUT_S = 30.0  # a subscriber that reads nothing for this long loses events

HEARTBEAT = object()
"""Queued on an idle subscription; ``Subscribe`` sends a heartbeat event in its place."""


def remote_error(exc: BaseException, *, stage: int, address: str) -> pb.RemoteError:
    """Describe an exception for the coordinator (status code, class, message, traceback)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return pb.RemoteError(code=status.code_for(exc).name, type=type(exc).__name__,
                          message=str(exc), traceback=tb, stage=stage, address=address)


def _call_in_loop(loop: asyncio.AbstractEventLoop | None, fn: Any, timeout: float) -> None:
    """Run coroutine function ``fn`` on ``loop`` from another thread and wait for it."""
    if loop is None or loop.is_closed():
        return
    future = asyncio.run_coroutine_threadsafe(fn(), loop)
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()


class Hub:
    """Subscriptions of coordinators, by ``(pipeline_id, reply_to)``. Used on the loop only,
    except :meth:`shutdown`.

    Results of a last stage and errors of any stage on this worker are published here and
    streamed to the coordinator that subscribed, with heartbeats in between.
    """

    def __init__(self, max_pending: int = 1024) -> None:
        self._subs: dict[tuple[str, str], asyncio.Queue[Any]] = {}
        self._max_pending = max_pending
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, pipeline_id: str, reply_to: str) -> asyncio.Queue[Any]:
        self._loop = asyncio.get_running_loop()
        q: asyncio.Queue[Any] = asyncio.Queue(maxsize=self._max_pending)
        old = self._subs.get((pipeline_id, reply_to))
        self._subs[(pipeline_id, reply_to)] = q
        if old is not None:
            self._end(old)
        return q

    def close(self, pipeline_id: str, reply_to: str, q: asyncio.Queue[Any]) -> None:
        if self._subs.get((pipeline_id, reply_to)) is q:
            del self._subs[(pipeline_id, reply_to)]

    async def publish(self, pipeline_id: str, reply_to: str, event: Any) -> bool:
        """Deliver an event; False (logged) when nobody listens. Waits while the queue is full."""
        q = self._subs.get((pipeline_id, reply_to))
        if q is None:
            log.warning("no subscriber for pipeline %s reply_to %r; dropped an event", pipeline_id,
                        reply_to)
            return False
        if not q.full():
            q.put_nowait(event)
            return True
        try:
            async with asyncio.timeout(PUBLISH_TIMEOUT_S):
                await q.put(event)
        except TimeoutError:
            log.warning("subscriber of pipeline %s is not reading; dropped an event", pipeline_id)
            return False
        return True

    @staticmethod
    def _end(q: asyncio.Queue[Any]) -> None:
        while True:  # at shutdown, events nobody reads may go: the end marker may not
            try:
                q.put_nowait(None)
                return
            except asyncio.QueueFull:
                q.get_nowait()

    def shutdown(self) -> None:
        """End every subscription (from any thread)."""
        async def end_all() -> None:
            subs = list(self._subs.values())
            self._subs.clear()
            for q in subs:
                self._end(q)
        _call_in_loop(self._loop, end_all, timeout=5)


class PeerPool:
    """One long-lived frame stream per next-hop address, shared by the stages of this worker.

    Used on the loop only, except :meth:`close`.
    """

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (),
                 credentials: Any = None) -> None:
        self._senders: dict[str, AsyncFrameSender] = {}
        self._channels: dict[str, Any] = {}
        self._metadata = metadata
        self._credentials = credentials
        self._loop: asyncio.AbstractEventLoop | None = None

    def sender(self, address: str) -> AsyncFrameSender:
        s = self._senders.get(address)
        if s is None or s.error is not None:
            self._loop = asyncio.get_running_loop()
            if s is not None:
                s.cancel()
            channel = self._channels.get(address)
            if channel is None:
                channel = make_aio_channel(address, credentials=self._credentials)
                self._channels[address] = channel
            s = AsyncFrameSender(wire.push_method(channel), address, metadata=self._metadata)
            self._senders[address] = s
        return s

    def close(self) -> None:
        """Finish every stream and close the channels (from any thread)."""
        async def close_all() -> None:
            senders, channels = list(self._senders.values()), list(self._channels.values())
            self._senders.clear()
            self._channels.clear()
            for s in senders:
                await s.close()
            for c in channels:
                await c.close()
        _call_in_loop(self._loop, close_all, timeout=10)


def _ready_on_host(outputs: dict[str, Any]) -> bool:
    for x in outputs.values():
        is_ready = getattr(x, "is_ready", None)
        if is_ready is not None and not is_ready():
            return False
    return True


def _to_host(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Wait for the outputs and copy them to host memory (the worker's one device->host copy)."""
    return {k: np.asarray(v) for k, v in outputs.items()}


class StageRuntime:
    """A loaded stage, run from the data-plane loop, with its egress queue.

    Args:
        stage: the compiled stage.
        stage_id: unique id of this stage deployment.
        pipeline_id: the pipeline it belongs to.
        sessions: the worker's session store.
        hub: where results (last stage) and errors go.
        peers: streams to next hops.
        address: this worker's address, for error reports.
        pool: threads that wait for device results and compile new shapes.
    """

    def __init__(self, stage: WorkerStage, *, stage_id: str, pipeline_id: str,
                 sessions: SessionStore, hub: Hub, peers: PeerPool, address: str,
                 pool: concurrent.futures.Executor | None = None) -> None:
        self.stage = stage
        self.spec = stage.spec
        self.stage_id = stage_id
        self.pipeline_id = pipeline_id
        self._sessions = sessions
        self._hub = hub
        self._peers = peers
        self._address = address
        self._pool = pool
        self._stateful = bool(self.spec.state)
        # On the host already: outputs that are ready need no thread to reach the wire.
        self._inline_ok = stage.platform == "cpu"
        self._egress: asyncio.Queue[tuple[FrameHeader, dict[str, Any]] | None] | None = None
        self._egress_task: asyncio.Task[None] | None = None
        self._egress_busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.frames_done = 0
        self._inflight = 0
        self._inflight_lock = threading.Condition()

    # -- ingress ----------------------------------------------------------------------------

    async def process(self, header: FrameHeader, tensors: dict[str, Any],
                      shapes: tuple[tuple[int, ...], ...]) -> None:
        """Run one frame and send its outputs on, in frame order (call it on the loop).

        Waits while the egress queue is full (back-pressure on the stream). Failures are
        reported to the coordinator, never raised.
        """
        with self._inflight_lock:
            self._inflight += 1
        queued = False
        try:
            try:
                if not self.stage.is_compiled(shapes):  # seconds: keep the loop serving
                    await asyncio.get_running_loop().run_in_executor(
                        self._pool, self.stage.compile_shapes, shapes)
                outputs = self._execute(header, tensors, shapes)
            except Exception as exc:  # noqa: BLE001 - every frame failure goes to the coordinator
                await self._failed(header, exc)
                return
            if (self._inline_ok and not self._egress_busy and _ready_on_host(outputs)
                    and (self._egress is None or self._egress.empty())):
                self._egress_busy = True
                try:
                    await self._emit(header, outputs)
                finally:
                    self._egress_busy = False
                return
            await self._queue().put((header, outputs))
            queued = True  # the egress task owns the frame now
        finally:
            if not queued:  # done, failed, or the stream was cancelled under us
                self._done_one()

    async def _failed(self, header: FrameHeader, exc: Exception) -> None:
        if not isinstance(exc, JaxdistError):
            log.error("stage %d failed on a frame", self.spec.stage_index, exc_info=exc)
        await self.report(header, exc)

    async def report(self, header: FrameHeader, exc: BaseException) -> None:
        """Send an error for a frame to the coordinator subscribed on this worker."""
        err = remote_error(exc, stage=self.spec.stage_index, address=self._address)
        log.info("stage %d: %s for session %r step %d: %s", self.spec.stage_index, err.type,
                 header.session_id, header.step, exc)
        await self._hub.publish(header.pipeline_id, header.reply_to,
                                pb.Event(error=err, request_id=header.request_id,
                                         session_id=header.session_id))

    # -- execution --------------------------------------------------------------------------

    def _execute(self, h: FrameHeader, tensors: dict[str, Any],
                 shapes: tuple[tuple[int, ...], ...]) -> dict[str, Any]:
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
            self._loop = asyncio.get_running_loop()
            self._egress = asyncio.Queue(maxsize=QUEUE_DEPTH)
            self._egress_task = self._loop.create_task(self._egress_loop(self._egress),
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
                if not (self._inline_ok and _ready_on_host(outputs)):
                    outputs = await loop.run_in_executor(self._pool, _to_host, outputs)
                await self._emit(header, outputs)
            except Exception as exc:  # noqa: BLE001 - the device computation itself failed
                await self._failed(header, exc)
            finally:
                self._egress_busy = False
                self._done_one()

    async def _emit(self, header: FrameHeader, outputs: dict[str, Any]) -> None:
        try:
            await self._forward(header, outputs)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, never raised
            await self._failed(header, exc)

    async def _forward(self, header: FrameHeader, outputs: dict[str, Any]) -> None:
        nxt = FrameHeader(header.pipeline_id, header.session_id, header.step,
                          self.spec.stage_index + 1, header.request_id, header.reply_to)
        if self.spec.next_hop:
            sender = self._peers.sender(self.spec.next_hop)
            try:
                await sender.send_frame(split_frame(nxt, outputs), timeout=SEND_TIMEOUT_S)
            except TransportError as exc:
                raise TransportError(f"stage {self.spec.stage_index} could not forward to stage "
                                     f"{self.spec.stage_index + 1} at {self.spec.next_hop}: "
                                     f"{exc}") from None
        else:
            for event in result_events(nxt, outputs):
                await self._hub.publish(header.pipeline_id, header.reply_to, event)
        self.frames_done += 1

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

    def stop(self) -> None:
        """Send the queued frames, end the egress task and drop the sessions (from a thread)."""
        async def end_egress() -> None:
            if self._egress is not None and self._egress_task is not None:
                await self._egress.put(None)
                await self._egress_task
        _call_in_loop(self._loop, end_egress, timeout=10)
        dropped = self._sessions.drop_stage(self.stage_id)
        if dropped:
            log.info("stage %s unloaded with %d live sessions", self.stage_id, dropped)
