"""Streams and frames bounded per worker (#15 item 2, #33 item 6): streams per owner (a
pipeline whose key they prove, else their host), idle ones closed for their owner's new ones,
bytes of frames being received across all streams, and a timeout on a frame begun and never
finished. A real worker process on loopback port 0, raw gRPC streams and raw data connections.
"""

from __future__ import annotations

import asyncio
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from models import identity

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.pipeline import Pipeline
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core.errors import LimitError, TransportError
from jaxdist.core.transport import hop, stream
from jaxdist.core.transport.client import WorkerClient
from jaxdist.core.transport.frames import FrameHeader, split_frame
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.runtime import Hub

MIB = 1 << 20
GIB = 1 << 30
STREAMS = 6      # --max-streams-per-peer
INFLIGHT = 8 * MIB  # --max-inflight-bytes
IDLE_S = 1.5     # --frame-idle-timeout of the `stalling` worker
PER_SUBSCRIBER = 80 * MIB  # --max-subscriber-bytes of the `queued` worker
QUEUED = 96 * MIB  # --max-queued-event-bytes of the `queued` worker
DEADLINE_S = 300.0  # a hang guard on each wait, not a timing assumption


class Deployed:
    """A worker, a shared one-stage identity pipeline on it, and raw access."""

    def __init__(self, extra_args: list[str], lease_s: float = 0) -> None:
        (self.worker,) = spawn_workers(1, extra_args=extra_args)
        self.cluster = Cluster.connect([self.worker.address], lease_s=lease_s)
        self.pipe: Pipeline = self.cluster.deploy(identity(1), stages=1)
        self.client = WorkerClient(self.worker.address)
        self.channel = grpc.insecure_channel(self.worker.address)
        self.push = self.channel.stream_unary("/jaxdist.v1.Worker/Push",
                                              request_serializer=lambda b: b,
                                              response_deserializer=pb.PushAck.FromString)

    def info(self) -> pb.InfoReply:
        return self.client.info()

    def close(self) -> None:
        self.channel.close()
        self.client.close()
        self.cluster.close()
        stop_workers([self.worker])

    def __enter__(self) -> Deployed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def bounded() -> Iterator[Deployed]:
    with Deployed(["--max-streams-per-peer", str(STREAMS), "--max-frame-bytes", str(6 * MIB),
                   "--max-inflight-bytes", str(INFLIGHT)]) as d:
        yield d


@pytest.fixture(scope="module")
def stalling() -> Iterator[Deployed]:
    with Deployed(["--frame-idle-timeout", str(IDLE_S)]) as d:
        yield d


@pytest.fixture(scope="module")
def roomy() -> Iterator[Deployed]:
    """Frames of up to 1 GiB (the default --max-frame-bytes), a budget of just over one such
    frame in flight, and no stall timeout within a test."""
    with Deployed(["--max-inflight-bytes", str(GIB + 16 * MIB),
                   "--frame-idle-timeout", "3600"]) as d:
        yield d


@pytest.fixture(scope="module")
def queued() -> Iterator[Deployed]:
    with Deployed(["--max-subscriber-bytes", str(PER_SUBSCRIBER),
                   "--max-queued-event-bytes", str(QUEUED)]) as d:
        yield d


def _poll_info(d: Deployed, what: str, ready: Any) -> pb.InfoReply:
    """Info, asked every 50 ms until ``ready(info)``, within DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready(info := d.info()):
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)
    return info


class Events:
    """A subscription of our own to a pipeline, read in a thread into a queue."""

    def __init__(self, d: Deployed, pipeline_id: str) -> None:
        self.reply_to = f"limits-{uuid.uuid4().hex}"
        self.pipeline_id = pipeline_id
        self.call = d.client.subscribe(pipeline_id, self.reply_to)
        self.items: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for view in self.call:
                self.items.put(view)
        except grpc.RpcError as exc:
            self.items.put(exc)

    def first(self) -> Any:
        """The first event: the greeting heartbeat, or the error that ended the call."""
        return self.items.get(timeout=60)

    def answer(self, request_id: int) -> Any:
        """The result view or the error event of one frame (heartbeats skipped)."""
        while True:
            item = self.items.get(timeout=120)
            assert not isinstance(item, BaseException), item
            if item.result is not None and item.result.msg.request_id == request_id:
                return item
            if item.msg.WhichOneof("kind") == "error" and item.msg.request_id == request_id:
                return item.msg

    def close(self) -> None:
        self.call.cancel()


def _frame(events: Events, request_id: int, x: np.ndarray) -> list[bytes]:
    header = FrameHeader(events.pipeline_id, "", 0, 0, request_id, events.reply_to)
    return list(split_frame(header, {"x": x}, chunk_bytes=MIB))


def _wait_info(d: Deployed, ready: Any, call: Any = None) -> pb.InfoReply:
    """Info, asked again until ``ready(info)``; each ask is a call to the worker."""
    while not ready(info := d.info()):
        assert call is None or not call.done(), call.exception()
    return info


def test_streams_are_bounded_per_peer_host(bounded: Deployed) -> None:
    """One host's Subscribe, Push and data connections that prove no pipeline's key (here a
    pipeline without one, as `jaxdist deploy` pins) share --max-streams-per-peer; past it each
    is refused naming the flag, Info answers throughout, and a closed stream frees its place."""
    subs: list[Events] = []
    try:
        # The cluster's own events and frames connections, from this host too (each is
        # counted once the worker's side of it has begun, so it is waited for).
        assert set(bounded.pipe.links.values()) == {"tcp"}
        held = _wait_info(bounded, lambda i: i.streams >= 2).streams
        assert held == 2
        for _ in range(STREAMS - held):
            subs.append(Events(bounded, "no-such-pipeline"))
            assert not isinstance(subs[-1].first(), BaseException)
        assert bounded.info().streams == STREAMS
        extra = Events(bounded, "no-such-pipeline")
        refused = extra.first()
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (f"Subscribe of host 127.0.0.1: it holds {STREAMS} streams (Push, Subscribe "
                f"and data connections) open on this worker, the limit "
                f"(--max-streams-per-peer={STREAMS})") in refused.details()
        with pytest.raises(grpc.RpcError) as push:
            bounded.push(iter([b""]), timeout=60)
        assert push.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Push of host 127.0.0.1: it holds" in push.value.details()
        said = asyncio.run(_data_connection(bounded, b""))
        assert isinstance(said, LimitError)
        assert "data connection of host 127.0.0.1" in str(said)
        assert f"(--max-streams-per-peer={STREAMS})" in str(said)
        # A closed stream gives its place back.
        subs.pop().close()
        _wait_info(bounded, lambda i: i.streams < STREAMS)
        subs.append(Events(bounded, "no-such-pipeline"))
        assert not isinstance(subs[-1].first(), BaseException)
    finally:
        for s in subs:
            s.close()
    _wait_info(bounded, lambda i: i.streams == held)
    x = np.ones((4, 8), np.float32)
    np.testing.assert_array_equal(bounded.pipe.call(x=x, timeout=60)["x"], x)


def test_frames_being_received_are_bounded_together(bounded: Deployed) -> None:
    """Two frames of 5 MiB each, the first stalled after 4 MiB: the second's fifth MiB would
    make 9 MiB in flight, over --max-inflight-bytes (8 MiB), and the second is refused on its
    subscription naming the flag (what counts is what arrived); the first then completes."""
    events = Events(bounded, bounded.pipe.pipeline_id)
    release = threading.Event()
    try:
        assert not isinstance(events.first(), BaseException)
        big = np.arange(5 * MIB // 4, dtype=np.float32).reshape(5, -1)
        first = _frame(events, 1, big)
        assert len(first) == 5

        def most_then_rest() -> Iterator[bytes]:
            yield from first[:4]
            release.wait()
            yield from first[4:]

        a = bounded.push.future(most_then_rest(), timeout=120)
        _wait_info(bounded, lambda i: i.inflight_bytes >= 4 * MIB, a)
        second = _frame(events, 2, big + 1)
        b = bounded.push.future(iter(second), timeout=120)
        refused = events.answer(2)
        assert refused.error.code == "RESOURCE_EXHAUSTED"
        assert (f"the frames being received by this worker hold {8 * MIB} bytes; "
                f"{MIB} more would pass the limit of {INFLIGHT} (--max-inflight-bytes)"
                ) in refused.error.message
        assert b.result(timeout=60).frames == 5  # a refused frame does not end its stream
        release.set()
        done = events.answer(1)
        assert done.result is not None
        assert a.result(timeout=60).frames == len(first)
    finally:
        release.set()
        events.close()
    assert _wait_info(bounded, lambda i: i.inflight_bytes == 0).inflight_bytes == 0


def test_a_frame_begun_and_not_finished_ends_its_stream(stalling: Deployed) -> None:
    """A Push stream that sends part of a frame, then nothing: after --frame-idle-timeout the
    frame is refused on its subscription, the stream ends RESOURCE_EXHAUSTED, and what it held
    is freed."""
    events = Events(stalling, stalling.pipe.pipeline_id)
    release = threading.Event()
    try:
        assert not isinstance(events.first(), BaseException)
        msgs = _frame(events, 7, np.ones((2, MIB // 4), np.float32))
        assert len(msgs) == 2

        def part() -> Iterator[bytes]:
            yield msgs[0]
            release.wait()

        call = stalling.push.future(part(), timeout=120)
        refused = events.answer(7)
        assert refused.error.code == "RESOURCE_EXHAUSTED"
        assert (f"frame of session '' step 0 began, then nothing more arrived for {IDLE_S:g} s "
                f"(--frame-idle-timeout)") in refused.error.message
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=60)
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--frame-idle-timeout" in ended.value.details()
    finally:
        release.set()
        events.close()
    assert stalling.info().inflight_bytes == 0
    x = np.ones((4, 8), np.float32)
    np.testing.assert_array_equal(stalling.pipe.call(x=x, timeout=60)["x"], x)


def test_a_data_connection_message_begun_and_not_finished_is_closed(stalling: Deployed) -> None:
    """On the data port: a message's length and one byte of its 2 MiB, then nothing: after
    --frame-idle-timeout the worker says why and closes the connection."""
    said = asyncio.run(_data_connection(stalling, (2 * MIB).to_bytes(4, "little") + b"\0"))
    assert isinstance(said, LimitError)
    # Counted as it arrives: the part being read (1 MiB), not the 2 MiB declared
    assert (f"a message began, then nothing more of it arrived for {IDLE_S:g} s "
            f"(--frame-idle-timeout); the connection is closed and the "
            f"{stream.READ_STEP_BYTES} bytes it held are freed") in str(said)
    assert stalling.info().inflight_bytes == 0


def _declaring(events: Events, request_id: int, sent: int, names: tuple[str, ...] = ("x",)
               ) -> bytes:
    """The first message of a frame whose tensors each declare 1 GiB (float32 ``(1, 256 Mi)``)
    and bring their first ``sent`` bytes."""
    tensors = [pb.Tensor(name=name, dtype=pb.F32, shape=[1, GIB // 4], data=bytes(sent),
                         offset=0, total_bytes=GIB) for name in names]
    return pb.Frame(pipeline_id=events.pipeline_id, reply_to=events.reply_to,
                    request_id=request_id, tensors=tensors).SerializeToString()


def test_a_frame_counts_the_bytes_it_sent_not_the_size_it_declared(roomy: Deployed) -> None:
    """Three Push streams each begin a frame declaring a 1 GiB tensor and send 1 MiB of it,
    then stall: together they hold 3 MiB of the ~1 GiB --max-inflight-bytes (and of the
    worker's memory), not 3 GiB, so whole frames still go through beside them. The declared
    sizes are still checked up front: a frame whose tensors declare 2 GiB, over
    --max-frame-bytes, is refused before its bytes arrive."""
    events = Events(roomy, roomy.pipe.pipeline_id)
    release = threading.Event()
    calls = []
    try:
        assert not isinstance(events.first(), BaseException)
        before = _poll_info(roomy, "nothing in flight", lambda i: i.inflight_bytes == 0)

        def stalled(request_id: int) -> Iterator[bytes]:
            yield _declaring(events, request_id, MIB)
            release.wait()

        for n in (1, 2, 3):
            calls.append(roomy.push.future(stalled(n), timeout=DEADLINE_S))
            info = _poll_info(roomy, f"{n} MiB in flight", lambda i, n=n: i.inflight_bytes >= n * MIB)
            assert info.inflight_bytes == n * MIB  # what arrived, not the 1 GiB declared
        # 3 GiB declared and 3 MiB written: the buffers' untouched pages cost nothing (a
        # margin of 256 MiB for whatever else the worker allocates meanwhile).
        assert info.rss_bytes - before.rss_bytes < 256 * MIB, (info.rss_bytes, before.rss_bytes)
        # The rest of the budget serves whole frames: 16 MiB, and another 1 GiB declaration.
        x = np.arange(4 * MIB, dtype=np.float32).reshape(4, -1)
        np.testing.assert_array_equal(roomy.pipe.call(x=x, timeout=DEADLINE_S)["x"], x)
        calls.append(roomy.push.future(stalled(4), timeout=DEADLINE_S))
        _poll_info(roomy, "4 MiB in flight", lambda i: i.inflight_bytes == 4 * MIB)
        # A declared size over the frame limit is refused before its bytes arrive.
        over = roomy.push.future(iter([_declaring(events, 9, 16, ("x", "y"))]),
                                 timeout=DEADLINE_S)
        refused = events.answer(9)
        assert refused.error.code == "RESOURCE_EXHAUSTED"
        assert (f"is over the frame size limit (--max-frame-bytes={GIB}): its tensors declare "
                f"{2 * GIB} bytes so far") in refused.error.message
        assert over.result(timeout=DEADLINE_S).frames == 1
        assert roomy.info().inflight_bytes == 4 * MIB
    finally:
        release.set()
        events.close()
    for call in calls:  # each stream ends with its frame half sent: what it held is freed
        assert call.result(timeout=DEADLINE_S).frames == 1
    _poll_info(roomy, "nothing in flight", lambda i: i.inflight_bytes == 0)


def test_a_data_connection_message_counts_what_arrived(roomy: Deployed) -> None:
    """On the data port, a message declaring 200 MiB of which 10 bytes arrived holds one
    read step (1 MiB, the part being read), not 200 MiB; closing the connection frees it."""
    async def main() -> None:
        port = (await asyncio.to_thread(roomy.info)).data_port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await stream.client_handshake(reader, writer, key=None, peer=f"127.0.0.1:{port}")
            writer.write((200 * MIB).to_bytes(4, "little") + bytes(10))
            await writer.drain()
            info = await asyncio.to_thread(
                _poll_info, roomy, "a message part in flight", lambda i: i.inflight_bytes > 0)
            assert info.inflight_bytes == stream.READ_STEP_BYTES
        finally:
            writer.close()

    asyncio.run(main())
    _poll_info(roomy, "nothing in flight", lambda i: i.inflight_bytes == 0)


def _flood(d: Deployed, reply_to: str, request_ids: range) -> None:
    """Frames whose results (1 MiB each) go to ``reply_to``, on one Push stream; returns once
    the stage has published them all (its frame count)."""
    stage = next(s for s in d.info().stages if s.pipeline_id == d.pipe.pipeline_id)
    x = np.ones((1, MIB // 4), np.float32)
    msgs = [m for i in request_ids for m in split_frame(
        FrameHeader(d.pipe.pipeline_id, "", 0, 0, i, reply_to), {"x": x}, chunk_bytes=MIB)]
    assert d.push(iter(msgs), timeout=DEADLINE_S).frames == len(msgs)
    _poll_info(d, f"{len(request_ids)} results published", lambda i: any(
        s.pipeline_id == d.pipe.pipeline_id and s.frames >= stage.frames + len(request_ids)
        for s in i.stages))


def test_subscribers_that_do_not_read_are_bounded_together(queued: Deployed) -> None:
    """Two subscribers that do not read, each under --max-subscriber-bytes (80 MiB), pass
    --max-queued-event-bytes (96 MiB) together: the one holding the most is dropped, its stream
    ending RESOURCE_EXHAUSTED naming the flag; the other keeps its events, and the pipeline's
    own caller is served throughout.

    70 results of 1 MiB go to the first, then 70 to the second. Whatever gRPC and the sockets
    buffer on the way (a few MiB a stream) leaves the first holding over half the bound when
    the second's events pass it, so the first is the one dropped."""
    pipeline_id = queued.pipe.pipeline_id
    first = queued.client.subscribe(pipeline_id, "silent-1")
    second = queued.client.subscribe(pipeline_id, "silent-2")
    try:
        for sub in (first, second):  # the greeting: subscribed; then neither reads
            assert next(sub).msg.WhichOneof("kind") == "heartbeat"
        _flood(queued, "silent-1", range(1, 71))
        _flood(queued, "silent-2", range(101, 171))
        x = np.ones((4, 8), np.float32)
        np.testing.assert_array_equal(queued.pipe.call(x=x, timeout=DEADLINE_S)["x"], x)
        # The first gets what gRPC had buffered for it, then the error: its queue was cleared
        got, dropped = 0, None
        try:
            for view in first:
                got += view.result is not None
                if got == 70:
                    break
        except grpc.RpcError as exc:
            dropped = exc
        assert dropped is not None, "all 70 results reached the first: it was not dropped"
        assert dropped.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = dropped.details() or ""
        assert f"the subscriber of pipeline {pipeline_id} is not reading" in details
        assert "the most of any subscription" in details
        assert (f"would pass the bound of {QUEUED} bytes (--max-queued-event-bytes"
                in details), details
        # The second lost nothing: every one of its results arrives (between heartbeats).
        results: set[int] = set()
        deadline = time.monotonic() + DEADLINE_S
        for view in second:
            if view.result is not None:
                results.add(view.result.msg.request_id)
            if len(results) == 70 or time.monotonic() > deadline:
                break
        assert results == set(range(101, 171))
    finally:
        first.cancel()
        second.cancel()
    np.testing.assert_array_equal(queued.pipe.call(x=x, timeout=DEADLINE_S)["x"], x)


async def _data_connection(d: Deployed, data: bytes) -> Exception | None:
    """Handshake on the worker's data port, write ``data``, and read what the worker says
    before it closes."""
    port = d.info().data_port
    address = f"127.0.0.1:{port}"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await stream.client_handshake(reader, writer, key=None, peer=address)
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(60):  # a bound on the test, not the assertion
            said = await stream.read_status(reader, address)
            assert await reader.read() == b""
        return said
    finally:
        writer.close()


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-frame-bytes", "4M", "--max-inflight-bytes", "1M"],
     "--max-inflight-bytes (1000000) must be >= --max-frame-bytes (4000000)"),
    (["--max-artifact-bytes", "4M", "--max-upload-bytes", "1M"],
     "--max-upload-bytes (1000000) must be >= --max-artifact-bytes (4000000)"),
    (["--max-subscriber-bytes", "4M", "--max-queued-event-bytes", "1M"],
     "--max-queued-event-bytes (1000000) must be >= --max-subscriber-bytes (4000000)"),
])
def test_error_an_aggregate_bound_below_its_single_bound(flags: list[str], message: str) -> None:
    """A worker-wide bound smaller than the largest single item it counts is refused at start."""
    proc = subprocess.run([sys.executable, "-m", "jaxdist.worker", "--listen", "127.0.0.1:0",
                           *flags], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr


# -- the data port's idle bound on one timer (stream.IdleWatch) ---------------------------------


def _reader_with(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    return reader


def test_idle_watch_passes_reads_in_time_and_times_out_a_stalled_one() -> None:
    async def main() -> None:
        watch = stream.IdleWatch(0.2)
        reader = _reader_with(b"abcdef" * 100)
        try:
            for _ in range(100):  # each read in time, on the one timer
                assert await watch.read(reader, 6) == b"abcdef"
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError, match=r"no data for 0\.2 s"):
                await watch.read(reader, 1)  # nothing more arrives
            assert loop.time() - started >= 0.2
            reader.feed_data(b"z")  # the connection's task goes on after the timeout
            assert await watch.read(reader, 1) == b"z"
        finally:
            watch.close()

    asyncio.run(main())


def test_idle_watch_lets_an_outside_cancel_through() -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def reading() -> None:
            watch = stream.IdleWatch(30.0)
            try:
                started.set()
                await watch.read(asyncio.StreamReader(), 4)
            finally:
                watch.close()

        task = asyncio.get_running_loop().create_task(reading())
        await started.wait()
        await asyncio.sleep(0)  # let it reach the read
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_read_message_with_a_watch_bounds_a_stalled_message() -> None:
    async def main() -> None:
        watch = stream.IdleWatch(0.1)
        msg = b"x" * 64
        try:
            reader = _reader_with(len(msg).to_bytes(4, "little") + msg)
            assert await stream.read_message(reader, 1 << 20, "test", watch=watch) == msg
            reader.feed_data(len(msg).to_bytes(4, "little") + msg[:10])  # then nothing
            with pytest.raises(TimeoutError):
                await stream.read_message(reader, 1 << 20, "test", watch=watch)
            reader.feed_eof()
        finally:
            watch.close()
        closed = _reader_with(b"")
        closed.feed_eof()
        assert await stream.read_message(closed, 1 << 20, "test") is None  # closed between
        torn = _reader_with(b"\x05\x00")
        torn.feed_eof()
        with pytest.raises(TransportError, match="inside a message's length"):
            await stream.read_message(torn, 1 << 20, "test")

    asyncio.run(main())


# -- the subscriptions' aggregate bound on its own (runtime.Hub) --------------------------------


def test_hub_drops_the_subscription_holding_the_most_past_the_total() -> None:
    """Past the hub's total, the subscription holding the most goes, whichever one's event
    passed it; a subscription that reads (and holds little) keeps going. Ending a stream gives
    back what still waited for it."""
    async def main() -> None:
        hub = Hub(max_events=100, max_bytes=60, max_total_bytes=100)
        silent, reader, other = (hub.open("p", name) for name in ("silent", "reader", "other"))
        for _ in range(6):
            assert hub.publish("p", "silent", b"x" * 10)  # 60: its own bound, not passed
        for _ in range(3):
            assert hub.publish("p", "other", b"y" * 10)
        assert hub.queued == 90
        # The reader's event passes the total: the silent one, holding the most, is dropped.
        assert hub.publish("p", "reader", b"z" * 20)
        assert silent.dropped is not None and reader.dropped is None and other.dropped is None
        assert ("the subscriber of pipeline p is not reading: 6 events (60 bytes) wait, the "
                "most of any subscription, and the events waiting for all subscriptions on "
                "this worker would pass the bound of 100 bytes (--max-queued-event-bytes; 90 "
                "held, 20 more); dropped it, freeing 60 bytes") == silent.dropped
        assert await silent.get() is None
        assert hub.queued == 50
        assert await reader.get() == b"z" * 20  # it reads: its bytes go back
        assert hub.queued == 30
        # The one whose event would pass holds the most itself: it is the one dropped.
        assert hub.publish("p", "other", b"y" * 25)  # other 55, reader 0: 55
        assert hub.publish("p", "reader", b"z" * 45)  # 100
        assert not hub.publish("p", "other", b"y" * 5)  # other would hold 60 of 105
        assert other.dropped is not None and "the most of any subscription" in other.dropped
        assert reader.dropped is None and hub.queued == 45
        hub.close("p", "reader", reader)  # its stream ended with an event unread
        hub.close("p", "silent", silent)
        hub.close("p", "other", other)
        assert hub.queued == 0

    asyncio.run(main())


OWNED_STREAMS = 4  # --max-streams-per-peer of the `owned` worker
OWNED_IDLE_S = 2.0  # its --frame-idle-timeout


@pytest.fixture(scope="module")
def owned() -> Iterator[Deployed]:
    """A pipeline with a key of its own (a leased pipeline, as Cluster.deploy makes), so its
    coordinator's streams prove that key and count under the pipeline, not the host."""
    with Deployed(["--max-streams-per-peer", str(OWNED_STREAMS),
                   "--frame-idle-timeout", str(OWNED_IDLE_S)], lease_s=30) as d:
        yield d


def _idle_push(d: Deployed, stop: threading.Event) -> Any:
    """A raw Push stream (no credential: counted under this host) that sends nothing."""
    def nothing() -> Iterator[bytes]:
        stop.wait()
        return
        yield b""

    return d.push.future(nothing(), timeout=DEADLINE_S)


def test_a_hosts_streams_do_not_keep_a_pipelines_streams_out(owned: Deployed) -> None:
    """Another client on the same host fills that host's --max-streams-per-peer: the keyed
    pipeline's own streams (its coordinator's, which prove its key) are counted apart, so it
    keeps serving and opens new streams; a stream claiming the pipeline with a wrong
    credential is refused, not counted under it."""
    pipe = owned.pipe
    assert pipe.key and set(pipe.links.values()) == {"tcp"}
    held = _wait_info(owned, lambda i: i.streams >= 2).streams
    assert held == 2  # the pipeline's events and frames connections
    subs = [Events(owned, "no-such-pipeline") for _ in range(OWNED_STREAMS)]
    try:
        for s in subs:
            assert not isinstance(s.first(), BaseException)
        refused = Events(owned, "no-such-pipeline").first()
        assert isinstance(refused, grpc.RpcError)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Subscribe of host 127.0.0.1: it holds 4 streams" in refused.details()
        x = np.ones((4, 8), np.float32)
        np.testing.assert_array_equal(pipe.call(x=x, timeout=60)["x"], x)
        # A new stream of the pipeline, proving its key, gets in past the full host.
        own = owned.client.subscribe(pipe.pipeline_id, f"own-{uuid.uuid4().hex}", pipe.key)
        assert next(iter(own)).msg.WhichOneof("kind") == "heartbeat"
        own.cancel()
        # A hop credential that is not the pipeline's opens nothing.
        forged = ((hop.PIPELINE_HEADER, pipe.pipeline_id.encode()),
                  (hop.CREDENTIAL_HEADER, bytes(32)))
        with pytest.raises(grpc.RpcError) as bad:
            owned.push(iter([b""]), metadata=forged, timeout=60)
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "is not that pipeline's" in bad.value.details()
    finally:
        for s in subs:
            s.close()
    _wait_info(owned, lambda i: i.streams == held)


def test_an_idle_stream_of_frames_is_closed_for_its_owners_new_one(owned: Deployed) -> None:
    """An owner at its limit opens another stream: its oldest stream of frames that has sent
    nothing for --frame-idle-timeout is closed for it, saying why; a Subscribe is never closed
    for room, and before any stream has been idle that long the new one is refused."""
    stop = threading.Event()
    held = _wait_info(owned, lambda i: i.streams >= 2).streams
    sub = Events(owned, "no-such-pipeline")
    pushes = []
    try:
        assert not isinstance(sub.first(), BaseException)
        for n in range(OWNED_STREAMS - 1):
            pushes.append(_idle_push(owned, stop))
            _wait_info(owned, lambda i, n=n: i.streams == held + 2 + n)
        # Full, and nothing idle long enough yet: refused at once, naming the flags.
        early = _idle_push(owned, stop)
        with pytest.raises(grpc.RpcError) as refused:
            early.result(timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--frame-idle-timeout" in refused.value.details()
        # Once the first Push has been idle long enough, a new one takes its place.
        deadline = time.monotonic() + DEADLINE_S
        while not pushes[0].done():
            assert time.monotonic() < deadline, "no idle stream was closed for the new one"
            late = _idle_push(owned, stop)
            threading.Event().wait(0.2)
            if not late.done():
                pushes.append(late)
        with pytest.raises(grpc.RpcError) as closed:
            pushes[0].result(timeout=60)
        assert closed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "closed: this Push stream sent nothing for" in closed.value.details()
        assert (f"(--frame-idle-timeout={OWNED_IDLE_S:g}) and host 127.0.0.1 opened another past "
                f"its limit of {OWNED_STREAMS} streams") in closed.value.details()
        assert not any(p.done() for p in pushes[1:])
        assert not any(isinstance(e, BaseException) for e in list(sub.items.queue))
        assert owned.info().streams == held + OWNED_STREAMS
    finally:
        stop.set()
        sub.close()
    _wait_info(owned, lambda i: i.streams == held)
