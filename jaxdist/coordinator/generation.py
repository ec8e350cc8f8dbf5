"""Token generation over a deployed causal LM: bucketed prefill, KV-cached decode, batching.

The engine speaks to any pipeline with the causal-LM step contract of the exporters (see
``exporters/llama.py``); a model's :class:`~jaxdist.export.causal_lm.CausalLM` gives its
settings (:meth:`Generator.for_model`). Each step is one frame with rows ``b`` and tokens per
row ``s``:

    tokens int32 (b, s)   the step's tokens, right-padded to a bucket
    slot   int32 (b,)     the KV-cache slot of each row
    pos    int32 (b,)     position of the row's first token
    length int32 (b,)     true tokens of the row (the rest is padding, masked)
    temperature, top_k, top_p, seed (b,)   sampling, done in-graph on the last stage
 -> token  int32 (b,)     the next token of each row

The KV caches live on the workers in one session per engine, with ``max_slots`` slots; a
sequence owns a slot from its prefill to its end, so sequences join and leave at any step
(continuous batching). Rows are padded up to a power of two with the out-of-range slot
``max_slots``, whose cache writes the graph drops, so each worker compiles a handful of shapes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.export.buckets import decode_rows
from jaxdist.export.causal_lm import CausalLM

__all__ = ["Detokenizer", "GenerationResult", "Generator", "SamplingParams", "StepPipeline"]

log = logging.getLogger(__name__)


class StepPipeline(Protocol):
    """What the engine needs of a pipeline: :class:`~jaxdist.coordinator.cluster.Pipeline` or
    :class:`~jaxdist.coordinator.inprocess.InProcessPipeline`."""

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> concurrent.futures.Future[dict[str, np.ndarray]]: ...

    def end_session(self, session_id: str) -> int: ...


class Detokenizer(Protocol):
    """What the engine needs of a tokenizer: ids -> text, for stop strings."""

    def decode(self, ids: list[int]) -> str: ...


_Step = tuple[concurrent.futures.Future[dict[str, np.ndarray]], list[tuple["_Seq", list[int]]],
              dict[str, np.ndarray]]
"""A step in flight: its future, its rows, and its inputs (kept to replay it after a failover)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick and when to stop.

    Attributes:
        max_tokens: most new tokens.
        temperature: 0 is greedy.
        top_k: keep the k most likely tokens (0: off).
        top_p: nucleus sampling mass (1.0: off).
        seed: makes sampling reproducible.
        stop_ids: token ids that end generation (added to the model's EOS ids).
        stop_strings: texts that end generation (needs a ``decode`` function); the text is cut
            before the stop string.
        ignore_eos: do not stop at the model's EOS ids.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise SpecError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SpecError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecError(f"top_k must be >= 0, got {self.top_k}")


@dataclasses.dataclass
class GenerationResult:
    """One finished sequence."""

    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str          # "eos" | "stop" | "length" | "max_seq"
    ttft_s: float               # time from submission to the first new token
    decode_s: float             # time from the first to the last new token

    @property
    def tokens_per_s(self) -> float:
        """Decode steps after the first token, per second."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclasses.dataclass
class _Seq:
    index: int
    prompt: list[int]
    params: SamplingParams
    slot: int = -1
    pos: int = 0                 # tokens already in the cache
    pending: list[int] = dataclasses.field(default_factory=list)  # prompt left to prefill
    tokens: list[int] = dataclasses.field(default_factory=list)
    started: float = 0.0
    first: float = 0.0
    last: float = 0.0
    done: str = ""


class Generator:
    """Drives prefill and decode steps of a causal LM pipeline.

    Args:
        pipeline: a deployed pipeline (or an in-process one).
        input_dtypes: dtype of each step input, from the model's signature.
        max_slots: KV-cache slots the model was exported with.
        max_seq: cache length per slot.
        prefill_buckets: prompt chunk lengths the workers compiled (ascending).
        eos_ids: the model's end-of-sequence ids.
        decode: ids -> text, for stop strings.
        depth: steps kept in flight at once, on disjoint sequences. With ``depth`` equal to the
            number of stages, every stage computes a different part of the batch at the same
            time (pipeline parallelism); 1 is best for a single sequence or a single process.
        max_failovers: how many times one :meth:`run` may fail over when a worker dies (the
            pipeline must have spare workers; see :meth:`jaxdist.coordinator.pipeline.Pipeline.recover`).
            To replay, a run keeps every step's inputs (a few hundred bytes each); 0 keeps
            nothing and never fails over.

    Failover: when a worker of the pipeline dies, the engine asks the pipeline to move its
    stages to a spare, then replays every step it ran so far, with the same inputs, in the same
    order, on a new session. The replay is pipelined (the tokens are known, so nothing waits
    for a result) and rebuilds the KV caches exactly as they were; the steps that were in
    flight are sent again and generation goes on. The output is the output of a run with no
    fault: each replayed step's token is checked against the one recorded, and a difference
    (a spare on a different kind of device) is logged.
    """

    def __init__(self, pipeline: StepPipeline, *, input_dtypes: Mapping[str, str],
                 max_slots: int, max_seq: int, prefill_buckets: Sequence[int],
                 eos_ids: Sequence[int] = (), decode: Callable[[list[int]], str] | None = None,
                 depth: int = 1, max_failovers: int = 3) -> None:
        self.pipeline = pipeline
        self.dtypes = dict(input_dtypes)
        self.max_slots = max_slots
        self.max_seq = max_seq
        self.buckets = sorted(prefill_buckets)
        self.eos_ids = frozenset(eos_ids)
        self.decode = decode
        if depth < 1:
            raise SpecError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.max_failovers = max_failovers
        if not self.buckets:
            raise SpecError("prefill_buckets must not be empty")

    @classmethod
    def for_model(cls, pipeline: StepPipeline, lm: CausalLM, *,
                  tokenizer: Detokenizer | None = None, depth: int | None = None,
                  max_failovers: int = 3) -> Generator:
        """The engine for a deployed causal LM, configured by its contract.

        This is how the CLI and the benchmarks build one; the constructor stays for tests that
        drive a pipeline with settings of their own.

        Args:
            pipeline: the deployed pipeline of the model ``lm`` describes (or an in-process one).
            lm: the model's contract, from its exporter (``LoadedModel.causal_lm``) or its
                manifest (``CausalLM.from_options(manifest.model.options, inputs=...)``).
            tokenizer: its ``decode`` serves stop strings; ``None``: no stop strings.
            depth: steps in flight at once; default: one per stage of a deployed pipeline
                (``len(pipeline.specs)``, pipeline parallelism), 1 for a pipeline without
                stage specs (an in-process one, where more would gain nothing).
            max_failovers: see :class:`Generator`.

        Example:
            >>> loaded = load_model("SmolLM2.gguf", roots=["/models"])    # doctest: +SKIP
            >>> pipe = cluster.deploy(loaded.model, stages=2)             # doctest: +SKIP
            >>> gen = Generator.for_model(pipe, loaded.causal_lm, tokenizer=loaded.tokenizer)
            ... # doctest: +SKIP
        """
        if depth is None:
            specs = getattr(pipeline, "specs", None)
            depth = len(specs) if specs is not None else 1
        return cls(pipeline, input_dtypes=lm.input_dtypes, max_slots=lm.max_slots,
                   max_seq=lm.max_seq, prefill_buckets=lm.prefill_buckets, eos_ids=lm.eos_ids,
                   decode=tokenizer.decode if tokenizer is not None else None, depth=depth,
                   max_failovers=max_failovers)

    # -- one step ---------------------------------------------------------------------------

    def _inputs(self, rows: list[tuple[_Seq, list[int]]], s: int) -> dict[str, np.ndarray]:
        """The input arrays of one step."""
        b = decode_rows(len(rows), self.max_slots)
        tokens = np.zeros((b, s), np.int64)
        slot = np.full((b,), self.max_slots, np.int64)  # padding rows: writes are dropped
        pos = np.zeros((b,), np.int64)
        length = np.ones((b,), np.int64)
        temperature = np.zeros((b,), np.float64)
        top_k = np.zeros((b,), np.int64)
        top_p = np.ones((b,), np.float64)
        seed = np.zeros((b,), np.int64)
        for i, (seq, toks) in enumerate(rows):
            tokens[i, :len(toks)] = toks
            slot[i], pos[i], length[i] = seq.slot, seq.pos, len(toks)
            p = seq.params
            temperature[i], top_k[i], top_p[i], seed[i] = p.temperature, p.top_k, p.top_p, p.seed
        inputs = {"tokens": tokens, "slot": slot, "pos": pos, "length": length,
                  "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
        missing = set(self.dtypes) - set(inputs)
        if missing:
            raise SpecError(f"the model expects step inputs {sorted(self.dtypes)}; the engine "
                            f"does not know how to fill {sorted(missing)}")
        return {k: np.asarray(inputs[k], dtype=self.dtypes[k]) for k in self.dtypes}

    # -- failover ---------------------------------------------------------------------------

    def _fail_over(self, error: JaxdistError, history: list[tuple[dict[str, np.ndarray],
                                                                  np.ndarray]],
                   inflight: collections.deque[_Step], failovers: int
                   ) -> tuple[str, Iterator[int], collections.deque[_Step]]:
        """Recover the pipeline and replay ``history``, then resend ``inflight``.

        Returns the new session, its step counter and the steps now in flight. Raises ``error``
        (with a note) when the pipeline cannot fail over.
        """
        recover = getattr(self.pipeline, "recover", None)
        if recover is None or getattr(self.pipeline, "broken", None) is None:
            raise error  # a stage failed on its input, not a dead worker: nothing to recover
        if failovers >= self.max_failovers:
            error.add_note(f"gave up after {failovers} failovers (max_failovers)")
            raise error
        for future, _, _ in inflight:  # they fail with the same error; let them settle
            concurrent.futures.wait([future])
        try:
            moved = recover()
        except JaxdistError as exc:
            error.add_note(f"failover to a spare worker failed: {exc}")
            raise error from exc
        log.warning("generation: failed over (%s); replaying %d steps",
                    ", ".join(f"stages {list(m.stages)} {m.failed} -> {m.spare}" for m in moved)
                    or "reloaded in place", len(history))
        session = f"gen-{uuid.uuid4().hex[:12]}"
        steps: Iterator[int] = itertools.count()
        window: collections.deque[tuple[Any, np.ndarray, int]] = collections.deque()
        mismatched = 0

        def check(future: Any, expected: np.ndarray) -> int:
            return int(not np.array_equal(np.asarray(future.result()["token"]), expected))

        for i, (arrays, expected) in enumerate(history):
            window.append((self.pipeline.submit(arrays, session_id=session, step=next(steps)),
                           expected, i))
            if len(window) >= 32:
                future, expected, _ = window.popleft()
                mismatched += check(future, expected)
        for future, expected, _ in window:
            mismatched += check(future, expected)
        if mismatched:
            log.warning("generation: %d of %d replayed steps gave other tokens than the first "
                        "run (is the spare a different kind of device?); the recorded tokens "
                        "are kept", mismatched, len(history))
        resent = collections.deque(
            (self.pipeline.submit(arrays, session_id=session, step=next(steps)), rows, arrays)
            for _, rows, arrays in inflight)
        return session, steps, resent

    # -- the engine -------------------------------------------------------------------------

    def _next_rows(self, ready: list[_Seq], n_active: int
                   ) -> tuple[list[tuple[_Seq, list[int]]], int]:
        """The rows of the next step among ``ready`` sequences, and its tokens per row."""
        prefilling = [q for q in ready if q.pending]
        if prefilling:
            # One sequence per prefill step, at the smallest bucket holding its next chunk:
            # every such shape is compiled ahead of time (see jaxdist.export.buckets).
            q = prefilling[0]
            chunk = min(len(q.pending), self.buckets[-1])
            s = next(b for b in self.buckets if b >= chunk)
            return [(q, q.pending[:s])], s
        decoding = [q for q in ready if not q.pending]
        share = -(-n_active // self.depth)  # split the batch evenly over the steps in flight
        return [(q, [q.tokens[-1]]) for q in decoding[:share]], 1

    def _finish_reason(self, seq: _Seq) -> str:
        tok = seq.tokens[-1]
        p = seq.params
        if tok in p.stop_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "eos" if tok in self.eos_ids else "stop"
        if p.stop_strings and self.decode is not None:
            text = self.decode(seq.tokens)
            if any(s in text for s in p.stop_strings):
                return "stop"
        if len(seq.tokens) >= p.max_tokens:
            return "length"
        if seq.pos + 1 > self.max_seq:
            return "max_seq"
        return ""

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
            = SamplingParams(), *, on_token: Callable[[int, int], None] | None = None
            ) -> list[GenerationResult]:
        """Generate for several prompts at once, up to ``max_slots`` in flight.

        Args:
            prompts: token ids of each prompt.
            params: one SamplingParams for all, or one per prompt.
            on_token: ``on_token(prompt_index, token)`` as each token is produced (streaming).

        Returns:
            One result per prompt, in order.

        Raises:
            SpecError: an empty prompt or one longer than the cache.
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise SpecError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            if not prompt:
                raise SpecError(f"prompt {i} is empty; it needs at least one token (e.g. BOS)")
            if len(prompt) >= self.max_seq:
                raise SpecError(f"prompt {i} has {len(prompt)} tokens; the KV cache holds "
                                f"{self.max_seq} (export with a larger max_seq)")
            seqs.append(_Seq(i, list(prompt), p, pending=list(prompt)))
        session = f"gen-{uuid.uuid4().hex[:12]}"
        steps: Iterator[int] = itertools.count()
        waiting = list(seqs)
        active: list[_Seq] = []
        free = list(range(self.max_slots))
        inflight: collections.deque[_Step] = collections.deque()
        history: list[tuple[dict[str, np.ndarray], np.ndarray]] = []  # for a failover replay
        failovers = 0
        busy: set[int] = set()
        t_submit = time.perf_counter()
        try:
            while waiting or active:
                while waiting and free:
                    seq = waiting.pop(0)
                    seq.slot, seq.started = free.pop(0), t_submit
                    active.append(seq)
                # Keep up to `depth` steps in flight, on disjoint rows, so every stage of the
                # pipeline has work: the steps of one session stay in order on every stage.
                try:
                    while len(inflight) < self.depth:
                        rows, s = self._next_rows([q for q in active if q.index not in busy],
                                                  len(active))
                        if not rows:
                            break
                        arrays = self._inputs(rows, s)
                        # A pipeline that lost a worker refuses the step here, or fails its
                        # future below: either way the engine fails over and goes on.
                        inflight.append((self.pipeline.submit(arrays, session_id=session,
                                                              step=next(steps)), rows, arrays))
                        busy.update(q.index for q, _ in rows)
                    future, rows, arrays = inflight[0]
                    out = np.asarray(future.result()["token"])
                except JaxdistError as exc:
                    error = exc
                    while True:  # a replay can lose a worker too: fail over again
                        try:
                            session, steps, inflight = self._fail_over(error, history,
                                                                       inflight, failovers)
                            break
                        except JaxdistError as again:
                            if again is error:
                                raise  # cannot fail over (no spare, a stage error, the cap)
                            error = again
                        finally:
                            failovers += 1
                    continue
                inflight.popleft()
                if self.max_failovers:  # kept only for a replay
                    history.append((arrays, out))
                next_tokens = out[:len(rows)]
                now = time.perf_counter()
                for (q, toks), tok in zip(rows, next_tokens):
                    busy.discard(q.index)
                    q.pos += len(toks)
                    if q.pending:
                        del q.pending[:len(toks)]
                        if q.pending:
                            continue  # more prompt to prefill: the sampled token is not used
                    q.tokens.append(int(tok))
                    q.first = q.first or now
                    q.last = now
                    if on_token is not None:
                        on_token(q.index, int(tok))
                    q.done = self._finish_reason(q)
                for q in [q for q in active if q.done]:
                    active.remove(q)
                    free.append(q.slot)
        finally:
            for future, _, _ in inflight:  # after an error: let sent steps finish before ending
                try:
                    future.result()
                except Exception:  # noqa: BLE001 - the first error is already propagating
                    pass
            self.pipeline.end_session(session)
        return [GenerationResult(q.prompt, self._trim(q), q.done, q.first - q.started,
                                 q.last - q.first) for q in seqs]

    def _trim(self, seq: _Seq) -> list[int]:
        if seq.done == "stop" and seq.params.stop_strings and self.decode is not None:
            # Drop tokens once the text contains a stop string.
            for n in range(1, len(seq.tokens) + 1):
                if any(s in self.decode(seq.tokens[:n]) for s in seq.params.stop_strings):
                    return seq.tokens[:n - 1]
        return seq.tokens

    def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()
               ) -> Iterator[int]:
        """Generate for one prompt, yielding each token as it arrives."""
        q: queue.Queue[int | BaseException | None] = queue.Queue()

        def work() -> None:
            try:
                self.run([prompt], params, on_token=lambda _i, t: q.put(t))
                q.put(None)
            except BaseException as exc:  # handed to the consumer
                q.put(exc)

        t = threading.Thread(target=work, name="generate", daemon=True)
        t.start()
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
