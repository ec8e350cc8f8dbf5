"""Frames: one step of one session, as one or more ``Frame`` messages on a stream.

A frame's tensors go through the codec. When they exceed one message's budget they are split
over several ``Frame`` messages that share (pipeline, session, step, request); all but the last
carry ``last_chunk=False``. Messages of different frames never interleave on one stream, so a
receiver needs only one :class:`FrameAssembler` per stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxdist import codec
from jaxdist.errors import CodecError
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["FrameAssembler", "FrameHeader", "error_frame", "result_events", "split_frame"]


@dataclass(frozen=True)
class FrameHeader:
    """Routing fields shared by every message of a frame."""

    pipeline_id: str
    session_id: str
    step: int
    stage: int
    request_id: int = 0
    reply_to: str = ""
    kind: int = pb.FRAME_DATA


def _fill(frame: pb.Frame, header: FrameHeader, group: list[codec.Chunk], last: bool) -> None:
    frame.pipeline_id = header.pipeline_id
    frame.session_id = header.session_id
    frame.step = header.step
    frame.stage = header.stage
    frame.request_id = header.request_id
    frame.reply_to = header.reply_to
    frame.kind = header.kind
    frame.last_chunk = last
    codec.add_chunks(frame.tensors, group)


def split_frame(header: FrameHeader, tensors: Mapping[str, Any], *,
                chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[pb.Frame]:
    """Encode tensors into the messages of one frame (at least one message), built in place."""
    groups = list(codec.group_chunks(tensors, chunk_bytes=chunk_bytes))
    for i, group in enumerate(groups):
        frame = pb.Frame()
        _fill(frame, header, group, i == len(groups) - 1)
        yield frame


def result_events(header: FrameHeader, tensors: Mapping[str, Any], *,
                  chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[pb.Event]:
    """Like :func:`split_frame`, each frame built in place inside a subscription ``Event``."""
    groups = list(codec.group_chunks(tensors, chunk_bytes=chunk_bytes))
    for i, group in enumerate(groups):
        event = pb.Event(request_id=header.request_id, session_id=header.session_id)
        _fill(event.result, header, group, i == len(groups) - 1)
        yield event


def error_frame(header: FrameHeader, error: pb.RemoteError) -> pb.Frame:
    return pb.Frame(pipeline_id=header.pipeline_id, session_id=header.session_id,
                    step=header.step, stage=header.stage, request_id=header.request_id,
                    reply_to=header.reply_to, kind=pb.FRAME_ERROR, error=error, last_chunk=True)


def header_of(msg: pb.Frame) -> FrameHeader:
    return FrameHeader(msg.pipeline_id, msg.session_id, msg.step, msg.stage, msg.request_id,
                       msg.reply_to, msg.kind)


@dataclass
class FrameAssembler:
    """Joins the messages of one frame. Feed messages in order with :meth:`add`.

    Args:
        max_bytes: largest tensor accepted (protects memory from a hostile sender).
        max_tensors: most tensors accepted in one frame.
    """

    max_bytes: int | None = None
    max_tensors: int | None = None
    _header: FrameHeader | None = field(default=None, init=False)
    _asm: codec.TensorAssembler | None = field(default=None, init=False)

    def add(self, msg: pb.Frame) -> tuple[FrameHeader, dict[str, np.ndarray]] | None:
        """Add one message; return ``(header, tensors)`` when the frame is complete.

        Raises:
            CodecError: a message of another frame arrived before this one ended, or the tensors
                are malformed. The assembler is reset, so the stream can go on.
        """
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
            asm.extend(msg.tensors)
            if not msg.last_chunk:
                return None
            tensors = asm.finish()
        except CodecError as exc:
            self.reset()
            raise CodecError(f"session {header.session_id!r} step {header.step}: {exc}") from None
        self.reset()
        return header, tensors

    def reset(self) -> None:
        self._header = None
        self._asm = None
