"""Batch generation: :class:`Generator` runs a list of prompts to their end on an
:class:`~jaxdist.coordinator.engine.Engine`.

This is the API of the benchmarks and the tests: a call that takes prompts and returns
results (``jaxdist generate``, like ``chat`` and ``serve``, streams the engine's deltas). The
engine under it is long-lived: one per generator, made on first use, so calls from several
threads share its KV slots and batch together. The step contract is
:mod:`jaxdist.coordinator.steps`; the scheduling and failover are the engine's
(:mod:`jaxdist.coordinator.engine`).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Self

from jaxdist.coordinator.detokenizer import Detokenizer
from jaxdist.coordinator.engine import Engine
from jaxdist.coordinator.request import GenerationResult, RequestStream, SamplingParams
from jaxdist.coordinator.steps import StepPipeline, check_request, default_depth
from jaxdist.core.errors import SpecError
from jaxdist.export.causal_lm import CausalLM

__all__ = ["Detokenizer", "GenerationResult", "Generator", "SamplingParams", "StepPipeline"]

_ENGINE_LOCK = threading.Lock()  # makes a generator's engine once (module-wide: see vars())


class _DecodeFn:
    """A ``decode`` function as a :class:`Detokenizer`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode


class Generator:
    """Generates for batches of prompts on a causal LM pipeline.

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
        max_failovers: failovers in a row without progress before giving up when workers die
            (the pipeline must have spare workers; see
            :meth:`jaxdist.coordinator.pipeline.Pipeline.recover`); 0 never fails over.
        prefill_rows: prompts one prefill step may carry (the contract's
            :attr:`~jaxdist.export.causal_lm.CausalLM.prefill_rows`); 1: one per step.
        vocab_size: token ids the model knows; prompt ids, ``top_k`` and stop ids are checked
            against it before anything runs. ``None``: not known (ids must fit int32).

    The settings are read when the engine starts, on the first :meth:`run` or :meth:`stream`.
    Failover is the engine's: the running sequences are prefilled again on a new session
    with what they generated so far, and the tokens already produced are kept.
    """

    def __init__(self, pipeline: StepPipeline, *, input_dtypes: Mapping[str, str],
                 max_slots: int, max_seq: int, prefill_buckets: Sequence[int],
                 eos_ids: Sequence[int] = (), decode: Callable[[list[int]], str] | None = None,
                 depth: int = 1, max_failovers: int = 3, prefill_rows: int = 1,
                 vocab_size: int | None = None) -> None:
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
        self.prefill_rows = prefill_rows
        self.vocab_size = vocab_size
        if not self.buckets:
            raise SpecError("prefill_buckets must not be empty")
        self._engine: Engine | None = None

    @classmethod
    def for_model(cls, pipeline: StepPipeline, lm: CausalLM, *,
                  tokenizer: Detokenizer | None = None, depth: int | None = None,
                  max_failovers: int = 3) -> Generator:
        """The generator for a deployed causal LM, configured by its contract.

        This is how the CLI and the benchmarks build one; the constructor stays for tests that
        drive a pipeline with settings of their own.

        Args:
            pipeline: the deployed pipeline of the model ``lm`` describes (or an in-process one).
            lm: the model's contract, from its exporter (``LoadedModel.causal_lm``) or its
                manifest (``CausalLM.from_options(manifest.model.options, inputs=...)``).
            tokenizer: its ``decode`` serves stop strings, its ``vocab_size`` bounds token ids
                and ``top_k``; ``None``: no stop strings.
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
        return cls(pipeline, input_dtypes=lm.input_dtypes, max_slots=lm.max_slots,
                   max_seq=lm.max_seq, prefill_buckets=lm.prefill_buckets, eos_ids=lm.eos_ids,
                   decode=tokenizer.decode if tokenizer is not None else None,
                   depth=default_depth(pipeline) if depth is None else depth,
                   max_failovers=max_failovers, prefill_rows=lm.prefill_rows,
                   vocab_size=getattr(tokenizer, "vocab_size", None))

    @property
    def engine(self) -> Engine:
        """The engine the generator runs on, started on first use."""
        with _ENGINE_LOCK:
            if self._engine is None:
                self._engine = Engine(
                    self.pipeline, input_dtypes=self.dtypes, max_slots=self.max_slots,
                    max_seq=self.max_seq, prefill_buckets=self.buckets, eos_ids=self.eos_ids,
                    tokenizer=_DecodeFn(self.decode) if self.decode is not None else None,
                    depth=self.depth, max_failovers=self.max_failovers,
                    max_queue=None,  # a batch waits for slots by design
                    prefill_rows=self.prefill_rows, vocab_size=self.vocab_size)
            return self._engine

    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
            = SamplingParams(), *, on_token: Callable[[int, int], None] | None = None
            ) -> list[GenerationResult]:
        """Generate for several prompts at once, up to ``max_slots`` in flight.

        Args:
            prompts: token ids of each prompt.
            params: one SamplingParams for all, or one per prompt.
            on_token: ``on_token(prompt_index, token)`` as each token is produced (streaming),
                called in this thread.

        Returns:
            One result per prompt, in order.

        Raises:
            SpecError: an empty prompt or one longer than the cache, a token id or a sampling
                parameter the model cannot take (:class:`ParamError`, naming the field), all
                before anything runs.
            JaxdistError: the pipeline failed and could not fail over.
        """
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise SpecError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            check_request(list(prompt), p, max_seq=self.max_seq, vocab_size=self.vocab_size,
                          where=f"prompt {i}", context=f"prompt {i}: ")
        engine = self.engine
        woken: queue.SimpleQueue[int] = queue.SimpleQueue()
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                streams.append(engine._submit(prompt, p, where=f"prompt {i}",
                                              on_push=functools.partial(woken.put, i)))
            running = set(range(len(streams)))
            while running:
                i = woken.get()
                for item in streams[i]._take():
                    if isinstance(item, BaseException):
                        raise item
                    if on_token is not None:
                        for token in item.token_ids:
                            on_token(i, token)
                    if item.finish_reason is not None:
                        running.discard(i)
        finally:
            for s in streams:  # after an error: nothing of this call keeps running
                if not s.done:
                    s.abort()
        return [s.result() for s in streams]

    def stream(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()
               ) -> Iterator[int]:
        """Generate for one prompt, yielding each token as it arrives."""
        check_request(list(prompt), params, max_seq=self.max_seq, vocab_size=self.vocab_size,
                      where="prompt 0", context="prompt 0: ")
        with self.engine._submit(prompt, params, where="prompt 0") as stream:
            for delta in stream:  # leaving early aborts the request
                yield from delta.token_ids

    def close(self) -> None:
        """Stop the engine (if it started); the pipeline stays open."""
        with _ENGINE_LOCK:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
