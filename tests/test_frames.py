"""Frames on the data-plane streams: written from the arrays, read back as views, and still
plain protobuf ``Frame``/``Event`` messages on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.core import control, protowire
from jaxdist.core.errors import CodecError
from jaxdist.core.transport import frames
from jaxdist.proto import jaxdist_pb2 as pb

HEADER = frames.FrameHeader("pipe", "sess", 7, 2, request_id=99, reply_to="coord",
                            control=control.encode({"slot": [1, 2], "top_p": [0.5, 1.0]}))


def _tensors(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {"x": rng.standard_normal((2, n)).astype(np.float32),
            "ids": np.arange(5, dtype=np.int64)}


def _assemble(views):
    asm = frames.FrameAssembler()
    results = [asm.add(v) for v in views]
    assert all(r is None for r in results[:-1])
    return results[-1]


@pytest.mark.parametrize("n", [16, 300_000], ids=["protobuf-path", "scan-path"])
def test_split_frame_round_trip(n):
    tensors = _tensors(n)
    msgs = list(frames.split_frame(HEADER, tensors, chunk_bytes=1 << 20))
    assert len(msgs) == (1 if n == 16 else 3)  # 2.4 MB of x in 1 MiB messages, ids in the last
    for i, data in enumerate(msgs):  # what any protobuf reader sees
        msg = pb.Frame.FromString(data)
        assert (msg.pipeline_id, msg.step, msg.stage, msg.request_id) == ("pipe", 7, 2, 99)
        assert (list(msg.control.slot), list(msg.control.top_p)) == ([1, 2], [0.5, 1.0])
        assert msg.last_chunk == (i == len(msgs) - 1)
    header, out = _assemble([frames.parse_frame(m) for m in msgs])
    assert header == HEADER
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)
        assert out[k].dtype == v.dtype


def test_scan_path_keeps_views_of_the_received_bytes():
    data = next(frames.split_frame(HEADER, {"x": np.ones(1 << 18, np.float32)}))
    assert len(data) >= frames.SCAN_MIN_BYTES
    view = frames.parse_frame(data)
    assert view.msg.pipeline_id == "pipe" and not view.msg.tensors
    assert view.chunks[0][3].obj is data


@pytest.mark.parametrize("n", [16, 300_000], ids=["protobuf-path", "scan-path"])
def test_result_events_round_trip(n):
    tensors = _tensors(n)
    msgs = list(frames.result_events(HEADER, tensors, chunk_bytes=1 << 20))
    for data in msgs:
        event = pb.Event.FromString(data)
        assert event.WhichOneof("kind") == "result"
        assert (event.request_id, event.session_id) == (99, "sess")
    views = [frames.parse_event(m) for m in msgs]
    assert all(v.result is not None and v.msg.request_id == 99 for v in views)
    header, out = _assemble([v.result for v in views])
    assert header == HEADER
    np.testing.assert_array_equal(out["x"], tensors["x"])


def test_parse_event_without_result():
    beat = frames.parse_event(pb.Event(heartbeat=1.5).SerializeToString())
    assert beat.result is None and beat.msg.heartbeat == 1.5
    err = pb.Event(error=pb.RemoteError(message="boom", stage=1), request_id=3)
    view = frames.parse_event(frames.serialize(err))
    assert view.result is None and view.msg.error.message == "boom"


def test_assembler_takes_protobuf_frames_too():
    msgs = [pb.Frame.FromString(m)
            for m in frames.split_frame(HEADER, _tensors(300), chunk_bytes=1000)]
    _, out = _assemble(msgs)
    np.testing.assert_array_equal(out["x"], _tensors(300)["x"])


def test_varints_round_trip():
    for n in [0, 1, 127, 128, 300, 1 << 35, (1 << 64) - 1]:
        raw = protowire.varint(n)
        assert protowire.read_varint(raw, 0) == (n, len(raw))


def test_error_truncated_large_frame():
    data = next(frames.split_frame(HEADER, {"x": np.ones(1 << 18, np.float32)}))
    with pytest.raises(CodecError, match=r"malformed protobuf: field 5 at byte \d+ runs past the end"):
        frames.parse_frame(data[:-10])


def test_error_garbage_varint():
    with pytest.raises(CodecError, match="malformed protobuf: truncated varint"):
        list(protowire.fields(b"\x08\xff"))
