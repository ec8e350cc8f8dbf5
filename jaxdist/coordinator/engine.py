"""The long-lived generation engine: requests from any thread join and leave one running batch.

The engine drives a pipeline with the causal-LM step contract (:mod:`~jaxdist.coordinator.steps`);
a model's :class:`~jaxdist.export.causal_lm.CausalLM` gives its settings
(:meth:`Engine.for_model`). The KV caches live on the workers in one session, with
``max_slots`` slots. A request gets a slot when one is free (else it waits, up to ``max_queue``
of them) and owns it until it ends, so requests join and leave at any step (continuous
batching). One thread runs the steps: each step is either one prefill chunk of one request, at
the smallest prefill bucket that holds it, or one decode token for a share of the decoding
requests, with ``depth`` steps in flight on disjoint rows. Several waiting prompts are
prefilled in one step (up to the contract's ``prefill_rows``, in chunks of the smallest bucket).
The session, and the KV memory it holds on the workers, outlives idle gaps of up to
``keep_session_s``, so a request after a pause does not pay the allocation in its time to first
token; it is ended after a longer gap. A worker that reclaimed it meanwhile (its
``--session-idle-timeout`` was shorter) costs the next requests one rebuild on a new session,
as after a failover, never an error.

Failover: when a worker dies and the pipeline can move its stages to a spare
(:meth:`jaxdist.coordinator.pipeline.Pipeline.recover`), the engine opens a new session and
rebuilds every live request's KV cache the way it was built: its prompt prefilled in the same
chunks, then each token it generated but the last decoded again (their sampled outputs unused),
then it goes on decoding. Tokens already streamed are kept, and the engine needs no history
beyond the tokens themselves. The rebuilt cache is the one the dead worker held, bit for bit, so
the output is that of a run with no fault (``bench/chaos.py`` checks it against solo runs). A
chunked prefill of prompt and tokens together would take fewer steps, but its attention runs
another path than the decode kernel's, and a near tie could then pick another token.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, Self

import numpy as np

from jaxdist.coordinator.detokenizer import Detokenizer, TextStream
from jaxdist.coordinator.request import Delta, GenerationResult, RequestStream, SamplingParams
from jaxdist.coordinator.steps import StepPipeline, check_request, default_depth, step_inputs
from jaxdist.core.errors import JaxdistError, LimitError, SessionError, SpecError
from jaxdist.export.causal_lm import STEP_INPUTS, CausalLM

__all__ = ["Engine", "EngineClosed", "EngineObserver", "QueueFull", "RequestFailed"]

log = logging.getLogger(__name__)


class EngineObserver(Protocol):
    """Hooks for metrics, called from the engine's step-loop thread, in order per request:
    ``queued``, ``scheduled`` (unless aborted while waiting), ``token``..., ``finished``.

    They must be quick: the next step waits for them. An exception in one is logged and
    otherwise ignored.
    """

    def queued(self, request_id: str, prompt_tokens: int) -> None:
        """A request was accepted."""

    def scheduled(self, request_id: str, queue_s: float) -> None:
        """Its first step was sent, ``queue_s`` seconds after it was submitted (its wait for a
        KV slot and for its turn)."""

    def token(self, request_id: str, n_new: int, since_last_s: float, first: bool) -> None:
        """It got ``n_new`` tokens, ``since_last_s`` after its previous ones (after its
        submission for the ``first``: the time to first token)."""

    def finished(self, request_id: str, reason: str, prompt_tokens: int,
                 completion_tokens: int, e2e_s: float) -> None:
        """It ended: ``reason`` is a finish reason, or ``"error"`` when the pipeline failed it.
        ``e2e_s`` is the time from submission to the end."""

    def step(self, rows: int, tokens_per_row: int, seconds: float) -> None:
        """A step of ``rows`` requests (before padding) and ``tokens_per_row`` tokens each (1 for
        decode, a prefill bucket for prefill) came back ``seconds`` after it was sent."""


class QueueFull(LimitError):
    """Every KV slot is taken and ``max_queue`` requests already wait for one: retry later.

    Example:
        >>> try:                                                 # doctest: +SKIP
        ...     stream = engine.submit(ids, params)
        ... except QueueFull as exc:  # RESOURCE_EXHAUSTED: jaxdist serve answers 503
        ...     print(exc)
    """


class EngineClosed(JaxdistError):
    """The engine was closed (or its step loop failed) and takes no more requests."""

    code = "UNAVAILABLE"


class RequestFailed(JaxdistError):
    """One request failed in the engine itself, not on a worker: building its step's inputs or
    reading its tokens raised (a bug, or a value that slipped past the checks at submission).
    Only that request ends with it; the engine and the other requests go on. The original
    exception is the ``__cause__``.

    Example:
        >>> try:                                                  # doctest: +SKIP
        ...     stream.result()
        ... except RequestFailed as exc:  # jaxdist serve answers 500
        ...     print(exc.__cause__)
    """


@dataclasses.dataclass(eq=False)
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    stream: RequestStream
    text: TextStream | None
    submitted: float
    slot: int = -1
    pos: int = 0                 # tokens in the KV cache
    pending: list[int] = dataclasses.field(default_factory=list)  # left to prefill
    tokens: list[int] = dataclasses.field(default_factory=list)
    recompute: bool = False      # the prefill rebuilds the cache after a failover: its token
    in_flight: bool = False      # is known already
    replay: list[int] = dataclasses.field(default_factory=list)  # then decoded again, unused
    chunks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # prefilled as
    plan: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (tokens, bucket);
    # a rebuild prefills in the chunks of the first build (plan), one request per step
    scheduled: float = 0.0       # its first step was sent
    first: float = 0.0
    last: float = 0.0
    abort: bool = False          # abort() was called; the loop ends it
    done: bool = False
    stop_at: int = -1            # a stop string: tokens kept
    said: int = 0                # observer events sent: 1 queued, 2 scheduled


@dataclasses.dataclass
class _Step:
    future: concurrent.futures.Future[dict[str, np.ndarray]]
    rows: list[tuple[_Request, list[int]]]
    tokens_per_row: int
    sent: float


class Engine:
    """A long-lived generation loop over a causal-LM pipeline: submit from any thread, stream
    the deltas back, abort at any time.

    Args:
        pipeline: a deployed pipeline (or an in-process one).
        input_dtypes: dtype of each step input, from the model's signature.
        max_slots: KV-cache slots the model was exported with: requests running at once.
        max_seq: cache length per slot.
        prefill_buckets: prompt chunk lengths the workers compiled.
        eos_ids: the model's end-of-sequence ids.
        tokenizer: ``decode(list[int]) -> str``; gives each delta its text and serves stop
            strings. ``None``: deltas carry ids only, and stop strings are refused.
        depth: steps kept in flight at once, on disjoint requests. With ``depth`` equal to the
            number of stages, every stage computes a different part of the batch at the same
            time (pipeline parallelism); 1 is best for a single process.
        max_failovers: failovers in a row without a step completing in between before the
            engine gives up and fails the running requests (a spare that dies too, a worker
            that keeps crashing). Counted per engine, since one failover serves every running
            request; a completed step resets it. 0: never fail over.
        max_queue: requests that may wait for a slot; one more is refused with
            :class:`QueueFull`. ``None``: no bound.
        observer: metrics hooks, see :class:`EngineObserver`.
        prefill_rows: the most prompts one prefill step carries, in chunks of the smallest
            bucket; the contract's :attr:`~jaxdist.export.causal_lm.CausalLM.prefill_rows`
            (the workers compiled those shapes). 1: one prompt per prefill step.
        keep_session_s: seconds an idle engine keeps its session, and the workers its KV
            memory, for the next request; 0 ends it as soon as the last request ends.
        vocab_size: token ids the model knows: prompt ids, ``top_k`` and ``stop_ids`` are
            checked against it at :meth:`submit`. ``None``: not known (ids must fit int32).

    A request is checked when it is submitted (:func:`~jaxdist.coordinator.steps.check_request`),
    so no value of one reaches a step. Should one request still fail in the engine (building
    its inputs, decoding its text), it alone ends, with :class:`RequestFailed`; a failed step
    on a worker fails over, or fails the requests of the session, as before. Only a fault of
    the engine itself stops it: :attr:`stopped` then says why, and :meth:`submit` raises
    :class:`EngineClosed`.

    Example:
        >>> import numpy as np
        >>> from jaxdist import Engine, InProcessPipeline, Model, Unit
        >>> from jaxdist.coordinator.request import SamplingParams
        >>> def next_token(params, state, carry):  # a stand-in LM: the next id is the last + 1
        ...     rows = jax.numpy.arange(carry["tokens"].shape[0])
        ...     last = carry["tokens"][rows, carry["length"] - 1]
        ...     return {"token": last + 1}, {}
        >>> inputs = {k: ("b", "int32") for k in ("slot", "pos", "length", "top_k", "seed")}
        >>> inputs |= {"tokens": ("b, s", "int32"), "temperature": ("b", "float32"),
        ...            "top_p": ("b", "float32")}
        >>> model = Model("counter", [Unit("next", next_token)], inputs=inputs)
        >>> with InProcessPipeline(model, weights_roots=[]) as pipe, Engine(
        ...         pipe, input_dtypes={k: v[1] for k, v in inputs.items()}, max_slots=2,
        ...         max_seq=32, prefill_buckets=[4, 8]) as engine:
        ...     stream = engine.submit([1, 2, 3], SamplingParams(max_tokens=4))
        ...     print([d.token_ids for d in stream], stream.result().finish_reason)
        [(4,), (5,), (6,), (7,)] length
    """

    def __init__(self, pipeline: StepPipeline, *, input_dtypes: Mapping[str, str],
                 max_slots: int, max_seq: int, prefill_buckets: Sequence[int],
                 eos_ids: Iterable[int] = (), tokenizer: Detokenizer | None = None,
                 depth: int = 1, max_failovers: int = 3, max_queue: int | None = 256,
                 observer: EngineObserver | None = None, prefill_rows: int = 1,
                 keep_session_s: float = 60.0, vocab_size: int | None = None) -> None:
        for name, value, least in (("max_slots", max_slots, 1), ("max_seq", max_seq, 2),
                                   ("prefill_rows", prefill_rows, 1),
                                   ("keep_session_s", keep_session_s, 0),
                                   ("depth", depth, 1), ("max_failovers", max_failovers, 0),
                                   ("max_queue", 0 if max_queue is None else max_queue, 0)):
            if value < least:
                raise SpecError(f"{name} must be >= {least}, got {value}")
        if not prefill_buckets or min(prefill_buckets) < 1:
            raise SpecError(f"prefill_buckets must be lengths >= 1, got {list(prefill_buckets)}")
        if vocab_size is not None and vocab_size < 1:
            raise SpecError(f"vocab_size must be >= 1 or None, got {vocab_size}")
        unknown = sorted(set(input_dtypes) - set(STEP_INPUTS))
        if unknown:  # else every step would fail to build: refused here, once
            raise SpecError(f"input_dtypes: the model expects step inputs {unknown} that "
                            f"generation does not fill; it fills {list(STEP_INPUTS)}")
        self.pipeline = pipeline
        self.dtypes = dict(input_dtypes)
        self.max_slots = max_slots
        self.max_seq = max_seq
        self.buckets = sorted(prefill_buckets)
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = tokenizer
        self.depth = depth
        self.max_failovers = max_failovers
        self.max_queue = max_queue
        self.observer = observer
        self.prefill_rows = min(prefill_rows, max_slots)
        self.keep_session_s = keep_session_s
        self.vocab_size = vocab_size
        self._cv = threading.Condition()
        # Shared with submitters, under _cv:
        self._waiting: collections.deque[_Request] = collections.deque()
        self._active: list[_Request] = []   # each owns a slot
        self._live: dict[str, _Request] = {}
        self._free = list(range(max_slots))
        self._arrivals: list[_Request] = []
        self._aborts: list[_Request] = []
        self._closing = False
        self._fatal: BaseException | None = None
        self._steps = 0
        # The step loop's own:
        self._inflight: collections.deque[_Step] = collections.deque()
        self._session: str | None = None
        self._idle_since: float | None = None  # the session has had no request since then
        self._resumed = False  # a step went out on a session that had been idle; none is back
        self._step_ids: Iterator[int] = itertools.count()
        self._failovers = 0
        self._recomputed = 0
        self._last_was_prefill = False  # the step loop's: prefill and decode alternate
        # Deltas and errors of this round, handed over at its end (after an idle engine
        # ended its session, so a caller that saw its last request end finds it ended).
        self._outbox: list[tuple[RequestStream, Delta | BaseException,
                                 GenerationResult | None]] = []
        self._exiting = False  # closing at the interpreter's exit (see _close_at_exit)
        self._thread = threading.Thread(target=self._run, name="jaxdist-engine", daemon=True)
        self._thread.start()
        # An engine never closed still ends its kept session when the interpreter exits, so
        # remote workers do not hold its KV memory until their idle timeout.
        self._at_exit = weakref.finalize(self, self._close_at_exit)

    @classmethod
    def for_model(cls, pipeline: StepPipeline, lm: CausalLM, *,
                  tokenizer: Detokenizer | None = None, depth: int | None = None,
                  max_failovers: int = 3, max_queue: int | None = 256,
                  observer: EngineObserver | None = None, keep_session_s: float = 60.0,
                  vocab_size: int | None = None) -> Engine:
        """The engine for a deployed causal LM, configured by its contract.

        Args:
            pipeline: the deployed pipeline of the model ``lm`` describes (or an in-process one).
            lm: the model's contract, from its exporter (``LoadedModel.causal_lm``) or its
                manifest (``CausalLM.from_options(manifest.model.options, inputs=...)``).
            tokenizer: gives deltas their text and serves stop strings.
            depth: steps in flight; default: one per stage of a deployed pipeline
                (``len(pipeline.specs)``), 1 for a pipeline without stage specs.
            max_failovers, max_queue, observer, keep_session_s: see :class:`Engine`.
            vocab_size: token ids the model knows; default: the tokenizer's ``vocab_size``
                (when it has one).

        Example:
            >>> loaded = load_model("SmolLM2.gguf", roots=["/models"])   # doctest: +SKIP
            >>> pipe = cluster.deploy(loaded.model, stages=2)            # doctest: +SKIP
            >>> engine = Engine.for_model(pipe, loaded.causal_lm, tokenizer=loaded.tokenizer)
            ... # doctest: +SKIP
        """
        return cls(pipeline, input_dtypes=lm.input_dtypes, max_slots=lm.max_slots,
                   max_seq=lm.max_seq, prefill_buckets=lm.prefill_buckets, eos_ids=lm.eos_ids,
                   tokenizer=tokenizer, depth=default_depth(pipeline) if depth is None else depth,
                   max_failovers=max_failovers, max_queue=max_queue, observer=observer,
                   prefill_rows=lm.prefill_rows, keep_session_s=keep_session_s,
                   vocab_size=(vocab_size if vocab_size is not None
                               else getattr(tokenizer, "vocab_size", None)))

    # -- the callers' side ------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(), *,
               request_id: str | None = None) -> RequestStream:
        """Queue a request; it starts as soon as a KV slot is free. Thread-safe.

        Args:
            prompt_ids: the prompt's token ids.
            params: sampling and stopping.
            request_id: its id (unique among the live requests); default: a random one.

        Returns:
            The stream of its deltas.

        Raises:
            SpecError: the prompt is empty or does not fit the cache; stop strings without a
                tokenizer; the id is taken.
            ParamError: a prompt id, ``top_k`` or a stop id outside the vocabulary.
            QueueFull: every slot is busy and ``max_queue`` requests already wait.
            EngineClosed: the engine was closed.
        """
        return self._submit(prompt_ids, params, request_id=request_id)

    def _submit(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                request_id: str | None = None, where: str | None = None,
                on_push: Callable[[], None] | None = None) -> RequestStream:
        rid = uuid.uuid4().hex if request_id is None else request_id
        prompt = list(prompt_ids)
        check_request(prompt, params, max_seq=self.max_seq, vocab_size=self.vocab_size,
                      where=where or f"the prompt of request {rid!r}",
                      context=f"{where}: " if where else f"request {rid!r}: ")
        prompt = [int(t) for t in prompt]
        if params.stop_strings and self.tokenizer is None:
            raise SpecError(f"request {rid!r} has stop_strings {params.stop_strings!r}, but "
                            f"the engine has no tokenizer to find them in the text; pass "
                            f"tokenizer= or use stop_ids")
        stream = RequestStream(rid, prompt, self.abort)
        stream._on_push = on_push
        text = (TextStream(self.tokenizer, params.stop_strings)
                if self.tokenizer is not None else None)
        req = _Request(rid, prompt, params, stream, text, time.perf_counter(),
                       pending=list(prompt))
        with self._cv:
            if self._closing or self._fatal is not None:
                raise EngineClosed(f"the generation engine is closed; request {rid!r} was "
                                   f"not queued") from self._fatal
            if rid in self._live:
                raise SpecError(f"request id {rid!r} is already running or waiting; give each "
                                f"request its own id")
            if (self.max_queue is not None and not self._free
                    and len(self._waiting) >= self.max_queue):
                raise QueueFull(f"request {rid!r}: all {self.max_slots} KV slots are busy and "
                                f"{len(self._waiting)} requests already wait (max_queue="
                                f"{self.max_queue}); retry later or raise max_queue")
            self._live[rid] = req
            self._waiting.append(req)
            self._arrivals.append(req)
            self._admit_locked()
            self._cv.notify_all()
        return stream

    def abort(self, request_id: str) -> bool:
        """End a request: its stream's last delta has finish reason ``"abort"``, and its slot
        is free again before the step after the one in flight is sent. Thread-safe.

        Returns:
            Whether the request was waiting or running (``False``: unknown or already ended).
        """
        with self._cv:
            req = self._live.get(request_id)
            if req is None:
                return False
            if not req.abort:
                req.abort = True
                self._aborts.append(req)
                self._cv.notify_all()
            return True

    @property
    def num_running(self) -> int:
        """Requests that hold a KV slot."""
        with self._cv:
            return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a KV slot."""
        with self._cv:
            return len(self._waiting)

    @property
    def slots_in_use(self) -> int:
        """KV slots held by requests (the others are free)."""
        with self._cv:
            return self.max_slots - len(self._free)

    @property
    def steps(self) -> int:
        """Steps completed since the engine started."""
        with self._cv:
            return self._steps

    @property
    def stopped(self) -> str | None:
        """Why the engine takes no more requests (closed, or its step loop failed); ``None``
        while it does. ``jaxdist serve``'s ``/health`` answers 503 with it."""
        with self._cv:
            fatal, closing = self._fatal, self._closing
        if fatal is not None:
            return f"the generation engine stopped: {type(fatal).__name__}: {fatal}"
        if closing:
            return "the generation engine was closed"
        return None

    @property
    def recomputed(self) -> int:
        """Requests whose KV cache was rebuilt after a failover, since the engine started."""
        with self._cv:
            return self._recomputed

    def close(self, timeout: float = 60.0) -> None:
        """Abort every request, let the steps in flight finish, end the session, stop the loop.

        The pipeline stays open (it belongs to the caller).
        """
        self._at_exit.detach()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("generation engine: the step loop did not stop within %.0f s (a "
                            "step that never came back?)", timeout)

    def _close_at_exit(self) -> None:
        """:meth:`close` when the interpreter exits with the engine open, quietly: its
        pipeline may be closed already."""
        self._exiting = True
        self.close(10.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- the step loop ----------------------------------------------------------------------

    def _admit_locked(self) -> None:
        """Give free slots to waiting requests, oldest first (holding ``_cv``)."""
        while self._waiting and self._free:
            req = self._waiting.popleft()
            req.slot = self._free.pop(0)
            self._active.append(req)

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as exc:  # a bug: fail every request rather than hang them
            log.exception("generation engine: the step loop failed")
            with self._cv:
                self._fatal = exc
                live = list(self._live.values())
            for req in live:
                self._fail(req, exc)
            self._flush()

    def _iterate(self) -> bool:
        """One round: take arrivals and aborts, send steps, handle one result. Returns False
        once closed."""
        with self._cv:
            while not (self._arrivals or self._aborts or self._active or self._inflight
                       or self._closing):
                if self._session is None:
                    self._cv.wait()
                    continue
                since = self._idle_since if self._idle_since is not None else time.monotonic()
                left = since + self.keep_session_s - time.monotonic()
                if left <= 0:
                    break  # kept long enough: the round ends it
                self._cv.wait(left)
            arrivals, self._arrivals = self._arrivals, []
            aborts, self._aborts = self._aborts, []
            closing = self._closing
            if closing:
                aborts = list(self._live.values())
        try:
            return self._round(arrivals, aborts, closing)
        finally:
            self._flush()

    def _round(self, arrivals: list[_Request], aborts: list[_Request], closing: bool) -> bool:
        for req in arrivals:
            self._announce(req)
        for req in aborts:
            self._end(req, "abort")
        with self._cv:
            active = list(self._active)
        if closing or not active:
            self._settle()
            if closing:
                self._end_session()
            else:
                self._idle()
            return not closing
        try:
            self._send(active)
            if self._inflight:
                self._receive()
        except JaxdistError as exc:
            self._fail_over(exc)
        with self._cv:
            idle = not self._active
        if idle and not self._inflight:
            self._idle()
        return True

    def _idle(self) -> None:
        """Nothing left to run: keep the session (the next request finds its KV memory
        allocated) until it has been idle for ``keep_session_s``, then free the workers'
        memory."""
        if self._session is None:
            return
        if self._idle_since is None:
            self._idle_since = time.monotonic()
        if time.monotonic() - self._idle_since >= self.keep_session_s:
            self._end_session()

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for stream, item, result in outbox:
            stream._push(item, result=result)

    def _next_rows(self, ready: list[_Request], n_active: int
                   ) -> tuple[list[tuple[_Request, list[int]]], int]:
        """The rows of the next step among ``ready`` requests, and its tokens per row.

        Prefill and decode steps alternate while both have work: a burst of new prompts does
        not hold every running stream for a prefill each (their inter-token latency stays
        about two steps), and a new prompt still starts within a step or two.
        """
        prefilling = [r for r in ready if r.pending]
        decoding = [r for r in ready if not r.pending]
        if prefilling and not (decoding and self._last_was_prefill):
            self._last_was_prefill = True
            # Every shape below is compiled ahead of time (see jaxdist.export.buckets).
            rebuilding = [r for r in prefilling if r.plan]
            if rebuilding:  # the chunks of its first build, so its cache comes out the same
                r = rebuilding[0]
                n, s = r.plan[0]
                return [(r, r.pending[:n])], s
            if len(prefilling) > 1 and self.prefill_rows > 1:
                # Several prompts wait: their next chunks in one step, at the smallest bucket.
                s = self.buckets[0]
                return [(r, r.pending[:s]) for r in prefilling[:self.prefill_rows]], s
            # One prompt: one row, at the smallest bucket holding its next chunk.
            r = prefilling[0]
            chunk = min(len(r.pending), self.buckets[-1])
            s = next(b for b in self.buckets if b >= chunk)
            return [(r, r.pending[:s])], s
        self._last_was_prefill = False
        share = -(-n_active // self.depth)  # split the batch evenly over the steps in flight
        # A request rebuilding its cache after a failover feeds its own tokens again, one
        # decode step each, as it did the first time (see _fail_over).
        return [(r, [r.replay[0] if r.replay else r.tokens[-1]]) for r in decoding[:share]], 1

    def _send(self, active: list[_Request]) -> None:
        """Keep up to ``depth`` steps in flight, on disjoint rows, so every stage of the
        pipeline has work: the steps of one session stay in order on every stage."""
        while len(self._inflight) < self.depth:
            ready = [r for r in active if not (r.in_flight or r.done or r.abort)]
            rows, s = self._next_rows(ready, len(active))
            if not rows:
                return
            now = time.perf_counter()
            for r, _ in rows:
                r.scheduled = r.scheduled or now
                self._announce(r)
            try:
                arrays = step_inputs([(r.slot, r.pos, toks, r.params) for r, toks in rows], s,
                                     dtypes=self.dtypes, max_slots=self.max_slots)
            except Exception as exc:
                if not self._fail_culprits(rows, s, exc):
                    raise  # no one request's: a fault of the engine (the loop stops)
                continue  # the others go in the next step
            if self._session is None:
                self._session, self._step_ids = f"gen-{uuid.uuid4().hex[:12]}", itertools.count()
            elif self._idle_since is not None:
                self._resumed = True  # the workers may have reclaimed it meanwhile
            self._idle_since = None
            # A pipeline that lost a worker refuses the step here, or fails its future in
            # _receive: either way the engine fails over (or fails the requests).
            future = self.pipeline.submit(arrays, session_id=self._session,
                                          step=next(self._step_ids))
            self._inflight.append(_Step(future, rows, s, time.perf_counter()))
            for r, _ in rows:
                r.in_flight = True

    def _fail_culprits(self, rows: list[tuple[_Request, list[int]]], s: int,
                       error: Exception) -> bool:
        """A step's inputs could not be built: fail each request whose row alone cannot be
        built either (the error is its own). Returns whether there was one."""
        culprits = []
        for r, toks in rows:
            try:
                step_inputs([(r.slot, r.pos, toks, r.params)], s, dtypes=self.dtypes,
                            max_slots=self.max_slots)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's
                culprits.append((r, exc))
        for r, own in culprits:
            self._fail_request(r, own, "building its step's inputs")
        if not culprits:
            log.error("generation engine: a step's inputs could not be built, but each of its "
                      "%d rows can be alone: %s", len(rows), error)
        return bool(culprits)

    def _fail_request(self, r: _Request, error: Exception, doing: str, *,
                      released: bool = False) -> None:
        """End ``r`` alone with :class:`RequestFailed`: ``error`` arose in the engine while
        ``doing`` something for it."""
        log.error("generation engine: request %s failed while %s; the other requests go on",
                  r.rid, doing, exc_info=error)
        failure = RequestFailed(f"request {r.rid!r} failed in the generation engine while "
                                f"{doing}: {type(error).__name__}: {error}")
        failure.__cause__ = error
        self._fail(r, failure, released=released)

    def _receive(self) -> None:
        """Wait for the oldest step in flight and hand its tokens to their requests."""
        step = self._inflight[0]
        out = step.future.result()
        self._inflight.popleft()
        self._failovers = 0
        self._resumed = False
        if "token" not in out:
            raise SpecError(f"the pipeline's last stage returned {sorted(out)}; the causal-LM "
                            f"step contract expects 'token'")
        tokens = np.asarray(out["token"]).reshape(-1)
        now = time.perf_counter()
        self._observe(lambda o: o.step(len(step.rows), step.tokens_per_row, now - step.sent))
        for (r, toks), tok in zip(step.rows, tokens[:len(step.rows)].tolist()):
            r.in_flight = False
            if r.done or r.abort:
                continue  # aborted while in flight: its slot may already be someone else's
            try:
                self._advance(r, toks, step.tokens_per_row, tok, now)
            except Exception as exc:  # noqa: BLE001 - its text, its stop strings: its own
                self._fail_request(r, exc, "handling its new token")
        with self._cv:
            self._steps += 1

    def _advance(self, r: _Request, toks: list[int], tokens_per_row: int, tok: int,
                 now: float) -> None:
        """``r``'s row of a step came back with ``tok``: its cache holds ``toks`` more."""
        r.pos += len(toks)
        if r.pending:
            if r.plan:
                del r.plan[0]
            else:
                r.chunks.append((len(toks), tokens_per_row))
            del r.pending[:len(toks)]
            if r.pending:
                return  # more prompt to prefill: the sampled token is not used
            if r.recompute:
                r.recompute = False  # the prompt is in the cache; its token is known
                return
        elif r.replay:
            del r.replay[0]  # a token known already, decoded again to rebuild the cache
            return
        self._token(r, int(tok), now)

    def _token(self, r: _Request, tok: int, now: float) -> None:
        r.tokens.append(tok)
        first = not r.first
        since = now - (r.last or r.submitted)
        r.first, r.last = r.first or now, now
        p = r.params
        reason = ("eos" if not p.ignore_eos and tok in self.eos_ids else
                  "stop" if tok in p.stop_ids else "")
        text = ""
        if r.text is not None and not reason:  # an EOS or stop id is not part of the text
            text, stopped = r.text.push([tok])
            if stopped:
                reason, r.stop_at = "stop", len(r.tokens) - 1
        if not reason:
            reason = ("length" if len(r.tokens) >= p.max_tokens else
                      "max_seq" if r.pos + 1 > self.max_seq else "")
        self._observe(lambda o: o.token(r.rid, 1, since, first))
        if reason:
            self._end(r, reason, (tok,), text)
        else:
            self._outbox.append((r.stream, Delta(r.rid, (tok,), text, None, len(r.prompt),
                                                 len(r.tokens)), None))

    def _release_locked(self, r: _Request) -> bool:
        """Take ``r`` out of the engine and free its slot (holding ``_cv``). False: gone."""
        if r.done:
            return False
        r.done = True
        self._live.pop(r.rid, None)
        if r in self._active:
            self._active.remove(r)
            self._free.append(r.slot)
            self._free.sort()
        elif r in self._waiting:
            self._waiting.remove(r)
        self._admit_locked()
        return True

    def _end(self, r: _Request, reason: str, token_ids: tuple[int, ...] = (),
             text: str = "") -> None:
        """Finish ``r``: free its slot, then push its last delta and its result."""
        with self._cv:
            if not self._release_locked(r):
                return
            if r.abort:
                reason = "abort"  # abort() returned True: the request ends as aborted
        if r.text is not None:
            try:
                more, stopped = r.text.finish()
            except Exception as exc:  # noqa: BLE001 - its text: its own failure
                self._fail_request(r, exc, "finishing its text", released=True)
                return
            text += more
            if stopped and reason in ("length", "max_seq"):
                reason, r.stop_at = "stop", len(r.tokens) - 1
        tokens = r.tokens[:r.stop_at] if r.stop_at >= 0 else list(r.tokens)
        result = GenerationResult(r.prompt, tokens, reason,
                                  r.first - r.submitted if r.first else 0.0, r.last - r.first,
                                  r.text.text if r.text is not None else None, r.rid,
                                  len(r.tokens))
        self._announce(r)
        e2e = time.perf_counter() - r.submitted
        self._observe(lambda o: o.finished(r.rid, reason, len(r.prompt), len(r.tokens), e2e))
        self._outbox.append((r.stream, Delta(r.rid, token_ids, text, reason, len(r.prompt),
                                             len(r.tokens)), result))

    def _fail(self, r: _Request, error: BaseException, *, released: bool = False) -> None:
        """End ``r`` with ``error``, raised to its consumer (``released``: it is out of the
        engine already)."""
        with self._cv:
            if not released and not self._release_locked(r):
                return
        e2e = time.perf_counter() - r.submitted
        self._observe(lambda o: o.finished(r.rid, "error", len(r.prompt), len(r.tokens), e2e))
        self._outbox.append((r.stream, error, None))

    def _announce(self, r: _Request) -> None:
        """Send the observer the ``queued`` and ``scheduled`` events of ``r`` not sent yet."""
        if r.said < 1:
            r.said = 1
            self._observe(lambda o: o.queued(r.rid, len(r.prompt)))
        if r.said < 2 and r.scheduled:
            r.said = 2
            self._observe(lambda o: o.scheduled(r.rid, r.scheduled - r.submitted))

    def _observe(self, event: Callable[[EngineObserver], None]) -> None:
        if self.observer is None:
            return
        try:
            event(self.observer)
        except Exception:  # metrics must never stop generation
            log.exception("generation engine: the observer failed; generation goes on")

    # -- sessions and failover --------------------------------------------------------------

    def _settle(self) -> None:
        """Wait for the steps in flight (after a failure they fail too) and forget them."""
        concurrent.futures.wait([s.future for s in self._inflight])
        for s in self._inflight:
            for r, _ in s.rows:
                r.in_flight = False
        self._inflight.clear()

    def _end_session(self) -> None:
        session, self._session = self._session, None
        self._idle_since, self._resumed = None, False
        if session is not None:
            try:
                self.pipeline.end_session(session)
            except Exception as exc:  # noqa: BLE001 - best effort: the workers reclaim it
                # A closed pipeline (its channels gone) or an unreachable worker: the workers
                # free the session when its stage is unloaded or after their idle timeout.
                (log.debug if self._exiting else log.warning)(
                    "generation engine: could not end session %s: %s", session, exc)

    def _fail_over(self, error: JaxdistError) -> None:
        """A step failed: recover the pipeline and recompute the running requests, or fail
        them with ``error``."""
        self._settle()
        with self._cv:
            active = list(self._active)
        if self._resumed and _session_gone(error):
            # The workers reclaimed the session while it was kept idle: what it held was no
            # request's, and the requests since are rebuilt on a new one.
            log.warning("generation engine: the workers ended the idle session %s (%s); "
                        "rebuilding %d requests on a new session", self._session,
                        getattr(error, "message", error), len(active))
            self._end_session()
            self._rebuild(active)
            return
        recover: Callable[[], list[Any]] | None = getattr(self.pipeline, "recover", None)
        dead = recover is not None and getattr(self.pipeline, "broken", None) is not None
        if recover is not None and dead and self._failovers < self.max_failovers:
            self._failovers += 1
            self._session = None  # its state went with the worker; the stages are reloaded
            try:
                moved = recover()
            except JaxdistError as exc:
                error.add_note(f"failover to a spare worker failed: {exc}")
                self._failovers = 0
                self._fail_all(active, error)
                return
            log.warning("generation engine: failed over (%s); recomputing %d requests",
                        ", ".join(f"stages {list(m.stages)} {m.failed} -> {m.spare}"
                                  for m in moved) or "reloaded in place", len(active))
            self._rebuild(active)
            return
        if dead and self.max_failovers:
            error.add_note(f"gave up after {self._failovers} failovers in a row without a "
                           f"completed step (max_failovers={self.max_failovers})")
        self._failovers = 0
        self._end_session()
        self._fail_all(active, error)

    def _rebuild(self, active: list[_Request]) -> None:
        """Make the running requests build their KV caches again on the next session."""
        with self._cv:
            self._recomputed += len(active)
        for r in active:
            r.pos = 0
            # The cache is rebuilt the way it was built: the prompt prefilled in the same
            # chunks at the same buckets, then each generated token but the last decoded
            # again. A chunked prefill of prompt + tokens would be fewer steps, but its
            # attention runs another path (and another summation order) than the decode
            # kernel's, so a near tie could then pick another next token than the run that
            # failed over.
            r.pending = list(r.prompt)
            r.plan = list(r.chunks)
            r.replay = r.tokens[:-1]
            r.recompute = bool(r.tokens)

    def _fail_all(self, active: list[_Request], error: JaxdistError) -> None:
        for r in active:
            if r.abort:
                self._end(r, "abort")  # abort() promised it: the error is not its news
            else:
                self._fail(r, error)


def _session_gone(error: BaseException) -> bool:
    """Whether ``error`` says a worker no longer holds the step's session (a SessionError,
    raised here or on a worker)."""
    return isinstance(error, SessionError) or getattr(error, "remote_type", "") == "SessionError"
