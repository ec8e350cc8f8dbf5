"""Artifact uploads that stall or pile up (#15 item 2): they hold no thread and a bounded number
of bytes, and they end. A real worker process on loopback port 0 and raw gRPC streams.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import artifacts
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.proto import jaxdist_pb2_grpc as pb_grpc

UPLOAD_LIMIT = 3 << 20  # --max-upload-bytes
IDLE_S = 2.0            # --upload-idle-timeout


@pytest.fixture(scope="module")
def worker() -> Iterator[object]:
    (w,) = spawn_workers(1, extra_args=["--max-artifact-bytes", str(2 << 20),
                                        "--max-upload-bytes", str(UPLOAD_LIMIT),
                                        "--upload-idle-timeout", str(IDLE_S)])
    try:
        yield w
    finally:
        stop_workers([w])


def _stalled(release: threading.Event, first: bytes, total: int) -> Iterator[pb.ArtifactChunk]:
    """One chunk declaring ``total`` bytes, then nothing until ``release`` is set."""
    yield pb.ArtifactChunk(digest=artifacts.digest_of(first), data=first, total_bytes=total)
    release.wait()


def test_uploads_that_stall_hold_no_thread_and_end(worker) -> None:
    """More stalled uploads than the worker has control threads (64): Info still answers, and
    each stalled upload ends RESOURCE_EXHAUSTED, naming the flag, once it has sent nothing for
    --upload-idle-timeout."""
    release = threading.Event()
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        try:
            calls = [stub.UploadArtifact.future(_stalled(release, b"x", 1 << 20), timeout=120)
                     for _ in range(80)]
            assert stub.Info(pb.InfoRequest(), timeout=30).address == worker.address
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=120)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert (f"no data for {IDLE_S:g} s (--upload-idle-timeout); 1 bytes had "
                        f"arrived") in err.value.details()
        finally:
            release.set()
        # ... and what they held is given back: a whole upload under the limit goes through.
        data = b"\7" * (2 << 20)
        reply = stub.UploadArtifact(iter([pb.ArtifactChunk(
            digest=artifacts.digest_of(data), data=data, total_bytes=len(data))]), timeout=60)
        assert reply.size == len(data)


def test_unfinished_uploads_are_bounded_in_bytes_together(worker) -> None:
    """Two unfinished uploads of 2 MiB each would hold 4 MiB, over --max-upload-bytes (3 MiB):
    the second is refused naming the flag and the bytes held; the first then completes."""
    release = threading.Event()
    first = b"\1" * ((2 << 20) - 1)
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        started = threading.Event()

        def one_then_wait() -> Iterator[pb.ArtifactChunk]:
            yield pb.ArtifactChunk(digest=artifacts.digest_of(first + b"!"), data=first,
                                   total_bytes=len(first) + 1)
            started.set()
            release.wait()
            yield pb.ArtifactChunk(data=b"!")

        try:
            held = stub.UploadArtifact.future(one_then_wait(), timeout=120)
            assert started.wait(60)
            # The worker counts the first chunk once it has read it, which Info shows.
            while stub.Info(pb.InfoRequest(), timeout=30).upload_bytes < len(first):
                assert not held.done(), held.exception()
            second = b"\2" * (2 << 20)
            with pytest.raises(grpc.RpcError) as err:
                stub.UploadArtifact(iter([pb.ArtifactChunk(
                    digest=artifacts.digest_of(second), data=second,
                    total_bytes=len(second))]), timeout=60)
            code, details = err.value.code(), err.value.details() or ""
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (f"the uploads in progress on this worker hold {len(first)} bytes; "
                    f"{len(second)} more would pass the limit of {UPLOAD_LIMIT} "
                    f"(--max-upload-bytes)") in details
        finally:
            release.set()
        assert held.result(timeout=60).size == len(first) + 1

