"""Run a model's stages in this process, through the same artifacts, WorkerStage and stage
runtime as a worker.

This is the single-process baseline of the parity tests and benchmarks: the stages are exported,
vetted, bound and compiled exactly as on a worker, their frames run through the same
:class:`~jaxdist.core.runtime.StageRuntime` (sessions, step order, egress), and only the
transport differs: an in-process :class:`~jaxdist.core.runtime.Route` hands each stage's device
arrays to the next stage's ``process``. Its API mirrors
:class:`jaxdist.coordinator.pipeline.Pipeline` (``submit``, ``call``, ``session``,
``end_session``), so code written against one runs against the other.

Example:
    >>> with InProcessPipeline(model, weights_roots=["/models"], stages=2) as pipe:  # doctest: +SKIP
    ...     out = pipe.call({"x": x})
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist.coordinator.pipeline import Session
from jaxdist.core import control, kernels
from jaxdist.core.devices import device_platform, resolve_device
from jaxdist.core.errors import JaxdistError, TransportError
from jaxdist.core.runtime import StageRuntime
from jaxdist.core.sessions import SessionStore
from jaxdist.core.stage import WorkerStage
from jaxdist.core.transport.frames import FrameHeader
from jaxdist.core.weights import WeightCache
from jaxdist.export.model import Model
from jaxdist.export.partition import balanced_split, explicit_split
from jaxdist.export.stages import build_stage_specs

__all__ = ["InProcessPipeline"]

_Future = concurrent.futures.Future[dict[str, np.ndarray]]


class _LocalRoute:
    """The in-process :class:`~jaxdist.core.runtime.Route`: the next stage's ``process``, or
    the caller's future. Device arrays pass as they are."""

    wants_host = False

    def __init__(self, pipe: InProcessPipeline, index: int) -> None:
        self._pipe = pipe
        self._index = index

    async def forward(self, header: FrameHeader, outputs: Mapping[str, Any]) -> None:
        runtimes = self._pipe._runtimes
        if self._index + 1 < len(runtimes):
            nxt = runtimes[self._index + 1]
            tensors, shapes = nxt.accept(header, dict(outputs))
            await nxt.process(header, tensors, shapes)
        else:
            self._pipe._settle(header.request_id, {k: np.asarray(v) for k, v in outputs.items()})

    async def fail(self, header: FrameHeader, error: BaseException) -> None:
        self._pipe._settle(header.request_id, error)

    async def close(self) -> None:
        return None


class InProcessPipeline:
    """All stages of a model in one process. Each step runs to its end in the thread that
    submits it (the futures come back done); steps of several threads take turns.

    Do not call it from inside a running asyncio event loop: it drives a loop of its own.

    Args:
        model: the model.
        weights_roots: roots for the weight URIs.
        stages: number of stages (default 1).
        split: explicit unit counts per stage.
        device: device directive of every stage; the stages are exported for the platform it
            resolves to on this machine (``metal``: a portable cpu lowering).
        max_sessions: sessions held at once (each holds every stage's state).

    Example:
        >>> import numpy as np
        >>> from jaxdist import InProcessPipeline, Model, Unit
        >>> double = Unit("double", lambda params, state, carry: ({"x": carry["x"] * 2}, {}))
        >>> model = Model("double", [double], inputs={"x": ("b, 4", "float32")})
        >>> with InProcessPipeline(model, weights_roots=[]) as pipe:
        ...     print(pipe.call(x=np.ones((1, 4), np.float32))["x"])
        [[2. 2. 2. 2.]]
    """

    def __init__(self, model: Model, *, weights_roots: Sequence[str], stages: int = 1,
                 split: Sequence[int] | None = None, device: str = "auto",
                 max_sessions: int = 1024) -> None:
        self.model = model
        self.pipeline_id = f"inproc-{uuid.uuid4().hex[:8]}"
        ranges = (explicit_split(len(model.units), split) if split is not None else
                  balanced_split([u.weight_bytes + u.state_bytes + 1 for u in model.units],
                                 stages))
        self.cache = WeightCache(weights_roots)
        kernels.load()  # quantized stages call the CPU kernels; unavailable ones are refused
        self.stages: list[WorkerStage] = []
        platform = device_platform(resolve_device(device))
        for b in build_stage_specs(model, ranges, platforms=(platform,)):
            spec = b.spec.replace(device=device,
                                  stage_id=f"{self.pipeline_id}/{b.spec.stage_index}")
            self.stages.append(WorkerStage.load(spec, artifact=b.artifact.data, cache=self.cache))
        self.sessions = SessionStore(max_sessions)
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="inproc")
        self._runtimes = [StageRuntime(s, stage_id=s.spec.stage_id, pipeline_id=self.pipeline_id,
                                       sessions=self.sessions, route=_LocalRoute(self, k),
                                       pool=self._pool, inline_steps=True)
                          for k, s in enumerate(self.stages)]
        self._pending: dict[int, _Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        # Driven by the calling thread, one step at a time (the lock): a step needs no thread
        # handoff, as a plain jax.jit call needs none, so this stays the fair baseline.
        self._loop = asyncio.new_event_loop()
        self._turn = threading.Lock()  # who drives the loop

    def _settle(self, request_id: int, outcome: dict[str, np.ndarray] | BaseException) -> None:
        with self._lock:
            future = self._pending.pop(request_id, None)
        if future is None:
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> _Future:
        """Send one step; the future resolves to the last stage's outputs (numpy arrays)."""
        future: _Future = concurrent.futures.Future()
        if self._closed:
            future.set_exception(TransportError(f"pipeline {self.pipeline_id} is closed"))
            return future
        first = self._runtimes[0]
        request_id = next(self._ids)
        try:
            tensors, ctl = control.split(inputs, first.spec.control)
            header = FrameHeader(self.pipeline_id, session_id, step, 0, request_id, control=ctl)
            tensors, shapes = first.accept(header, tensors)
        except JaxdistError as exc:
            future.set_exception(exc)
            return future
        with self._lock:
            self._pending[request_id] = future
        with self._turn:
            self._loop.run_until_complete(first.process(header, tensors, shapes))
        return future

    def call(self, inputs: Mapping[str, Any] | None = None, *, session_id: str = "",
             step: int = 0, **kw: Any) -> dict[str, np.ndarray]:
        return self.submit(dict(inputs or {}, **kw), session_id=session_id, step=step).result()

    __call__ = call

    def session(self, session_id: str | None = None) -> Session:
        return Session(self, session_id or uuid.uuid4().hex)  # type: ignore[arg-type]  # same API

    def end_session(self, session_id: str) -> int:
        """Free a session's state on every stage. Returns the bytes freed."""
        _, nbytes = self.sessions.end(session_id, [s.spec.stage_id for s in self.stages])
        return nbytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._turn:
            for rt in self._runtimes:
                self._loop.run_until_complete(rt.aclose())
                rt.drop_sessions()
            self._loop.close()
        self._pool.shutdown(wait=False)
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for f in pending:
            f.set_exception(TransportError(f"pipeline {self.pipeline_id} was closed"))
        self.cache.close()

    def __enter__(self) -> InProcessPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
