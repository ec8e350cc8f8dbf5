"""Test helpers for the LLM exporters: build step inputs, prefill then decode through a pipeline.

These drive a model's slot-cache protocol (see :mod:`jaxdist.exporters.layers`) the way a serving
loop would: one stateful session, each row in its own cache slot, prompts padded up to a bucket,
then one token per row per step. ``pipe`` is anything with ``session()`` (an
``InProcessPipeline`` or a coordinator ``Pipeline``). The exporters' parity tests against
transformers share the rest: :func:`lazy_pipe`, :func:`hf_reference`, :func:`float_tolerance`
and :func:`forced_logits`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np


def step_inputs(rows: Sequence[Sequence[int]], *, slots: Sequence[int], pos: Sequence[int],
                width: int | None = None, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of one step: each row's tokens right-padded with 0 to ``width`` (default: longest)."""
    width = width or max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    b = len(rows)
    return {"tokens": tokens, "slot": np.asarray(slots, np.int32),
            "pos": np.asarray(pos, np.int32),
            "length": np.asarray([len(r) for r in rows], np.int32),
            "temperature": np.full(b, temperature, np.float32),
            "top_k": np.full(b, top_k, np.int32), "top_p": np.full(b, top_p, np.float32),
            "seed": np.full(b, seed, np.uint32)}


def generate(pipe: Any, prompts: Sequence[Sequence[int]], n_new: int, *,
             slots: Sequence[int] | None = None, bucket: int = 16, **sampling: Any
             ) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill ``prompts`` together (padded to ``bucket``) then decode ``n_new - 1`` steps.

    Returns:
        ``(tokens, logits)``: the ``n_new`` new tokens of each row, and per step the head's
        ``logits`` output (empty if the model does not return logits).
    """
    slots = list(range(len(prompts))) if slots is None else list(slots)
    out_tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[np.ndarray] = []
    pos = [0] * len(prompts)
    rows = [list(p) for p in prompts]
    with pipe.session() as session:
        for step in range(n_new):
            width = max(bucket, max(len(r) for r in rows)) if step == 0 else 1
            out = session(step_inputs(rows, slots=slots, pos=pos, width=width, **sampling))
            if "logits" in out:
                logits.append(out["logits"])
            for i, t in enumerate(out["token"].tolist()):
                out_tokens[i].append(int(t))
            pos = [p + len(r) for p, r in zip(pos, rows)]
            rows = [[toks[-1]] for toks in out_tokens]
    return out_tokens, logits


class GatedPipeline:
    """A pipeline whose steps wait for ``open`` (set it to let them through): a test decides
    when an engine's step loop moves, so a request holds its KV slot as long as the test needs
    (no timing)."""

    def __init__(self, pipeline: Any, wait: float = 120.0) -> None:
        self.pipeline = pipeline
        self.open = threading.Event()
        self.wait = wait

    def submit(self, inputs: Any, *, session_id: str = "", step: int = 0) -> Any:
        if not self.open.wait(self.wait):
            raise AssertionError("the gate was never opened")
        return self.pipeline.submit(inputs, session_id=session_id, step=step)

    def end_session(self, session_id: str) -> int:
        return self.pipeline.end_session(session_id)


# ---------------------------------------------------------------------------------------------
# Tiny random models against transformers (test_llama, test_qwen3_phi3, test_gemma3, test_moe)


def lazy_pipe(model: Any, root: Any, stages: int) -> Any:
    """An in-process pipeline of ``model`` that compiles only the shapes a test uses (lazily):
    ahead-of-time buckets triple the load time of these tests."""
    import dataclasses  # noqa: PLC0415

    from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: PLC0415

    return InProcessPipeline(dataclasses.replace(model, buckets=()), weights_roots=[str(root)],
                             stages=stages)


def hf_reference(model: Any, prompt: Sequence[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens from ``generate`` and the logits predicting each of them."""
    import torch  # noqa: PLC0415

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=0,
                             pad_token_id=0, eos_token_id=None)
        full = model(out[:, :-1]).logits[0].numpy()
    return out[0, len(prompt):].tolist(), full[len(prompt) - 1:]


def float_tolerance(want: np.ndarray) -> float:
    """float32 sums in another order, through a few layers: 1e-4 of the largest logit
    (transformers in float32 is off its own float64 run by about 5e-6 of it here)."""
    return 1e-4 * max(1.0, float(np.abs(want).max()))


def forced_logits(pipe: Any, prompts: Sequence[Sequence[int]], fed: Sequence[Sequence[int]]
                  ) -> np.ndarray:
    """Logits ``(steps, rows, vocab)``: after each row's prompt (one 16-wide prefill, all rows
    in one batch), then after feeding each row's ``fed`` tokens one at a time (teacher-forced)."""
    b = len(prompts)
    with pipe.session() as session:
        out = [session(step_inputs(prompts, slots=list(range(b)), pos=[0] * b,
                                   width=16))["logits"]]
        for p in range(len(fed[0])):
            out.append(session(step_inputs([[row[p]] for row in fed], slots=list(range(b)),
                                           pos=[len(q) + p for q in prompts]))["logits"])
    return np.stack(out)
