"""bench/make_gguf.py's random-weight Llamas, which bench/cpu_step.py races against llama.cpp.

The files must be what the benchmark says they are (the types of a Q4_0 or Q4_K_M file, the
tokenizer llama.cpp needs), and jaxdist must compute on them what llama.cpp's arithmetic gives:
greedy tokens from the CPU kernels (the wide dot products where the CPU has them) against
tests/quant_reference.py, a numpy forward pass with llama.cpp's activation quantization, up to
the reference's first near-tie. A small shape of the same generator keeps this quick.
"""

from __future__ import annotations

import pathlib
import sys

import gguf
import pytest
from quant_reference import QuantLlama

from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core import kernels
from jaxdist.export.plugins import load_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import make_gguf  # noqa: E402  (bench/ is scripts, not a package)

pytestmark = pytest.mark.skipif(not kernels.load().available,
                                reason=f"CPU kernels unavailable: {kernels.load().reason}")

SMALL = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 512}
NEAR_TIE = 0.25  # logits, as in tests/test_quantized_llm.py
N_NEW = 8


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_K_M"])
def test_bench_model_types_and_tokens_match_the_reference(quant: str, tmp_path: pathlib.Path
                                                          ) -> None:
    path = make_gguf.write(tmp_path / f"small-{quant}.gguf", make_gguf.Shape(**SMALL, quant=quant))
    assert make_gguf.write(path, make_gguf.Shape(**SMALL, quant=quant)) == path  # kept as is
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["output.weight"] == "Q6_K"
    layer_types = {v for k, v in types.items() if k.startswith("blk.") and "norm" not in k}
    assert layer_types == ({"Q4_0"} if quant == "Q4_0" else {"Q4_K", "Q6_K"}), layer_types
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == make_gguf.Shape().vocab

    loaded = load_model(path.name, roots=[str(tmp_path)], max_seq=32, max_slots=1,
                        prefill_buckets=(8,))
    prompt = loaded.tokenizer.encode("The capital of France is")
    want, margins = QuantLlama(str(path)).greedy(prompt, N_NEW)
    first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
    assert first_tie >= 3, f"the random model is too flat to test with: margins {margins}"
    with InProcessPipeline(loaded.model, weights_roots=[str(tmp_path)], stages=1) as pipe:
        gen = Generator.for_model(pipe, loaded.causal_lm)
        (got,) = gen.run([prompt], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    assert got.tokens[:first_tie] == want[:first_tie], (got.tokens, want, margins)
