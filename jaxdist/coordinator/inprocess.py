"""Run a model's stages in this process, through the same artifacts and WorkerStage code as a worker.

This is the single-process baseline of the parity tests and benchmarks: the stages are exported,
vetted, bound and compiled exactly as on a worker, and only the network is missing. Its API
mirrors :class:`jaxdist.coordinator.cluster.Pipeline` (``submit``, ``call``, ``session``,
``end_session``), so code written against one runs against the other.
"""

from __future__ import annotations

import concurrent.futures
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxdist.coordinator.pipeline import Session
from jaxdist.core import kernels
from jaxdist.core.errors import SessionError
from jaxdist.core.stage import WorkerStage
from jaxdist.core.weights import WeightCache
from jaxdist.export.model import Model
from jaxdist.export.partition import balanced_split, explicit_split
from jaxdist.export.stages import build_stage_specs

__all__ = ["InProcessPipeline"]


class InProcessPipeline:
    """All stages of a model in one process.

    Args:
        model: the model.
        weights_roots: roots for the weight URIs.
        stages: number of stages (default 1).
        split: explicit unit counts per stage.
        device: device directive of every stage.
    """

    def __init__(self, model: Model, *, weights_roots: Sequence[str], stages: int = 1,
                 split: Sequence[int] | None = None, device: str = "auto") -> None:
        self.model = model
        ranges = (explicit_split(len(model.units), split) if split is not None else
                  balanced_split([u.weight_bytes + u.state_bytes + 1 for u in model.units],
                                 stages))
        self.cache = WeightCache(weights_roots)
        kernels.load()  # quantized stages call the CPU kernels; unavailable ones are refused
        self.stages = []
        for b in build_stage_specs(model, ranges, platforms=("cpu",)):
            spec = b.spec.replace(device=device, stage_id=f"inproc/{b.spec.stage_index}")
            self.stages.append(WorkerStage.load(spec, artifact=b.artifact.data, cache=self.cache))
        self._sessions: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def _run(self, inputs: Mapping[str, Any], session_id: str, step: int) -> dict[str, np.ndarray]:
        stateful = any(s.spec.state for s in self.stages)
        states: list[dict[str, Any]] | None = None
        if stateful:
            with self._lock:
                if step == 0:
                    states = [s.init_state() for s in self.stages]
                else:
                    last, states = self._sessions.get(session_id, (-1, None))
                    if states is None or last != step - 1:
                        raise SessionError(f"session {session_id!r}: expected step {last + 1}, "
                                           f"found step {step}")
        carry: Mapping[str, Any] = inputs
        new_states = []
        for k, stage in enumerate(self.stages):
            carry, st = stage.run(carry, states[k] if states is not None else None)
            new_states.append(st)
        if stateful:
            with self._lock:
                self._sessions[session_id] = (step, new_states)
        return {k: np.asarray(v) for k, v in carry.items()}

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        future: concurrent.futures.Future[dict[str, np.ndarray]] = concurrent.futures.Future()
        try:
            future.set_result(self._run(inputs, session_id, step))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def call(self, inputs: Mapping[str, Any] | None = None, *, session_id: str = "",
             step: int = 0, **kw: Any) -> dict[str, np.ndarray]:
        return self._run(dict(inputs or {}, **kw), session_id, step)

    __call__ = call

    def session(self, session_id: str | None = None) -> Session:
        return Session(self, session_id or uuid.uuid4().hex)  # type: ignore[arg-type]  # same API

    def end_session(self, session_id: str) -> int:
        with self._lock:
            self._sessions.pop(session_id, None)
        return 0

    def close(self) -> None:
        self.cache.close()

    def __enter__(self) -> InProcessPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
