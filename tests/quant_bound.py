"""How far quantized activations may move a model's logits: the tolerance of quantized parity.

The CPU kernels quantize the input of every product as llama.cpp does (Q8_0 blocks of 32
before Q4_0/Q8_0 weights, ...). tests/test_kernels.py bounds what that does to one product;
:func:`activation_bound` carries that bound through a transformers model to its logits, to
first order, with its own autograd. Used where a quantized GGUF written by a test is held to
transformers run on the weights ``gguf.quants`` decodes from the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ggml_blocks
import numpy as np
import torch


def activation_bound(model: Any, tokens: Sequence[int], rows: slice, qtype: str) -> np.ndarray:
    """How far the logits at positions ``rows`` may move when the input ``x`` of every linear
    layer is quantized as the CPU kernels quantize it for ``qtype`` weights.

    Each element moves by some ``u_k`` with ``|u_k| <= e_k = activation_error(x)_k``
    (tests/ggml_blocks.py, the bound of tests/test_kernels.py). To first order a logit moves by
    ``sum_k a_k u_k``, with ``a_k = d logit / d x_k`` from transformers' autograd. The worst
    case ``sum_k |a_k| e_k`` holds always but is about 30 times what the roughly 20 thousand
    roundings of these runs do, since they do not all go the worst way; taken as independent
    zero-mean errors (the usual model of rounding), Hoeffding's inequality gives
    ``P(|sum_k a_k u_k| >= t) <= 2 exp(-t^2 / (2 sum_k a_k^2 e_k^2))``. Returned: the ``t`` of
    ``P = 1e-6`` per logit (so below 1e-3 for all the logits a test compares). Layers fed the
    same tensor (Qwen3's q, k and v; gate and up) round it the same way: one ``u`` for all.
    """
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (x, its perturbation)

    def perturb(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        delta = next((d for seen, d in inputs if seen is x), None)
        if delta is None:
            delta = torch.zeros_like(x, requires_grad=True)
            inputs.append((x, delta))
        return (x + delta, *args[1:])

    hooks = [m.register_forward_pre_hook(perturb) for m in model.modules()
             if isinstance(m, torch.nn.Linear)]
    try:
        logits = model(torch.tensor([list(tokens)])).logits[0, rows]
    finally:
        for h in hooks:
            h.remove()
    n = logits.numel()
    basis = torch.eye(n).reshape(n, *logits.shape)
    grads = torch.autograd.grad(logits, [d for _, d in inputs], grad_outputs=basis,
                                is_grads_batched=True)
    variance = np.zeros(n)  # sum_k a_k^2 e_k^2, per logit
    for (x, _), g in zip(inputs, grads):
        x2 = x.detach().reshape(-1, x.shape[-1]).numpy().astype(np.float64)
        err = ggml_blocks.activation_error(x2, qtype).reshape(-1)
        variance += np.square(g.reshape(n, -1).numpy().astype(np.float64)) @ np.square(err)
    return np.sqrt(2 * math.log(2 / 1e-6) * variance).reshape(logits.shape)
