"""The stages loaded on a worker, by pipeline: each pipeline's key and its lease.

A coordinator that loads a pipeline for one run sends a key with its ``LoadStage`` calls; the
worker then asks for it on every call and frame that reaches the pipeline (``Subscribe``,
``EndSession``, later ``LoadStage``, each frame's ``pipeline_key``). A pipeline loaded with no
key is shared (``jaxdist deploy``): the worker token alone opens it. A key is kept while a stage
of its pipeline is loaded here.

A pipeline loaded with a lease is unloaded when nobody has subscribed to its results here for
the lease's seconds: a coordinator killed or cut off leaves no stage behind to hold its memory
(:meth:`LoadedPipelines.watch_leases`, a thread of the servicer).

The input shapes a pipeline has compiled here, by all its stages together, are bounded
(``--max-compiled-shapes``): each stage's buckets are charged when it loads, each further shape
when a frame brings it, and an unloaded stage gives its shapes back
(:meth:`LoadedPipelines.shape_budget`).
"""

from __future__ import annotations

import gc
import hmac
import logging
import threading
import time
from collections.abc import Callable

from jaxdist.core import heap
from jaxdist.core.errors import PipelineKeyError, SpecError
from jaxdist.core.runtime import StageRuntime
from jaxdist.core.weights.uri import clip

__all__ = ["LEASE_PERIOD_S", "MAX_KEY_BYTES", "MAX_LEASE_S", "MIN_KEY_BYTES", "LoadedPipelines",
           "PipelineShapes", "stop_unloaded"]

log = logging.getLogger(__name__)

MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 64
"""The size of a pipeline key (``LoadStageRequest.pipeline_key``); coordinators send 32."""

LEASE_PERIOD_S = 1.0
"""How often leases are checked."""
MAX_LEASE_S = 86400.0


def stop_unloaded(runtimes: list[StageRuntime]) -> int:
    """Stop the stages just taken out (emptying ``runtimes``), then give their memory back:
    a collection for the cycles that hold a stage's executables and buffers, and the free heap
    to the OS (``heap.release_free_heap``), else a worker that loads and unloads stages keeps
    its peak resident. Returns how many were stopped."""
    n = len(runtimes)
    while runtimes:
        runtimes.pop().stop()
    if n:
        gc.collect()
        heap.release_free_heap()
    return n


class PipelineShapes:
    """One pipeline's compiled-shape budget here (a ``jaxdist.core.runtime.ShapeBudget``): a
    view of :class:`LoadedPipelines`' count for it."""

    def __init__(self, pipelines: LoadedPipelines, pipeline_id: str) -> None:
        self._pipelines = pipelines
        self.pipeline_id = pipeline_id
        self.limit = pipelines.max_compiled_shapes

    def held(self) -> int:
        return self._pipelines.shapes_held(self.pipeline_id)

    def charge(self, n: int) -> bool:
        return self._pipelines.charge_shapes(self.pipeline_id, n) is None

    def refund(self, n: int) -> None:
        self._pipelines.refund_shapes(self.pipeline_id, n)


class LoadedPipelines:
    """The stage runtimes of one worker by ``(pipeline_id, stage_index)``, with the keys,
    leases and compiled-shape counts of their pipelines. Thread-safe; :meth:`get` and
    :meth:`key_matches`, called per frame on the data-plane loop, take no lock.

    Args:
        address: the worker's address, for error messages.
        subscribed: whether anyone subscribes to a pipeline's results here (``Hub.subscribed``);
            what keeps a leased pipeline loaded.
        max_compiled_shapes: input shapes the stages of one pipeline may have compiled here
            together (``--max-compiled-shapes``); 0: no bound.
    """

    def __init__(self, address: str, subscribed: Callable[[str], bool], *,
                 max_compiled_shapes: int = 0) -> None:
        self.address = address
        self.max_compiled_shapes = max_compiled_shapes
        self._subscribed = subscribed
        self._stages: dict[tuple[str, int], StageRuntime] = {}
        self._lock = threading.Lock()
        # pipeline -> [lease seconds, when it was last seen subscribed]; see watch_leases
        self._leases: dict[str, list[float]] = {}
        # pipeline -> its key (LoadStageRequest.pipeline_key), while a stage of it is loaded
        self._keys: dict[str, bytes] = {}
        # pipeline -> input shapes its stages hold compiled, or reserved by loads under way;
        # an entry goes when it falls to 0
        self._shapes: dict[str, int] = {}

    def runtimes(self) -> list[StageRuntime]:
        """The loaded stages, as they are now."""
        with self._lock:
            return list(self._stages.values())

    def get(self, pipeline_id: str, stage: int) -> StageRuntime | None:
        """The loaded stage ``stage`` of ``pipeline_id``, if any (per frame: no lock)."""
        return self._stages.get((pipeline_id, stage))

    # -- keys -------------------------------------------------------------------------------

    def key_matches(self, pipeline_id: str, key: bytes) -> bool:
        """Whether ``key`` is ``pipeline_id``'s key; a pipeline loaded nowhere here has none,
        and matches nothing but the empty key. Compared in constant time."""
        return hmac.compare_digest(self._keys.get(pipeline_id, b""), key)

    def hop_key(self, pipeline_id: str) -> bytes | None:
        """The key of ``pipeline_id`` (``b""``: it has none), which its hop credential is made
        from (``transport/hop.py``); ``None`` when no stage of it is loaded here."""
        return self._keys.get(pipeline_id)

    def opens(self, pipeline_id: str, key: bytes) -> bool:
        """Whether ``key`` opens ``pipeline_id``: its key, or any key for a pipeline not
        loaded here (a subscription made before it loads is checked again on each event)."""
        return pipeline_id not in self._keys or self.key_matches(pipeline_id, key)

    def check_key(self, what: str, pipeline_id: str, key: bytes) -> None:
        """Raise unless ``key`` opens ``pipeline_id`` (:meth:`opens`).

        Raises:
            PipelineKeyError: the pipeline was loaded by another coordinator, with another key.
        """
        if not self.opens(pipeline_id, key):
            raise PipelineKeyError(
                f"{what}: pipeline {clip(pipeline_id, 64)!r} on worker {self.address} was "
                f"loaded by another coordinator; the pipeline key presented "
                f"({'none' if not key else f'{len(key)} bytes'}) is not its key. The worker "
                f"token alone opens only shared pipelines (jaxdist deploy)")

    @staticmethod
    def check_key_size(pipeline_id: str, key: bytes) -> None:
        """Raise unless ``key`` is empty (a shared pipeline) or of a pipeline key's size.

        Raises:
            SpecError: a key of another size.
        """
        if key and not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise SpecError(f"LoadStage: pipeline_key of pipeline {clip(pipeline_id, 64)!r} is "
                            f"{len(key)} bytes; expected none (a shared pipeline) or "
                            f"{MIN_KEY_BYTES} to {MAX_KEY_BYTES} random bytes")

    def stage_ids(self, what: str, pipeline_id: str, key: bytes) -> list[str]:
        """The stage ids of ``pipeline_id`` loaded here, once ``key`` opens it.

        Raises:
            PipelineKeyError: as :meth:`check_key`.
        """
        with self._lock:
            self.check_key(what, pipeline_id, key)
            return [rt.stage_id for rt in self._stages.values() if rt.pipeline_id == pipeline_id]

    def _forget_keys(self) -> None:
        """Drop the keys of pipelines with no stage left here (under ``_lock``)."""
        for pipeline_id in set(self._keys) - {k[0] for k in self._stages}:
            del self._keys[pipeline_id]

    # -- compiled shapes --------------------------------------------------------------------

    def shape_budget(self, pipeline_id: str) -> PipelineShapes:
        """``pipeline_id``'s compiled-shape budget, for its stage runtimes."""
        return PipelineShapes(self, pipeline_id)

    def shapes_held(self, pipeline_id: str) -> int:
        """Input shapes ``pipeline_id``'s stages hold compiled here, or loads reserved."""
        with self._lock:
            return self._shapes.get(pipeline_id, 0)

    def charge_shapes(self, pipeline_id: str, n: int, *, leaving: int = 0) -> int | None:
        """Charge ``n`` compiled shapes to ``pipeline_id``. ``leaving``: shapes held by a
        stage this load replaces, not counted against the limit (they are given back when the
        old stage stops). Returns None when charged; else, charging nothing, the shapes the
        pipeline holds (less ``leaving``), for the caller's refusal."""
        with self._lock:
            held = self._shapes.get(pipeline_id, 0)
            limit = self.max_compiled_shapes
            if limit and max(held - leaving, 0) + n > limit:
                return max(held - leaving, 0)
            if n:
                self._shapes[pipeline_id] = held + n
            return None

    def refund_shapes(self, pipeline_id: str, n: int) -> None:
        """Give ``n`` compiled shapes of ``pipeline_id`` back."""
        with self._lock:
            left = self._shapes.get(pipeline_id, 0) - n
            if left > 0:
                self._shapes[pipeline_id] = left
            else:
                self._shapes.pop(pipeline_id, None)

    # -- loading and unloading --------------------------------------------------------------

    def install(self, runtime: StageRuntime, key: bytes, *,
                abandoned: Callable[[], bool]) -> tuple[bool, StageRuntime | None]:
        """Put ``runtime`` in its place, under ``key``, unless ``abandoned()`` says its load's
        caller left. Returns ``(installed, the runtime it replaced)``; the caller stops the
        replaced one, or ``runtime`` itself when it was not installed.

        Raises:
            PipelineKeyError: another coordinator loaded the pipeline meanwhile, with another
                key (checked again here, with the install, under one lock).
        """
        slot = (runtime.pipeline_id, runtime.spec.stage_index)
        with self._lock:
            if abandoned():  # it finished after its caller left: nobody would use or unload it
                return False, None
            self.check_key("LoadStage", runtime.pipeline_id, key)
            old = self._stages.pop(slot, None)
            self._stages[slot] = runtime
            self._keys[runtime.pipeline_id] = key
        return True, old

    def lease(self, pipeline_id: str, lease_s: float) -> None:
        """Hold ``pipeline_id``'s stages for a lease of ``lease_s`` seconds (0: pinned).

        Raises:
            SpecError: a lease out of range.
        """
        if not lease_s >= 0 or lease_s > MAX_LEASE_S:
            raise SpecError(f"LoadStage: lease_s {lease_s} is out of range; expected 0 (pinned) "
                            f"to {MAX_LEASE_S:.0f} seconds")
        with self._lock:
            if lease_s > 0:
                self._leases[pipeline_id] = [lease_s, time.monotonic()]
            else:
                self._leases.pop(pipeline_id, None)

    def unload(self, stage_or_pipeline_id: str) -> list[StageRuntime]:
        """Take out the stages whose stage id or pipeline id is the one given, and their
        pipeline's lease; returns them, for the caller to stop."""
        with self._lock:
            keys = [k for k, rt in self._stages.items()
                    if stage_or_pipeline_id in (rt.stage_id, rt.pipeline_id)]
            runtimes = [self._stages.pop(k) for k in keys]
            self._leases.pop(stage_or_pipeline_id, None)
            self._forget_keys()
        return runtimes

    def clear(self) -> list[StageRuntime]:
        """Take out every stage (the worker stops); returns them, for the caller to stop."""
        with self._lock:
            runtimes = list(self._stages.values())
            self._stages.clear()
            self._keys.clear()
            self._leases.clear()
        return runtimes

    # -- leases -----------------------------------------------------------------------------

    def watch_leases(self, stop: threading.Event) -> None:
        """Until ``stop`` is set, unload every leased pipeline that nobody has subscribed to
        here for its lease (run in a thread)."""
        while not stop.wait(LEASE_PERIOD_S):
            self.expire_leases(time.monotonic())

    def expire_leases(self, now: float) -> None:
        """Unload, and stop, the stages of each pipeline whose lease ran out by ``now``."""
        with self._lock:
            leases = list(self._leases.items())
        for pipeline_id, lease in leases:
            if self._subscribed(pipeline_id):
                lease[1] = now
                continue
            if now - lease[1] <= lease[0]:
                continue
            with self._lock:
                if self._leases.get(pipeline_id) is not lease:
                    continue  # reloaded meanwhile
                del self._leases[pipeline_id]
                keys = [k for k in self._stages if k[0] == pipeline_id]
                runtimes = [self._stages.pop(k) for k in keys]
                self._forget_keys()
            n = stop_unloaded(runtimes)
            if n:
                log.warning("pipeline %s: no coordinator has subscribed to it for %.0f s "
                            "(its lease); unloaded its %d stage(s)", pipeline_id[:64],
                            lease[0], n)
