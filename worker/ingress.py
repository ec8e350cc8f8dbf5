"""Frames into a worker's stages: the one path every incoming stream takes.

A gRPC ``Push`` stream (``servicer.py``) and a data connection (``data_listener.py``) each get a
:class:`FrameIngress` and feed it their messages in order, so both ingresses run the same
checks, under the same limits, into the same :meth:`StageRuntime.accept` and
:meth:`StageRuntime.process`. A bad frame is reported on the coordinator's subscription and the
stream goes on; only a message that cannot be read at all ends the stream (the caller's job).
"""

from __future__ import annotations

from typing import Any, Protocol

from jaxdist.core.errors import LimitError, PipelineKeyError, SessionError
from jaxdist.core.runtime import StageRuntime
from jaxdist.core.transport.frames import FrameAssembler, FrameHeader, FrameView, header_of
from jaxdist.worker.limits import FrameBudget, InflightBytes, Streams, check_ids

__all__ = ["FrameIngress", "FrameLimits", "IngressWorker"]


class FrameLimits(Protocol):
    """The limits of ``WorkerConfig`` an ingress applies."""

    @property
    def max_frame_bytes(self) -> int: ...
    @property
    def max_frame_tensor_bytes(self) -> int: ...
    @property
    def max_tensors_per_frame(self) -> int: ...
    @property
    def max_id_bytes(self) -> int: ...
    @property
    def frame_idle_timeout(self) -> float: ...


class IngressWorker(Protocol):
    """What an ingress needs of its worker (``WorkerServicer``)."""

    @property
    def config(self) -> FrameLimits: ...
    @property
    def address(self) -> str: ...
    @property
    def draining(self) -> bool: ...
    @property
    def inflight(self) -> InflightBytes: ...
    @property
    def streams(self) -> Streams: ...
    def runtime_for(self, pipeline_id: str, stage: int) -> StageRuntime | None: ...
    def key_matches(self, pipeline_id: str, key: bytes) -> bool: ...
    async def report(self, header: FrameHeader | Any, exc: BaseException) -> None: ...


class FrameIngress:
    """The frames of one incoming stream, assembled, checked and run. Used on the loop only.

    A tensor is refused on its declared size before it is allocated; the budget counts the
    whole frame's bytes and tensors as they arrive, and what a frame being received holds counts
    against the worker's ``--max-inflight-bytes`` until it completes or fails, or until
    :meth:`close` (``worker/limits.py``). The stream's reader waits for the rest of a begun
    frame at most :attr:`idle_timeout` seconds at a time (:meth:`stalled`).

    ``pipeline_id``: the stream is a next hop's, opened by that pipeline's hop credential
    (``transport/hop.py``): a frame of any other pipeline ends it.
    """

    def __init__(self, worker: IngressWorker, *, pipeline_id: str | None = None) -> None:
        cfg = worker.config
        self._worker = worker
        self._pipeline_id = pipeline_id
        self._asm = FrameAssembler(max_bytes=min(cfg.max_frame_tensor_bytes, cfg.max_frame_bytes),
                                   max_tensors=cfg.max_tensors_per_frame)
        self._budget = FrameBudget(cfg.max_frame_bytes, cfg.max_tensors_per_frame)
        self._held = 0  # bytes of the frame being received, in worker.inflight
        self._begun: FrameHeader | None = None  # the frame being received
        self.messages = 0  # messages taken

    @property
    def idle_timeout(self) -> float | None:
        """How long the stream's next message may take: ``--frame-idle-timeout`` while a frame
        is half received, else no bound (an idle stream between frames holds nothing)."""
        return None if self._begun is None else self._worker.config.frame_idle_timeout

    async def stalled(self, where: str) -> Exception:
        """The begun frame's stream sent nothing for :attr:`idle_timeout` seconds: report the
        frame to its caller, free what it held, and return the error that ends the stream."""
        header, held = self._begun, self._held
        assert header is not None
        exc = LimitError(f"{where}: frame of session {header.session_id[:64]!r} step "
                         f"{header.step} began, then nothing more arrived for "
                         f"{self._worker.config.frame_idle_timeout:g} s "
                         f"(--frame-idle-timeout); the stream is ended and the {held} bytes "
                         f"it held are freed")
        self._drop()
        await self._worker.report(header, exc)
        return exc

    def close(self) -> None:
        """The stream ended: free what a half-received frame held."""
        self._drop()

    def _drop(self) -> None:
        self._asm.reset()
        self._budget.reset()
        self._worker.inflight.give(self._held)
        self._held = 0
        self._begun = None

    async def take(self, msg: FrameView) -> None:
        """Take one message of the stream; when it completes a frame, run the frame (waits
        while the stage's egress is full: back-pressure on this stream). Never raises for a bad
        frame: it is reported to the frame's caller.

        Raises:
            PipelineKeyError: the message is for a loaded pipeline but lacks its key, or, on a
                hop's stream, is of another pipeline than the stream's; the stream ends
                (nothing is reported to the pipeline's own subscription, which a sender
                without the key must not be able to reach).
        """
        self.messages += 1
        worker, cfg = self._worker, self._worker.config
        header = header_of(msg.msg)
        if self._pipeline_id is not None and header.pipeline_id != self._pipeline_id:
            raise PipelineKeyError(
                f"frame for pipeline {header.pipeline_id[:64]!r} on worker {worker.address} "
                f"came on a next hop's stream of pipeline {self._pipeline_id[:64]!r}: a hop "
                f"credential opens only its own pipeline's frames; the stream is ended")
        runtime = worker.runtime_for(header.pipeline_id, header.stage)
        if runtime is not None and not worker.key_matches(header.pipeline_id, header.key):
            raise PipelineKeyError(
                f"frame for pipeline {header.pipeline_id[:64]!r} stage {header.stage} on worker "
                f"{worker.address}: the pipeline key presented "
                f"({'none' if not header.key else f'{len(header.key)} bytes'}) is not its key; "
                f"the pipeline was loaded by another coordinator")
        try:
            if worker.draining:
                raise SessionError(f"worker {worker.address} is shutting down; frame of "
                                   f"session {header.session_id!r} refused")
            check_ids("frame", cfg.max_id_bytes, pipeline_id=header.pipeline_id,
                      session_id=header.session_id, reply_to=header.reply_to)
            if runtime is None:
                raise SessionError(f"unknown stage: pipeline {header.pipeline_id!r} stage "
                                   f"{header.stage} is not loaded on worker {worker.address}")
            held = self._budget.add(msg.chunks, header)
            worker.inflight.take(held, f"frame of session {header.session_id[:64]!r} step "
                                       f"{header.step}")
            self._held += held
            self._begun = header
            done = self._asm.add(msg, header)
            if done is None:
                return
            self._drop()
            header, tensors = done
            tensors, shapes = runtime.accept(header, tensors)
        except Exception as exc:  # noqa: BLE001 - a bad frame is reported, not fatal
            self._drop()
            await worker.report(header, exc)
            return
        await runtime.process(header, tensors, shapes)
