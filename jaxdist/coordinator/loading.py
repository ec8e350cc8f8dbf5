"""Loading a pipeline's stages onto their workers: all at once, with live phases, and cancellable.

:func:`load_stages` (behind :meth:`Cluster.load_stages <jaxdist.coordinator.cluster.Cluster>`)
starts every stage's load in a thread of its own. A stage goes through these phases:

- ``upload``: the worker lacked the artifact (digest first), so it is uploaded;
- ``load``, ``compile``, ``bind``: the worker's own phases inside ``LoadStage``
  (``worker/loads.py``): the artifact read and vetted, every shape bucket compiled, the weights
  bound;
- ``loaded``.

The worker knows its phase and the unary ``LoadStage`` does not carry it, so while calls run,
this module asks each of their workers for ``Info`` every :data:`POLL_S` seconds and reads its
``loading`` list. A stage the worker does not list yet shows ``loading`` until it does, or
until its call returns. After each poll, a changed line is drawn through
``progress(what, done, total)``, one part per stage joined by ``" | "``; a part under way ends
with ``...``, which :class:`jaxdist.cli.progress.ProgressBar` follows with a moving timer.

A ``KeyboardInterrupt`` while waiting (Ctrl-C), or :meth:`Cluster.interrupt` from another
thread, cancels every call in flight. The worker then abandons the load: it finishes only the
step under way (a compile cannot be stopped), starts no other, and discards the stage. What
had loaded is unloaded again, and :class:`LoadInterrupted` names what was under way. A stage
that fails cancels the others the same way, and its error is raised.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from jaxdist.core.errors import ArtifactError, JaxdistError
from jaxdist.core.spec import StageSpec
from jaxdist.core.transport.client import Call, WorkerClient
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["POLL_S", "LoadInterrupted", "Shipped", "load_stages"]

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.5           # how often the workers' phases are read while stages load
UNLOAD_TIMEOUT_S = 5.0  # per stage, when an interrupted or failed load is rolled back

_UNDER_WAY = {"": "starting", "upload": "uploading", "load": "loading", "compile": "compiling",
              "bind": "binding weights"}
_WHILE = {"upload": "uploading", "load": "loading", "compile": "compiling",
          "bind": "binding the weights of"}


class LoadInterrupted(KeyboardInterrupt):
    """Loading stages was interrupted (Ctrl-C, or :meth:`Cluster.interrupt`). The calls in
    flight were cancelled and the stages loaded so far unloaded. The message names what was
    under way, e.g. ``interrupted while compiling stage 1 on h2:50051``."""


@dataclass(frozen=True)
class Shipped:
    """One stage loaded by :func:`load_stages`."""

    uploaded: bool           # the worker lacked the artifact, so it was uploaded
    reply: pb.LoadStageReply


@dataclass
class _Stage:
    """What one stage's load is doing (under the run's lock)."""

    address: str
    phase: str = ""             # "" (starting) | upload | load | compile | bind | loaded, or
    #                             failed | cancelled | interrupted | unloaded
    note: str = ""              # once loaded: on where, how big, how long it compiled
    call: Call[Any] | None = None
    loading: bool = False       # its LoadStage call is in flight: the worker reports its phase


PIPELINE_KEY_BYTES = 32


def new_pipeline_key() -> bytes:
    """A fresh pipeline key: the capability that opens a pipeline's stages on the workers
    (``LoadStageRequest.pipeline_key``). Whoever holds only the worker token cannot reach a
    pipeline loaded with a key: not its results, its frames, nor its sessions."""
    return secrets.token_bytes(PIPELINE_KEY_BYTES)


class _Run:
    """One :func:`load_stages`: the stages' phases, their calls, and the progress line."""

    def __init__(self, pipeline_id: str, specs: Sequence[StageSpec],
                 placed: Sequence[WorkerClient], fetch: Callable[[str], bytes] | None,
                 progress: Callable[[str, int, int], None], interrupted: threading.Event,
                 lease_s: float = 0.0, key: bytes = b"") -> None:
        self.pipeline_id = pipeline_id
        self.lease_s = lease_s
        self.key = key
        self.specs = specs
        self.placed = placed
        self.fetch = fetch
        self.progress = progress
        self.interrupted = interrupted
        self.stopping = threading.Event()  # no call may start any more
        self.stages = [_Stage(c.address) for c in placed]
        self.lock = threading.Lock()
        self.shown = ""

    # -- one stage, in its own thread -------------------------------------------------------

    def ship(self, k: int) -> Shipped:
        client, spec = self.placed[k], self.specs[k]
        digest = spec.artifact_digest
        uploaded = not client.has_artifact(digest)
        if uploaded:
            if self.fetch is None:
                raise ArtifactError(f"stage {k}: artifact {digest} is not on worker "
                                    f"{client.address}, and this pipeline has no artifact "
                                    f"source to upload it from (attach with a registry)")
            data = self.fetch(digest)
            self.set(k, "upload")
            self.run(k, client.start_upload_artifact(digest, data))
        self.set(k, "load", loading=True)
        try:
            reply = self.run(k, client.start_load_stage(spec, self.pipeline_id,
                                                           lease_s=self.lease_s, key=self.key))
        except ArtifactError as exc:  # name the exporting versions beside the worker's
            v = spec.versions
            raise ArtifactError(f"{exc} [stage {k} was exported with jax {v.jax}, jaxlib "
                                f"{v.jaxlib}, StableHLO {v.stablehlo}]", code=exc.code) from None
        note = ("already loaded" if reply.already_loaded else
                f"{reply.weight_bytes / 1e6:.1f} MB, compile {reply.compile_s:.1f}s")
        self.set(k, "loaded", note=f"on {client.address} ({note})")
        return Shipped(uploaded, reply)

    def run(self, k: int, call: Call[T]) -> T:
        """Wait for a call; it is cancelled at once if the run is stopping (or stops)."""
        with self.lock:
            self.stages[k].call = call
            if self.stopping.is_set():
                call.cancel()
        try:
            return call.result()
        finally:
            with self.lock:
                self.stages[k].call = None
                self.stages[k].loading = False

    # -- the phases and the line ------------------------------------------------------------

    def set(self, k: int, phase: str, *, note: str = "", loading: bool = False) -> None:
        """Record a phase; it is drawn at the next :meth:`show`."""
        with self.lock:
            st = self.stages[k]
            st.phase, st.note, st.loading = phase, note, loading

    def poll(self) -> None:
        """Read the phase of each LoadStage in flight from its worker's ``Info``."""
        with self.lock:
            wanted = {st.address for st in self.stages if st.loading}
        for client in {c.address: c for c in self.placed}.values():
            if client.address not in wanted:
                continue
            try:
                loading = client.info(timeout=2 * POLL_S).loading
            except JaxdistError as exc:  # only the display misses it; the call reports errors
                log.debug("no phases from %s: %s", client.address, exc)
                continue
            phases = {entry.stage_id: entry.phase for entry in loading}
            with self.lock:
                for spec, st in zip(self.specs, self.stages):
                    if st.loading and st.address == client.address and phases.get(spec.stage_id):
                        st.phase = phases[spec.stage_id]
        self.show()

    def show(self) -> None:
        """Call ``progress`` if the line changed. Only the waiting thread draws, once per poll,
        so phases that pass within one poll (an instant upload) make no line of their own."""
        with self.lock:
            parts = []
            for k, st in enumerate(self.stages):
                if st.phase == "loaded":
                    parts.append(f"stage {k} loaded {st.note}")
                elif st.loading or st.phase in _UNDER_WAY:  # a worker's phase, as it names it
                    parts.append(f"stage {k} {_UNDER_WAY.get(st.phase, st.phase)}...")
                else:
                    parts.append(f"stage {k} {st.phase}")
            text = " | ".join(parts)
            if text != self.shown:
                self.shown = text
                self.progress(text, sum(st.phase == "loaded" for st in self.stages),
                              len(self.stages))

    def under_way(self) -> str:
        """What was loading, for :class:`LoadInterrupted`: ``compiling stage 1 on h2:50051``."""
        with self.lock:
            busy = [f"{_WHILE.get(st.phase, 'loading')} stage {k} on {st.address}"
                    for k, st in enumerate(self.stages) if st.phase != "loaded"]
        return ", ".join(busy) if busy else "loading stages"

    # -- rolling back -----------------------------------------------------------------------

    def abort(self, futures: Sequence[concurrent.futures.Future[Shipped]], why: str) -> None:
        """Cancel every call in flight, wait for the stage threads (briefly: their calls are
        cancelled), and unload every stage whose ``LoadStage`` was sent."""
        self.stopping.set()
        with self.lock:
            calls = [st.call for st in self.stages if st.call is not None]
            sent = [k for k, st in enumerate(self.stages) if st.phase not in ("", "upload")]
        for call in calls:
            call.cancel()
        concurrent.futures.wait(futures, timeout=UNLOAD_TIMEOUT_S)
        for k in sent:
            try:
                self.placed[k].unload_stage(self.specs[k].stage_id, timeout=UNLOAD_TIMEOUT_S)
            except JaxdistError as exc:
                log.warning("could not unload stage %s from %s: %s", self.specs[k].stage_id,
                            self.placed[k].address, exc)
        with self.lock:
            for st in self.stages:
                if st.phase != "loaded" and st.phase != "failed":
                    st.phase = why
                elif st.phase == "loaded":
                    st.phase, st.note = "unloaded", ""
        self.show()


def load_stages(pipeline_id: str, specs: Sequence[StageSpec], placed: Sequence[WorkerClient],
                fetch: Callable[[str], bytes] | None, progress: Callable[[str, int, int], None],
                interrupted: threading.Event, lease_s: float = 0.0, key: bytes = b""
                ) -> list[Shipped]:
    """Load ``specs[k]`` on ``placed[k]``, all at once; see the module docstring.

    Args:
        pipeline_id: the pipeline the stages belong to.
        specs: the specs as they are to be loaded (``next_hop`` and ``stage_id`` set).
        placed: the worker of each stage.
        fetch: the artifact of a digest, for a worker that lacks it; ``None``: none to upload.
        progress: ``progress(what, done, total)``, called when a phase changes.
        interrupted: set from another thread to interrupt (:meth:`Cluster.interrupt`).
        lease_s: the workers unload the stages once no coordinator has subscribed to the
            pipeline for this long; 0: pinned (``jaxdist deploy``).
        key: the pipeline's key (:func:`new_pipeline_key`); empty: a shared pipeline.

    Returns:
        How each stage was loaded, in order.

    Raises:
        LoadInterrupted: Ctrl-C or ``interrupted``; nothing of this call stays loaded.
        ArtifactError: the worker refused an artifact, or it is missing and ``fetch`` is
            ``None``. Other typed errors of the workers name the worker. Nothing of this call
            stays loaded.
    """
    run = _Run(pipeline_id, specs, placed, fetch, progress, interrupted, lease_s, key)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(specs)),
                                                 thread_name_prefix="load-stage")
    futures: list[concurrent.futures.Future[Shipped]] = []
    try:
        if interrupted.is_set():
            raise LoadInterrupted("interrupted before loading")
        run.show()
        futures = [pool.submit(run.ship, k) for k in range(len(specs))]
        while True:
            done, pending = concurrent.futures.wait(
                futures, timeout=POLL_S, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = [(k, e) for k, e in ((k, f.exception()) for k, f in enumerate(futures)
                                          if f in done) if e is not None]
            if failed:  # the first stage to fail; the others are cancelled below
                run.set(failed[0][0], "failed")
                raise failed[0][1]
            if not pending:
                run.show()
                return [f.result() for f in futures]
            if interrupted.is_set():
                raise LoadInterrupted(f"interrupted while {run.under_way()}")
            run.poll()
    except KeyboardInterrupt as exc:
        message = str(exc) if isinstance(exc, LoadInterrupted) else \
            f"interrupted while {run.under_way()}"
        run.abort(futures, "interrupted")
        raise LoadInterrupted(message) from None
    except BaseException:
        run.abort(futures, "cancelled")
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
