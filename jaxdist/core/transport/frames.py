"""Frames: one step of one session, as one or more ``Frame`` messages on a stream.

A frame's tensors go through the codec. When they exceed one message's budget they are split
over several ``Frame`` messages that share (pipeline, session, step, request); all but the last
carry ``last_chunk=False``. Messages of different frames never interleave on one stream, so a
receiver needs only one :class:`FrameAssembler` per stream.

Errors: malformed bytes raise :class:`CodecError`; a frame over a limit of its
:class:`FrameAssembler` raises :class:`LimitError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from jaxdist.core import codec, protowire
from jaxdist.core.errors import CodecError, LimitError
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["EventView", "FrameAssembler", "FrameHeader", "FrameView", "error_frame", "header_of",
           "parse_event", "parse_frame", "result_events", "serialize", "split_frame"]


@dataclass(frozen=True)
class FrameHeader:
    """Routing fields shared by every message of a frame, and its step control.

    ``control`` is the frame's serialized ``StepControl`` (:mod:`jaxdist.core.control`), kept
    as bytes: every stage forwards it as it came, and reads it only where its spec says.
    """

    pipeline_id: str
    session_id: str
    step: int
    stage: int
    request_id: int = 0
    reply_to: str = ""
    kind: pb.FrameKind = pb.FRAME_DATA
    control: bytes = b""
    key: bytes = field(default=b"", repr=False)  # the pipeline's key: never logged


_F = {f.name: f.number for f in pb.Frame.DESCRIPTOR.fields}
_TENSORS = _F["tensors"]
_CONTROL = _F["control"]
_RESULT = pb.Event.DESCRIPTOR.fields_by_name["result"].number

# Below this size a message is parsed by protobuf (faster in C than a scan in Python); above
# it, by a scan that leaves the tensor data where it arrived (no copies).
SCAN_MIN_BYTES = 64 << 10


def _heads(header: FrameHeader, n: int, *, keyed: bool = True) -> Iterator[bytes]:
    """The serialized header fields of each of the ``n`` messages of a frame (without the
    pipeline key unless ``keyed``)."""
    frame = pb.Frame(pipeline_id=header.pipeline_id, session_id=header.session_id,
                     step=header.step, stage=header.stage, request_id=header.request_id,
                     reply_to=header.reply_to, kind=header.kind,
                     pipeline_key=header.key if keyed else b"")
    # The control header goes out as the bytes it came in (a field order of no consequence).
    control = (protowire.field_prefix(_CONTROL, len(header.control)) + header.control
               if header.control else b"")
    if n > 1:
        more = frame.SerializeToString() + control
        for _ in range(n - 1):
            yield more
    frame.last_chunk = True
    yield frame.SerializeToString() + control


def split_frame(header: FrameHeader, tensors: Mapping[str, Any], *,
                chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Encode tensors into the messages of one frame (at least one), as serialized ``Frame``s.

    Each message is written in one piece: the header, then the tensors in wire format
    (:func:`codec.tensor_pieces`), so each tensor byte is copied once on the way out.
    """
    groups = list(codec.group_chunks(tensors, chunk_bytes=chunk_bytes))
    for head, group in zip(_heads(header, len(groups)), groups):
        pieces, _ = codec.tensor_pieces(group, _TENSORS)
        yield b"".join([head, *pieces])


def result_events(header: FrameHeader, tensors: Mapping[str, Any], *,
                  chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Like :func:`split_frame`, each message wrapped in a subscription ``Event`` (serialized)."""
    tail = pb.Event(request_id=header.request_id, session_id=header.session_id
                    ).SerializeToString()
    groups = list(codec.group_chunks(tensors, chunk_bytes=chunk_bytes))
    # A result goes to the key's holder: it needs no key
    for head, group in zip(_heads(header, len(groups), keyed=False), groups):
        pieces, size = codec.tensor_pieces(group, _TENSORS)
        yield b"".join([protowire.field_prefix(_RESULT, len(head) + size), head, *pieces, tail])


class FrameView:
    """A received ``Frame``: ``msg`` holds its header fields; ``chunks`` its tensors, whose
    data are views of the received bytes (see :func:`codec.parse_tensor`)."""

    __slots__ = ("chunks", "msg")

    def __init__(self, msg: pb.Frame, chunks: list[codec.Chunk]) -> None:
        self.msg = msg
        self.chunks = chunks


def _malformed(what: str, data: bytes | memoryview, exc: DecodeError) -> CodecError:
    return CodecError(f"malformed {what} ({len(data)} bytes): {exc}")


def _scan_frame(view: memoryview, start: int, end: int) -> FrameView:
    head: list[memoryview] = []
    chunks: list[codec.Chunk] = []
    for fld, wire_type, field_start, value, value_end in protowire.fields(view, start, end):
        if fld == _TENSORS and wire_type == protowire.LEN:
            chunks.append(codec.parse_tensor(view, value, value_end))
        else:
            head.append(view[field_start:value_end])
    data = b"".join(head)
    try:
        return FrameView(pb.Frame.FromString(data), chunks)
    except DecodeError as exc:
        raise _malformed("Frame header fields", data, exc) from None


def parse_frame(data: bytes | memoryview) -> FrameView:
    """Deserialize a ``Frame`` (the ``Push`` stream's request deserializer).

    Raises:
        CodecError: malformed bytes.
    """
    if len(data) < SCAN_MIN_BYTES:
        try:
            msg = pb.Frame.FromString(data)
        except DecodeError as exc:
            raise _malformed("Frame message", data, exc) from None
        return FrameView(msg, [codec.chunk_of(t) for t in msg.tensors])
    return _scan_frame(memoryview(data), 0, len(data))


class EventView:
    """A received ``Event``: ``msg`` holds all but the result frame, which is ``result``."""

    __slots__ = ("msg", "result")

    def __init__(self, msg: pb.Event, result: FrameView | None) -> None:
        self.msg = msg
        self.result = result


def parse_event(data: bytes | memoryview) -> EventView:
    """Deserialize an ``Event`` (the ``Subscribe`` stream's response deserializer).

    Raises:
        CodecError: malformed bytes.
    """
    if len(data) < SCAN_MIN_BYTES:
        try:
            msg = pb.Event.FromString(data)
        except DecodeError as exc:
            raise _malformed("Event message", data, exc) from None
        if msg.WhichOneof("kind") != "result":
            return EventView(msg, None)
        return EventView(msg, FrameView(msg.result, [codec.chunk_of(t)
                                                     for t in msg.result.tensors]))
    view = memoryview(data)
    rest: list[memoryview] = []
    result = None
    for fld, wire_type, field_start, value, value_end in protowire.fields(view):
        if fld == _RESULT and wire_type == protowire.LEN and result is None:
            result = _scan_frame(view, value, value_end)
        else:
            rest.append(view[field_start:value_end])
    data = b"".join(rest)
    try:
        return EventView(pb.Event.FromString(data), result)
    except DecodeError as exc:
        raise _malformed("Event fields", data, exc) from None


def serialize(msg: bytes | pb.Frame | pb.Event) -> bytes:
    """The serializer of both streams: messages built here are bytes already."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def error_frame(header: FrameHeader, error: pb.RemoteError) -> pb.Frame:
    return pb.Frame(pipeline_id=header.pipeline_id, session_id=header.session_id,
                    step=header.step, stage=header.stage, request_id=header.request_id,
                    reply_to=header.reply_to, kind=pb.FRAME_ERROR, error=error, last_chunk=True)


def header_of(msg: pb.Frame) -> FrameHeader:
    control = msg.control.SerializeToString() if msg.HasField("control") else b""
    return FrameHeader(msg.pipeline_id, msg.session_id, msg.step, msg.stage, msg.request_id,
                       msg.reply_to, msg.kind, control, msg.pipeline_key)


@dataclass
class FrameAssembler:
    """Joins the messages of one frame. Feed messages in order with :meth:`add`.

    Args:
        max_bytes: largest tensor accepted (protects memory from a hostile sender); ``None``:
            no limit.
        max_tensors: most tensors accepted in one frame; ``None``: no limit.
    """

    max_bytes: int | None = codec.DEFAULT_MAX_TENSOR_BYTES
    max_tensors: int | None = codec.DEFAULT_MAX_TENSORS
    _header: FrameHeader | None = field(default=None, init=False)
    _asm: codec.TensorAssembler | None = field(default=None, init=False)

    def add(self, msg: FrameView | pb.Frame, header: FrameHeader | None = None
            ) -> tuple[FrameHeader, dict[str, np.ndarray]] | None:
        """Add one message; return ``(header, tensors)`` when the frame is complete.

        ``header`` is ``header_of(msg)`` when the caller has read it already.

        Raises:
            CodecError: a message of another frame arrived before this one ended, or the tensors
                are malformed.
            LimitError: a tensor is over ``max_bytes``, or the frame has more than
                ``max_tensors`` tensors.

            Either way the assembler is reset, so the stream can go on.
        """
        if isinstance(msg, FrameView):
            chunks, msg = msg.chunks, msg.msg
        else:
            chunks = [codec.chunk_of(t) for t in msg.tensors]
        if header is None:
            header = header_of(msg)
        if self._asm is None:
            self._header = header
            self._asm = codec.TensorAssembler(max_bytes=self.max_bytes, max_tensors=self.max_tensors)
        elif header != self._header:
            self.reset()
            raise CodecError(f"frame of session {header.session_id!r} step {header.step} began "
                             f"before the previous frame ended (missing last_chunk)")
        asm = self._asm
        try:
            for chunk in chunks:
                asm.add_chunk(chunk)
            if not msg.last_chunk:
                return None
            tensors = asm.finish()
        except (CodecError, LimitError) as exc:
            self.reset()
            raise type(exc)(f"session {header.session_id!r} step {header.step}: {exc}",
                            code=exc.code) from None
        self.reset()
        return header, tensors

    def reset(self) -> None:
        self._header = None
        self._asm = None
