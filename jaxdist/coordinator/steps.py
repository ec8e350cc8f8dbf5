"""The causal-LM step contract: what one generation step sends to a pipeline and gets back.

The exporters trace their causal LMs to this contract (see ``exporters/llama.py``); a model's
:class:`~jaxdist.export.causal_lm.CausalLM` gives its settings. Each step is one frame with rows
``b`` and tokens per row ``s``:

    tokens int32 (b, s)   the step's tokens, right-padded to a bucket
    slot   int32 (b,)     the KV-cache slot of each row
    pos    int32 (b,)     position of the row's first token
    length int32 (b,)     true tokens of the row (the rest is padding, masked)
    temperature, top_k, top_p, seed (b,)   sampling, done in-graph on the last stage
 -> token  int32 (b,)     the next token of each row

Rows are padded up to a power of two (:func:`~jaxdist.export.buckets.decode_rows`) with the
out-of-range slot ``max_slots``, whose cache writes the graph drops, and length 0, whose rows
the CPU kernels skip, so each worker compiles a handful of shapes. A prefill step carries one
prompt, or several (``prefill_rows``) in chunks of the smallest bucket.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxdist.coordinator.request import SamplingParams, check_token_ids
from jaxdist.core.errors import SpecError
from jaxdist.export.buckets import decode_rows

__all__ = ["StepPipeline", "check_prompt", "check_request", "default_depth", "step_inputs"]


class StepPipeline(Protocol):
    """What generation needs of a pipeline: :class:`~jaxdist.coordinator.pipeline.Pipeline` or
    :class:`~jaxdist.coordinator.inprocess.InProcessPipeline`.

    A pipeline that also has ``recover()`` and ``broken`` (a deployed one) can fail over.
    """

    def submit(self, inputs: Mapping[str, Any], *, session_id: str = "", step: int = 0
               ) -> concurrent.futures.Future[dict[str, np.ndarray]]: ...

    def end_session(self, session_id: str) -> int: ...


def check_prompt(prompt: Sequence[int], max_seq: int, where: str) -> None:
    """Refuse a prompt the KV cache cannot hold; ``where`` names it in the message.

    Raises:
        SpecError: the prompt is empty, or has ``max_seq`` tokens or more.
    """
    if not prompt:
        raise SpecError(f"{where} is empty; it needs at least one token (e.g. BOS)")
    if len(prompt) >= max_seq:
        raise SpecError(f"{where} has {len(prompt)} tokens; the KV cache holds {max_seq} "
                        f"positions (max_seq) and the first new token needs one more: shorten "
                        f"the prompt or export with a larger max_seq")


def check_request(prompt: Sequence[int], params: SamplingParams, *, max_seq: int,
                  vocab_size: int | None, where: str, context: str = "") -> None:
    """Refuse, before it is queued, a request the model cannot run: the prompt's length
    (:func:`check_prompt`), its ids within the vocabulary, and ``params`` within what the
    model takes (:meth:`SamplingParams.check_model`). The parameters' own ranges were checked
    when they were made. The engine calls this for every request, whatever its front end.

    Args:
        where: names the prompt in a length error; ``context`` prefixes the others.

    Raises:
        SpecError: the prompt is empty or does not fit the cache.
        ParamError: a token id or a parameter out of range, naming the field.
    """
    check_prompt(prompt, max_seq, where)
    check_token_ids(prompt, vocab_size, context=context)
    params.check_model(vocab_size, context=context)


def default_depth(pipeline: object) -> int:
    """Steps in flight by default: one per stage of a deployed pipeline (its stage specs),
    1 for one without (an in-process pipeline, where more would gain nothing)."""
    specs = getattr(pipeline, "specs", None)
    return len(specs) if specs is not None else 1


def step_inputs(rows: Sequence[tuple[int, int, Sequence[int], SamplingParams]], s: int, *,
                dtypes: Mapping[str, str], max_slots: int) -> dict[str, np.ndarray]:
    """The input arrays of one step.

    Args:
        rows: ``(slot, pos, tokens, params)`` of each row; ``len(tokens) <= s``.
        s: tokens per row (1 for decode, a prefill bucket for prefill).
        dtypes: the model's step inputs and their dtypes.
        max_slots: KV-cache slots; padding rows get this out-of-range slot.

    Raises:
        SpecError: the model expects an input this contract does not know.
    """
    b = decode_rows(len(rows), max_slots)
    tokens = np.zeros((b, s), np.int64)
    slot = np.full((b,), max_slots, np.int64)  # padding rows: writes are dropped
    pos = np.zeros((b,), np.int64)
    length = np.zeros((b,), np.int64)  # padding rows: no token, so no work in the kernels
    temperature = np.zeros((b,), np.float64)
    top_k = np.zeros((b,), np.int64)
    top_p = np.ones((b,), np.float64)
    seed = np.zeros((b,), np.int64)
    for i, (row_slot, row_pos, toks, p) in enumerate(rows):
        tokens[i, :len(toks)] = toks
        slot[i], pos[i], length[i] = row_slot, row_pos, len(toks)
        temperature[i], top_k[i], top_p[i], seed[i] = p.temperature, p.top_k, p.top_p, p.seed
    inputs = {"tokens": tokens, "slot": slot, "pos": pos, "length": length,
              "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    missing = set(dtypes) - set(inputs)
    if missing:
        raise SpecError(f"the model expects step inputs {sorted(dtypes)}; generation does not "
                        f"know how to fill {sorted(missing)}")
    return {k: np.asarray(inputs[k], dtype=dtypes[k]) for k in dtypes}
