"""The generation engine: prefill/decode scheduling, batching, stopping, against transformers."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models import save_tiny_llama  # noqa: E402

from jaxdist.coordinator.generation import Generator, SamplingParams  # noqa: E402
from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.export.causal_lm import CausalLM  # noqa: E402
from jaxdist.export.plugins import load_model  # noqa: E402
from jaxdist.exporters.llama import llama_model  # noqa: E402

pytestmark = pytest.mark.reference

PROMPTS = [[5, 17, 99, 3], [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180, 7, 7, 2, 90, 91, 8, 6, 1,
                            3], [42], [100, 101, 102], [7, 7, 7, 7, 7, 7], [200, 3, 4]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gen")
    hf = save_tiny_llama(root / "llama", layers=3)
    model = llama_model("llama", roots=[root], max_slots=4, max_seq=64, prefill_buckets=(8,))
    pipe = InProcessPipeline(dataclasses.replace(model, buckets=()), weights_roots=[str(root)],
                             stages=2)
    gen = Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()}, max_slots=4,
                    max_seq=64, prefill_buckets=(8,))
    yield hf, gen
    pipe.close()


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_continuous_batching_matches_transformers(tiny):
    """Six prompts through four slots: sequences join as others finish; a 20-token prompt is
    prefilled in 8-token chunks. Each must equal transformers' greedy run alone."""
    hf, gen = tiny
    lengths = [10, 4, 12, 6, 8, 5]
    params = [SamplingParams(max_tokens=n) for n in lengths]
    results = gen.run(PROMPTS, params)
    for prompt, n, res in zip(PROMPTS, lengths, results):
        assert res.tokens == _hf_greedy(hf, prompt, n)
        assert res.finish_reason == "length"
        assert res.prompt_ids == prompt


def test_stop_ids_and_strings(tiny):
    hf, gen = tiny
    want = _hf_greedy(hf, PROMPTS[0], 10)
    stop = want[4]
    first = want.index(stop)
    (res,) = gen.run([PROMPTS[0]], SamplingParams(max_tokens=10, stop_ids=frozenset({stop})))
    assert res.tokens == want[:first + 1] and res.finish_reason == "stop"

    def decode(ids):  # a stand-in detokenizer: one letter per id
        return "".join(chr(97 + t % 26) for t in ids)

    gen_text = Generator(gen.pipeline, input_dtypes=gen.dtypes, max_slots=4, max_seq=64,
                         prefill_buckets=(8,), decode=decode)
    stop_text = decode(want[3:5])
    (res,) = gen_text.run([PROMPTS[0]], SamplingParams(max_tokens=10, stop_strings=(stop_text,)))
    assert res.finish_reason == "stop"
    assert stop_text not in decode(res.tokens)
    assert res.tokens == want[:len(res.tokens)]


def test_eos_ends_generation(tiny):
    hf, gen = tiny
    want = _hf_greedy(hf, PROMPTS[3], 8)
    eos_gen = Generator(gen.pipeline, input_dtypes=gen.dtypes, max_slots=4, max_seq=64,
                        prefill_buckets=(8,), eos_ids=[want[2]])
    (res,) = eos_gen.run([PROMPTS[3]], SamplingParams(max_tokens=8))
    assert res.finish_reason == "eos" and res.tokens == want[:want.index(want[2]) + 1]
    (res,) = eos_gen.run([PROMPTS[3]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert res.tokens == want


def test_stream_yields_tokens_in_order(tiny):
    hf, gen = tiny
    assert list(gen.stream(PROMPTS[2], SamplingParams(max_tokens=6))) == _hf_greedy(
        hf, PROMPTS[2], 6)


def test_seeded_sampling_is_reproducible(tiny):
    _, gen = tiny
    p = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    a = gen.run([PROMPTS[0]], p)[0].tokens
    b = gen.run([PROMPTS[0]], p)[0].tokens
    assert a == b


def test_error_bad_sampling_params():
    with pytest.raises(SpecError, match=r"^top_p: expected a number in \(0, 1\], found 0$"):
        SamplingParams(top_p=0)
    with pytest.raises(SpecError, match=r"^max_tokens: expected an integer >= 1, found 0$"):
        SamplingParams(max_tokens=0)


def test_error_prompt_too_long(tiny):
    _, gen = tiny
    with pytest.raises(SpecError, match="prompt 0 has 64 tokens; the KV cache holds 64"):
        gen.run([[1] * 64])
    with pytest.raises(SpecError, match="prompt 0 is empty"):
        gen.run([[]])


def test_pipelined_steps_across_real_workers_match_transformers(tiny, tmp_path_factory):
    """depth=2 keeps two steps (disjoint rows of one session) in flight across two workers."""
    from jaxdist.coordinator.cluster import Cluster

    hf, gen = tiny
    root = pathlib.Path(gen.pipeline.cache.roots[0])
    model = llama_model("llama", roots=[root], max_slots=4, max_seq=64, prefill_buckets=(8,))
    lengths = [9, 5, 7, 6, 8]
    with Cluster.local(2, weights_roots=[str(root)]) as cluster:
        pipe = cluster.deploy(dataclasses.replace(model, buckets=()), stages=2)
        deep = Generator(pipe, input_dtypes=gen.dtypes, max_slots=4, max_seq=64,
                         prefill_buckets=(8,), depth=2)
        results = deep.run(PROMPTS[:5], [SamplingParams(max_tokens=n) for n in lengths])
    for prompt, n, res in zip(PROMPTS, lengths, results):
        assert res.tokens == _hf_greedy(hf, prompt, n)


# ---------------------------------------------------------------------------------------------
# Generator.for_model: the one constructor the CLI and the benchmarks use


def test_for_model_drives_an_exported_model_like_transformers(tiny):
    """The settings come from the exporter's contract (load_model), not from the caller."""
    hf, gen = tiny
    root = gen.pipeline.cache.roots[0]
    loaded = load_model("llama", roots=[root], max_slots=4, max_seq=64, prefill_buckets=(8,))
    lm = loaded.causal_lm
    assert lm is not None and lm.input_dtypes == gen.dtypes
    engine = Generator.for_model(gen.pipeline, lm, tokenizer=loaded.tokenizer)
    assert (engine.max_slots, engine.max_seq, engine.buckets, engine.dtypes, engine.eos_ids,
            engine.decode, engine.depth, engine.max_failovers) == (
        4, 64, [8], gen.dtypes, frozenset(lm.eos_ids), None, 1, 3)  # in process: depth 1
    results = engine.run(PROMPTS[:3], SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results):
        assert res.tokens == _hf_greedy(hf, prompt, 6)


class _Deployed:
    """Stands in for a deployed Pipeline: for_model looks only at its stage specs."""

    def __init__(self, stages: int) -> None:
        self.specs = [object()] * stages

    def submit(self, inputs, *, session_id="", step=0):
        raise AssertionError("not run")

    def end_session(self, session_id):
        return 0


class _Letters:
    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


LM = CausalLM(max_slots=2, max_seq=32, prefill_buckets=(16, 8), eos_ids=(3, 1),
              input_dtypes={"tokens": "int32", "slot": "int32", "pos": "int32",
                            "length": "int32"})


def test_for_model_takes_every_setting_from_the_contract():
    tok = _Letters()
    engine = Generator.for_model(_Deployed(3), LM, tokenizer=tok, max_failovers=0)
    assert (engine.max_slots, engine.max_seq, engine.buckets, engine.eos_ids, engine.dtypes) == (
        2, 32, [8, 16], frozenset({1, 3}), dict(LM.input_dtypes))
    assert engine.decode == tok.decode and engine.max_failovers == 0
    assert engine.depth == 3  # one step in flight per stage, as `jaxdist generate` always did
    assert Generator.for_model(_Deployed(3), LM, depth=1).depth == 1
    assert Generator.for_model(_Deployed(3), LM).decode is None


def test_for_model_matches_the_constructor_it_replaces():
    """What the CLI and benchmarks built by hand from ``options``, for_model builds from LM."""
    pipe, tok = _Deployed(2), _Letters()
    o = LM.to_options()
    by_hand = Generator(pipe, input_dtypes=dict(LM.input_dtypes), max_slots=o["max_slots"],
                        max_seq=o["max_seq"], prefill_buckets=tuple(o["prefill_buckets"]),
                        eos_ids=tuple(o.get("eos_ids", ())), decode=tok.decode,
                        depth=len(pipe.specs))
    engine = Generator.for_model(pipe, LM, tokenizer=tok)
    assert vars(engine) == vars(by_hand)


def test_error_for_model_on_a_pipeline_without_stages():
    with pytest.raises(SpecError, match="depth must be >= 1, got 0"):
        Generator.for_model(_Deployed(0), LM)
