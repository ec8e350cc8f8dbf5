"""The running side of a worker: stage executors, their egress, and the coordinator subscriptions.

Per loaded stage, frames flow:

    Push stream thread: check, run -> [egress queue] -> egress thread -> next hop / subscriber

The thread that reads the Push stream dispatches the compiled stage itself (JAX returns at once,
the device computes) and goes on to the next frame; the egress thread waits for the result, turns
it into bytes (the only host copy) and sends it on. So a stage computes frame n+1 while frame n
is still on the wire, with one thread handoff per hop (each handoff costs ~16 us of context
switches on these machines; an earlier design with a separate executor thread paid for two).
The egress queue is bounded: a slow consumer blocks the Push stream, and gRPC's flow control
pushes back to the producer instead of growing memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jaxdist.errors import JaxdistError, TransportError
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc
from jaxdist.stage import WorkerStage
from jaxdist.transport import status
from jaxdist.transport.channel import FrameSender, make_channel
from jaxdist.transport.frames import FrameHeader, result_events, split_frame

from jaxdist.worker.sessions import Session, SessionStore

__all__ = ["Hub", "PeerPool", "StageRuntime", "remote_error"]

log = logging.getLogger(__name__)

QUEUE_DEPTH = 32  # frames buffered per stage, each way


def remote_error(exc: BaseException, *, stage: int, address: str) -> pb.RemoteError:
    """Describe an exception for the coordinator (status code, class, message, traceback)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return pb.RemoteError(code=status.code_for(exc).name, type=type(exc).__name__,
                          message=str(exc), traceback=tb, stage=stage, address=address)


class Hub:
    """Subscriptions of coordinators, by ``(pipeline_id, reply_to)``.

    Results of a last stage and errors of any stage on this worker are published here and
    streamed to the coordinator that subscribed, with heartbeats in between.
    """

    def __init__(self, max_pending: int = 1024) -> None:
        self._subs: dict[tuple[str, str], queue.Queue[pb.Event | None]] = {}
        self._lock = threading.Lock()
        self._max_pending = max_pending

    def open(self, pipeline_id: str, reply_to: str) -> queue.Queue[pb.Event | None]:
        q: queue.Queue[pb.Event | None] = queue.Queue(maxsize=self._max_pending)
        with self._lock:
            old = self._subs.get((pipeline_id, reply_to))
            self._subs[(pipeline_id, reply_to)] = q
        if old is not None:
            old.put(None)
        return q

    def close(self, pipeline_id: str, reply_to: str, q: queue.Queue[pb.Event | None]) -> None:
        with self._lock:
            if self._subs.get((pipeline_id, reply_to)) is q:
                del self._subs[(pipeline_id, reply_to)]

    def publish(self, pipeline_id: str, reply_to: str, event: pb.Event) -> bool:
        """Deliver an event; False (logged) when nobody listens. Blocks while the queue is full."""
        with self._lock:
            q = self._subs.get((pipeline_id, reply_to))
        if q is None:
            log.warning("no subscriber for pipeline %s reply_to %r; dropped %s", pipeline_id,
                        reply_to, event.WhichOneof("kind"))
            return False
        try:
            q.put(event, timeout=30)
        except queue.Full:
            log.warning("subscriber of pipeline %s is not reading; dropped an event", pipeline_id)
            return False
        return True

    def shutdown(self) -> None:
        with self._lock:
            subs = list(self._subs.values())
            self._subs.clear()
        for q in subs:
            q.put(None)


class PeerPool:
    """One long-lived frame stream per next-hop address, shared by the stages of this worker."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (),
                 credentials: Any = None) -> None:
        self._senders: dict[str, FrameSender] = {}
        self._channels: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._metadata = metadata
        self._credentials = credentials

    def sender(self, address: str) -> FrameSender:
        with self._lock:
            s = self._senders.get(address)
            if s is None or s.error is not None:
                if s is not None:
                    s.close(cancel=True)
                channel = self._channels.get(address)
                if channel is None:
                    channel = make_channel(address, credentials=self._credentials)
                    self._channels[address] = channel
                s = FrameSender(pb_grpc.WorkerStub(channel), address, metadata=self._metadata,
                                max_pending=QUEUE_DEPTH)
                self._senders[address] = s
            return s

    def close(self) -> None:
        with self._lock:
            senders, channels = list(self._senders.values()), list(self._channels.values())
            self._senders.clear()
            self._channels.clear()
        for s in senders:
            s.close()
        for c in channels:
            c.close()


class StageRuntime:
    """A loaded stage with its executor and egress threads.

    Args:
        stage: the compiled stage.
        stage_id: unique id of this stage deployment.
        pipeline_id: the pipeline it belongs to.
        sessions: the worker's session store.
        hub: where results (last stage) and errors go.
        peers: streams to next hops.
        address: this worker's address, for error reports.
    """

    def __init__(self, stage: WorkerStage, *, stage_id: str, pipeline_id: str,
                 sessions: SessionStore, hub: Hub, peers: PeerPool, address: str,
                 on_idle: Callable[[], None] | None = None) -> None:
        self.stage = stage
        self.spec = stage.spec
        self.stage_id = stage_id
        self.pipeline_id = pipeline_id
        self._sessions = sessions
        self._hub = hub
        self._peers = peers
        self._address = address
        self._egress: queue.Queue[tuple[FrameHeader, dict[str, Any]] | None] = \
            queue.Queue(maxsize=QUEUE_DEPTH)
        self._stateful = bool(self.spec.state)
        self.frames_done = 0
        self._inflight = 0
        self._inflight_lock = threading.Condition()
        self._egress_thread = threading.Thread(target=self._egress_loop,
                                               name=f"egress-{stage_id}", daemon=True)
        self._egress_thread.start()

    # -- ingress ----------------------------------------------------------------------------

    def process(self, header: FrameHeader, tensors: dict[str, Any],
                shapes: tuple[tuple[int, ...], ...] | None = None) -> None:
        """Run one frame in the calling thread and queue its outputs for egress.

        Blocks while the egress queue is full (back-pressure on the stream). Failures are
        reported to the coordinator, never raised.
        """
        with self._inflight_lock:
            self._inflight += 1
        try:
            outputs = self._execute(header, tensors, shapes)
        except Exception as exc:  # every failure of a frame goes back to the coordinator
            if not isinstance(exc, JaxdistError):
                log.exception("stage %d failed on a frame", self.spec.stage_index)
            self.report(header, exc)
            self._done_one()
            return
        self._egress.put((header, outputs))

    def report(self, header: FrameHeader, exc: BaseException) -> None:
        """Send an error for a frame to the coordinator subscribed on this worker."""
        err = remote_error(exc, stage=self.spec.stage_index, address=self._address)
        log.info("stage %d: %s for session %r step %d: %s", self.spec.stage_index, err.type,
                 header.session_id, header.step, exc)
        self._hub.publish(header.pipeline_id, header.reply_to,
                          pb.Event(error=err, request_id=header.request_id,
                                   session_id=header.session_id))

    # -- execution --------------------------------------------------------------------------

    def _execute(self, h: FrameHeader, tensors: dict[str, Any],
                 shapes: tuple[tuple[int, ...], ...] | None) -> dict[str, Any]:
        if not self._stateful:
            outputs, _ = self.stage.run(tensors, shapes=shapes)
            return outputs
        sess = self._sessions.take(self.stage_id, h.session_id, h.step)
        state = sess.state if sess is not None else self.stage.init_state()
        if sess is not None:
            sess.state = {}  # donated below: never leave dangling buffers in the store
        try:
            outputs, new_state = self.stage.run(tensors, state, shapes=shapes)
        except Exception:
            if sess is not None:  # the state may be donated already: the session is lost
                self._sessions.end(h.session_id, [self.stage_id])
            raise
        self._sessions.put(self.stage_id, h.session_id,
                           Session(new_state, h.step, self.spec.state_bytes))
        return outputs

    # -- egress -----------------------------------------------------------------------------

    def _egress_loop(self) -> None:
        while True:
            item = self._egress.get()
            if item is None:
                return
            header, outputs = item
            try:
                self._forward(header, outputs)
            except Exception as exc:
                self.report(header, exc)
            finally:
                self._done_one()

    def _forward(self, header: FrameHeader, outputs: dict[str, Any]) -> None:
        nxt = FrameHeader(header.pipeline_id, header.session_id, header.step,
                          self.spec.stage_index + 1, header.request_id, header.reply_to)
        if self.spec.next_hop:
            sender = self._peers.sender(self.spec.next_hop)
            try:
                for msg in split_frame(nxt, outputs):
                    sender.send(msg, timeout=60)
            except TransportError as exc:
                raise TransportError(f"stage {self.spec.stage_index} could not forward to stage "
                                     f"{self.spec.stage_index + 1} at {self.spec.next_hop}: "
                                     f"{exc}") from None
        else:
            for event in result_events(nxt, outputs):
                self._hub.publish(header.pipeline_id, header.reply_to, event)
        self.frames_done += 1

    def _done_one(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1
            self._inflight_lock.notify_all()

    # -- lifecycle --------------------------------------------------------------------------

    def drain(self, timeout: float) -> bool:
        """Wait until every submitted frame has left the stage. True when drained."""
        deadline = time.monotonic() + timeout
        with self._inflight_lock:
            while self._inflight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._inflight_lock.wait(left)
        return True

    def stop(self) -> None:
        self._egress.put(None)
        self._egress_thread.join(timeout=10)
        dropped = self._sessions.drop_stage(self.stage_id)
        if dropped:
            log.info("stage %s unloaded with %d live sessions", self.stage_id, dropped)

