"""SmolLM2 with its weights bound as stored (the default): parity and memory, on real workers.

The reference is tests/quant_reference.py: a numpy forward pass of the same GGUF, read with
``gguf.GGUFReader``, decoded with ``gguf.quants``, with activations quantized before every
matmul as llama.cpp's CPU backend quantizes them. Greedy decoding with quantized activations
has near-ties: one activation rounded to the neighbouring 8-bit step moves a logit by about a
tenth, and a float32 sum in another order can do that. So the tokens must match the
reference's up to its first near-tie (top-2 margin under NEAR_TIE), and where they first
differ, the reference must have been at a near-tie.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
from conftest import SMOLLM2_PROMPT
from quant_reference import QuantLlama

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.core import kernels
from jaxdist.core.weights import WeightCache
from jaxdist.exporters.llama import llama_model
from jaxdist.exporters.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(not kernels.load().available,
                                reason=f"CPU kernels unavailable: {kernels.load().reason}")

N_NEW = 20
NEAR_TIE = 0.25  # logits; see the module docstring


@pytest.fixture(scope="module")
def reference(smollm2: pathlib.Path) -> tuple[list[int], list[int], list[float]]:
    prompt = load_tokenizer(smollm2).encode(SMOLLM2_PROMPT)
    tokens, margins = QuantLlama(str(smollm2)).greedy(prompt, N_NEW)
    return prompt, tokens, margins


def _check_tokens(got: list[int], want: list[int], margins: list[float], where: str) -> None:
    first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
    assert got[:first_tie] == want[:first_tie], f"{where}: {got} != reference {want}"
    diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if diff is not None:
        assert margins[diff] < NEAR_TIE, (f"{where}: token {diff} differs ({got[diff]} vs "
                                          f"{want[diff]}) where the reference's margin was "
                                          f"{margins[diff]:.3f}")


# Two workers in the fast tier (a real model split across processes); one and three in the slow.
@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.slow), 2,
                                     pytest.param(3, marks=pytest.mark.slow)])
def test_smollm2_quantized_matches_llamacpp_arithmetic(smollm2: pathlib.Path, reference,
                                                       workers: int) -> None:
    prompt, want, margins = reference
    root, name = smollm2.parent, smollm2.name
    model = llama_model(name, roots=[root], max_slots=1, max_seq=128, prefill_buckets=(16,))
    model = dataclasses.replace(model, buckets=[{"b": 1, "s": 1}, {"b": 1, "s": 16}])
    with Cluster.local(workers, weights_roots=[str(root)]) as cluster:
        with cluster.deploy(model, stages=workers) as pipe:
            gen = Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                            max_slots=1, max_seq=128, prefill_buckets=(16,))
            (result,) = gen.run([prompt], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
            memory = pipe.stage_memory()
            specs = pipe.specs
    _check_tokens(result.tokens, want, margins, f"{workers} workers")
    # Bound as stored: each stage holds at most 1.1x its tensors' bytes in the file.
    with WeightCache([root]) as cache:
        file_bytes = {f"gguf://{name}#{n}": i.nbytes for n, i in cache.describe(name).items()}
    assert len(memory) == workers
    for spec, mem in zip(specs, memory):
        in_file = sum(file_bytes[u] for u in {w.uri for w in spec.weights})
        assert mem["weight_bytes"] <= 1.1 * in_file, (spec.stage_index, mem, in_file)
        assert mem["packed_bytes"] > 0.9 * mem["weight_bytes"]
        assert mem["dequantized_types"] == []
