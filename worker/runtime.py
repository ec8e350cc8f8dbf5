"""The gRPC transport of a worker: the routes of its stages, and the coordinators' subscriptions.

All of it runs on the worker's data-plane event loop (one thread, see ``server.py``), which
serves the ``Push`` and ``Subscribe`` streams and writes the streams to next hops. The stages
themselves are :class:`jaxdist.core.runtime.StageRuntime`; each gets a :class:`GrpcRoute`:

* to the next stage: a ``Push`` stream of the route's own (over a channel :class:`PeerPool`
  shares per address), so a pipeline whose next hop stalls holds up only itself, never another
  pipeline that happens to use the same pair of workers;
* to the caller (results of the last stage, errors of any stage): the coordinator's
  subscription in the :class:`Hub`. Publishing never waits: a subscriber that lets more than
  its bound of events or bytes pile up, or that holds the most when the events waiting for all
  subscribers together would pass the worker's bound, is dropped with ``RESOURCE_EXHAUSTED``,
  which it sees, and the stage goes on serving everyone else.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxdist.core.errors import TransportError
from jaxdist.core.runtime import call_in_loop, remote_error
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport import hop, wire
from jaxdist.core.transport.channel import AsyncFrameSender, make_aio_channel
from jaxdist.core.transport.frames import FrameHeader, result_events, split_frame
from jaxdist.core.transport.security import ClientAuth
from jaxdist.core.transport.trust import PeerTrust, check_hop, peer_credentials
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.limits import OpenStream

__all__ = ["HEARTBEAT", "GrpcRoute", "Hub", "OpenSubscription", "PeerPool", "Subscription",
           "publish_failure"]

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 60.0  # a next hop that takes no frame for this long is reported as stuck
MAX_PENDING_EVENTS = 1024  # per subscription
MAX_PENDING_BYTES = 256 << 20  # per subscription
MAX_QUEUED_BYTES = 512 << 20  # all subscriptions together

HEARTBEAT = object()
"""Queued on an idle subscription; ``Subscribe`` sends a heartbeat event in its place."""


def _nbytes(event: Any) -> int:
    if isinstance(event, (bytes, bytearray, memoryview)):
        return len(event)
    size = getattr(event, "ByteSize", None)
    return int(size()) if size is not None else 0


@dataclass(frozen=True)
class OpenSubscription:
    """A checked ``SubscribeRequest`` and its stream's place in the worker's count
    (``WorkerServicer.open_subscription``)."""

    request: pb.SubscribeRequest
    stream: OpenStream


class Subscription:
    """The events waiting for one coordinator's ``Subscribe`` stream. Used on the loop only.

    Bounded by count and by bytes, and with every other subscription of its :class:`Hub` by
    the hub's total bytes. :meth:`put` never waits: past a bound the subscription is dropped
    (its queue cleared, :attr:`dropped` set) and the stream ends with that reason.
    """

    def __init__(self, pipeline_id: str, max_events: int, max_bytes: int,
                 hub: Hub | None = None) -> None:
        self.pipeline_id = pipeline_id
        self.dropped: str | None = None
        self._events: collections.deque[Any] = collections.deque()
        self._bytes = 0
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._hub = hub
        self._wake = asyncio.Event()
        self._ended = False

    @property
    def nbytes(self) -> int:
        """The bytes of the events waiting."""
        return self._bytes

    @property
    def waiting(self) -> int:
        """The events waiting."""
        return len(self._events)

    def put(self, event: Any) -> bool:
        """Queue an event; False when the subscription is dropped or ended."""
        if self.dropped is not None or self._ended:
            return False
        size = _nbytes(event)
        if len(self._events) >= self._max_events or self._bytes + size > self._max_bytes:
            self.drop(f"the subscriber of pipeline {self.pipeline_id} is not reading: "
                      f"{len(self._events)} events ({self._bytes} bytes) wait, past the "
                      f"worker's bound of {self._max_events} events or {self._max_bytes} bytes "
                      f"per subscription (--max-subscriber-events, --max-subscriber-bytes); "
                      f"dropped it")
            return False
        if self._hub is not None and not self._hub.make_room(self, size):
            return False  # this one was dropped
        self._events.append((event, size))
        self._bytes += size
        if self._hub is not None:
            self._hub.queued += size
        self._wake.set()
        return True

    def drop(self, why: str) -> None:
        """Drop the subscriber: clear its queue, and end its stream saying ``why``."""
        self.dropped = why
        log.warning("%s", why)
        self.release()
        self._wake.set()

    def release(self) -> None:
        """Give back what waits (the stream is gone, or dropped)."""
        if self._hub is not None:
            self._hub.queued -= self._bytes
        self._events.clear()
        self._bytes = 0

    def empty(self) -> bool:
        return not self._events

    def end(self) -> None:
        """End the stream after the events already queued."""
        self._ended = True
        self._wake.set()

    async def get(self) -> Any:
        """The next event; ``None`` once ended or dropped (see :attr:`dropped`)."""
        while not self._events:
            if self._ended or self.dropped is not None:
                return None
            self._wake.clear()
            await self._wake.wait()
        if self.dropped is not None:
            return None
        event, size = self._events.popleft()
        self._bytes -= size
        if self._hub is not None:
            self._hub.queued -= size
        return event


class Hub:
    """Subscriptions of coordinators, by ``(pipeline_id, reply_to)``. Used on the loop only,
    except :meth:`shutdown`.

    Results of a last stage and errors of any stage on this worker are published here and
    streamed to the coordinator that subscribed, with heartbeats in between.

    The events waiting for all subscriptions together are bounded too (``max_total_bytes``,
    ``--max-queued-event-bytes``): many subscribers that each stay under their own bound
    cannot hold more. When an event would pass it, the subscription holding the most bytes
    (this event counted with its own) is dropped, until the event fits: a subscriber that does
    not read loses its stream; one that reads, and so holds little, keeps going.
    """

    def __init__(self, max_events: int = MAX_PENDING_EVENTS,
                 max_bytes: int = MAX_PENDING_BYTES,
                 max_total_bytes: int = MAX_QUEUED_BYTES) -> None:
        self._subs: dict[tuple[str, str], Subscription] = {}
        self._open: set[Subscription] = set()  # opened and not closed (ended ones included)
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self.queued = 0  # bytes of the events waiting, all subscriptions
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, pipeline_id: str, reply_to: str) -> Subscription:
        self._loop = asyncio.get_running_loop()
        sub = Subscription(pipeline_id, self._max_events, self._max_bytes, self)
        self._open.add(sub)
        old = self._subs.get((pipeline_id, reply_to))
        self._subs[(pipeline_id, reply_to)] = sub
        if old is not None:
            old.end()
        return sub

    def subscribed(self, pipeline_id: str) -> bool:
        """Whether anyone subscribes to ``pipeline_id``'s results here (from any thread)."""
        return any(pid == pipeline_id for pid, _ in list(self._subs))

    def close(self, pipeline_id: str, reply_to: str, sub: Subscription) -> None:
        """``sub``'s stream is over: forget it, and give back what still waits for it."""
        if self._subs.get((pipeline_id, reply_to)) is sub:
            del self._subs[(pipeline_id, reply_to)]
        self._open.discard(sub)
        sub.release()

    def make_room(self, sub: Subscription, size: int) -> bool:
        """Make room for ``size`` more bytes of ``sub`` under ``max_total_bytes``, dropping the
        subscriptions that hold the most. False when ``sub`` itself was dropped."""
        while self.queued + size > self.max_total_bytes:
            victim = max(self._open, key=lambda s: (s.nbytes + (size if s is sub else 0),
                                                    s is sub), default=sub)
            if victim.nbytes == 0:
                victim = sub  # nothing to free elsewhere
            victim.drop(f"the subscriber of pipeline {victim.pipeline_id} is not reading: "
                        f"{victim.waiting} events ({victim.nbytes} bytes) wait, the most of "
                        f"any subscription, and the events waiting for all subscriptions on "
                        f"this worker would pass the bound of {self.max_total_bytes} bytes "
                        f"(--max-queued-event-bytes; {self.queued} held, {size} more); "
                        f"dropped it, freeing {victim.nbytes} bytes")
            if victim is sub:
                return False
        return True

    def publish(self, pipeline_id: str, reply_to: str, event: Any) -> bool:
        """Deliver an event without waiting; False (logged) when nobody listens or the
        subscriber was dropped for not reading."""
        sub = self._subs.get((pipeline_id, reply_to))
        if sub is None:
            log.warning("no subscriber for pipeline %r reply_to %r; dropped an event",
                        pipeline_id[:64], reply_to[:64])
            return False
        return sub.put(event)

    def shutdown(self) -> None:
        """End every subscription (from any thread)."""
        async def end_all() -> None:
            subs = list(self._subs.values())
            self._subs.clear()
            for sub in subs:
                sub.end()
        call_in_loop(self._loop, end_all, timeout=5)


def publish_failure(hub: Hub, header: FrameHeader, error: BaseException, *, stage: int,
                    address: str) -> None:
    """Tell a frame's caller, on its subscription, that the frame failed on ``stage`` here (the
    ``fail`` of every route on a worker)."""
    err = remote_error(error, stage=stage, address=address)
    hub.publish(header.pipeline_id, header.reply_to,
                pb.Event(error=err, request_id=header.request_id, session_id=header.session_id))


class PeerPool:
    """The channels of this worker to its stages' next hops, one per address, and the ``Push``
    streams open on them (one per pipeline edge, owned by its :class:`GrpcRoute`). Used on the
    loop only, except :meth:`close`.

    A channel is opened only to a hop the trust policy allows (``transport.trust.check_hop``),
    with the channel credentials it chooses for that hop (``transport.trust.peer_credentials``).
    A stream carries its pipeline's hop credential (``transport/hop.py``), never the token.
    """

    def __init__(self, auth: ClientAuth | None = None, trust: PeerTrust | None = None) -> None:
        self._streams: set[AsyncFrameSender] = set()
        self._channels: dict[str, Any] = {}
        self._auth = auth or ClientAuth()
        self._trust = trust or PeerTrust()
        self._loop: asyncio.AbstractEventLoop | None = None

    def open_stream(self, address: str, *, pipeline_id: str, key: bytes = b"",
                    stage: str = "") -> AsyncFrameSender:
        """A new ``Push`` stream to ``address`` for the frames of ``pipeline_id`` (whose key is
        ``key``; ``b""``: none), with its hop credential; :meth:`release` it when done.

        Raises:
            AuthError: the trust policy refuses ``address`` (``stage`` names the stage in the
                message); nothing is dialled.
        """
        self._loop = asyncio.get_running_loop()
        decision = check_hop(address, self._auth, self._trust, stage=stage or "a stage")
        channel = self._channels.get(address)
        if channel is None:
            channel = make_aio_channel(address,
                                       credentials=peer_credentials(decision, self._auth))
            self._channels[address] = channel
        metadata = hop.metadata(pipeline_id,
                                hop.credential(pipeline_id, key, self._auth.hmac_key))
        stream = AsyncFrameSender(wire.push_method(channel), address, metadata=metadata)
        self._streams.add(stream)
        return stream

    async def release(self, stream: AsyncFrameSender) -> None:
        """Finish a stream after the frames written to it."""
        self._streams.discard(stream)
        await stream.close()

    def close(self) -> None:
        """Finish every stream and close the channels (from any thread)."""
        async def close_all() -> None:
            streams = list(self._streams)
            channels = list(self._channels.values())
            self._streams.clear()
            self._channels.clear()
            for s in streams:
                await s.close()
            for c in channels:
                await c.close()
        call_in_loop(self._loop, close_all, timeout=10)


class GrpcRoute:
    """The :class:`~jaxdist.core.runtime.Route` of one stage on a worker: frames to the next
    hop's worker over a stream of this pipeline edge, results and errors to the subscriber.

    Args:
        spec: the stage's spec (its index, next hop and pipeline).
        pipeline_id: the pipeline the stage belongs to.
        hub: the worker's subscriptions.
        peers: the worker's streams to next hops.
        address: this worker's address, for error reports.
        key: the pipeline's key (``b""``: none), which its hop credential is made from.
    """

    wants_host = True
    kind = "grpc"

    def __init__(self, spec: StageSpec, *, pipeline_id: str, hub: Hub, peers: PeerPool,
                 address: str, key: bytes = b"") -> None:
        self._spec = spec
        self._pipeline_id = pipeline_id
        self._key = key
        self._hub = hub
        self._peers = peers
        self._address = address
        self._stream: AsyncFrameSender | None = None

    async def forward(self, header: FrameHeader, outputs: Mapping[str, Any]) -> None:
        spec = self._spec
        if spec.next_hop:
            sender = self._stream
            if sender is None or sender.error is not None:  # first frame, or the stream broke
                if sender is not None:
                    sender.cancel()
                    await self._peers.release(sender)
                sender = self._stream = self._peers.open_stream(
                    spec.next_hop, pipeline_id=self._pipeline_id, key=self._key,
                    stage=f"stage {spec.stage_index} of pipeline {self._pipeline_id[:64]}")
            try:
                await sender.send_frame(split_frame(header, outputs), timeout=SEND_TIMEOUT_S)
            except TransportError as exc:
                raise TransportError(f"stage {spec.stage_index} could not forward to stage "
                                     f"{spec.stage_index + 1} at {spec.next_hop}: {exc}") from None
            return
        for event in result_events(header, outputs):
            if not self._hub.publish(header.pipeline_id, header.reply_to, event):
                return  # nobody to read the rest (logged by the hub)

    async def fail(self, header: FrameHeader, error: BaseException) -> None:
        publish_failure(self._hub, header, error, stage=self._spec.stage_index,
                        address=self._address)

    async def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await self._peers.release(stream)
