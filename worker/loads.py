"""The ``LoadStage`` calls a worker is working on: their phase, and whether their caller is there.

A load takes seconds to minutes, most of it compiling every shape bucket. While it runs, the
worker keeps its phase (``load``, ``compile``, ``bind``) and when the phase began, and ``Info``
reports them (``InfoReply.loading``), so a coordinator can show live phases while its unary
``LoadStage`` waits, with no streaming call.

A caller that leaves (it cancelled, its deadline passed, or the server is stopping) abandons its
load: the step under way finishes, since XLA cannot stop a compile, no later step starts
(:meth:`Load.enter` raises :class:`CallerLeft`), and a stage finished anyway is discarded, never
loaded.
"""

from __future__ import annotations

import threading
import time

from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["CallerLeft", "Load", "Loads"]


class CallerLeft(Exception):
    """Raised inside an abandoned load to skip its remaining phases; names the phase that
    was not started."""


class Load:
    """One ``LoadStage`` in progress, from the moment its call arrived.

    :meth:`describe` names the stage once the request is read; until then, and until its first
    phase, ``Info`` does not list it.
    """

    def __init__(self) -> None:
        self.arrived = time.monotonic()
        self.stage_id = self.pipeline_id = ""
        self.stage_index = 0
        self.phase = ""
        self.phase_started = self.arrived
        self.buckets_done = self.buckets = 0
        self.seconds: dict[str, float] = {}  # time spent in each phase left behind
        self.why = ""                        # why the caller is gone, once it is
        self._left = threading.Event()
        self._lock = threading.Lock()

    def describe(self, stage_id: str, pipeline_id: str, stage_index: int) -> None:
        self.stage_id, self.pipeline_id, self.stage_index = stage_id, pipeline_id, stage_index

    def leave(self, why: str) -> None:
        """The caller is gone (``why``, for the log): abandon the load."""
        if not self._left.is_set():
            self.why = why
            self._left.set()

    @property
    def left(self) -> bool:
        """Whether the caller is gone (the load is abandoned)."""
        return self._left.is_set()

    def enter(self, phase: str, done: int = 0, total: int = 0) -> None:
        """Record that ``phase`` runs (``WorkerStage.load``'s ``on_phase``); for a compile,
        bucket ``done`` of ``total`` starts.

        Raises:
            CallerLeft: the caller is gone; nothing more should run.
        """
        if self.left:
            raise CallerLeft(f"{phase} (bucket {done + 1} of {total})" if total else phase)
        now = time.monotonic()
        with self._lock:
            if phase != self.phase:
                self._close_phase(now)
                self.phase, self.phase_started = phase, now
            self.buckets_done, self.buckets = done, total

    def finish(self) -> None:
        """The last phase ended; its time is added to :attr:`seconds`."""
        with self._lock:
            self._close_phase(time.monotonic())
            self.phase = ""

    def _close_phase(self, now: float) -> None:
        if self.phase:
            self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self.phase_started

    def to_proto(self) -> pb.StageLoading:
        now = time.monotonic()
        with self._lock:
            return pb.StageLoading(stage_id=self.stage_id, pipeline_id=self.pipeline_id,
                                   stage_index=self.stage_index, phase=self.phase,
                                   phase_seconds=now - self.phase_started,
                                   seconds=now - self.arrived, buckets_done=self.buckets_done,
                                   buckets=self.buckets, abandoned=self.left)


class Loads:
    """The loads in progress on one worker (thread safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: list[Load] = []

    def add(self, load: Load) -> None:
        with self._lock:
            self._loads.append(load)

    def remove(self, load: Load) -> None:
        with self._lock:
            self._loads.remove(load)

    def leave_all(self, why: str) -> None:
        """Abandon every load in progress (the worker is stopping)."""
        with self._lock:
            loads = list(self._loads)
        for load in loads:
            load.leave(why)

    def __len__(self) -> int:
        with self._lock:
            return len(self._loads)

    def to_proto(self) -> list[pb.StageLoading]:
        """What ``Info`` reports, in the order the loads started."""
        with self._lock:
            loads = list(self._loads)
        return [load.to_proto() for load in loads if load.phase]
