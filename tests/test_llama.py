"""Parity of the llama exporter with transformers: random HF Llama/Qwen2, GGUF, real SmolLM2.

Every expected value comes from an independent reference: transformers' forward pass and
``generate`` (greedy), transformers' GGUF loader for the real SmolLM2 file, and transformers'
top-k/top-p logits warpers for the sampling distribution.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from llm_utils import generate, hf_reference, lazy_pipe, step_inputs  # noqa: E402

from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.exporters import layers  # noqa: E402
from jaxdist.exporters.llama import LlamaConfig, llama_model  # noqa: E402

pytestmark = pytest.mark.reference

N_NEW = 16
PROMPTS = {"short": [5, 17, 99, 3, 200, 41, 7], "long": [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180]}


def _tiny(arch: str, **overrides: Any) -> Any:
    """A random tiny HF model; weights scaled up so logits are peaked and ties impossible."""
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None) | overrides
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:  # tied embeddings, q/k/v bias
        config = transformers.Qwen2Config(tie_word_embeddings=True, **common)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("llama_root")


@pytest.fixture(scope="module")
def tiny_pipes(root: pathlib.Path) -> Any:
    """``get(arch, stages)``: the tiny HF model's pipeline, shared by tests (compiling dominates)."""
    pipes: dict[tuple[str, int], InProcessPipeline] = {}

    def get(arch: str, stages: int) -> InProcessPipeline:
        if (arch, stages) not in pipes:
            model = llama_model(arch, roots=[root], return_logits=True, max_seq=64)
            pipes[arch, stages] = lazy_pipe(model, root, stages)
        return pipes[arch, stages]

    yield get
    for pipe in pipes.values():
        pipe.close()


@pytest.fixture(scope="module")
def hf_models(root: pathlib.Path) -> dict[str, Any]:
    models = {arch: _tiny(arch) for arch in ("llama", "qwen2")}
    for arch, model in models.items():
        model.save_pretrained(root / arch, safe_serialization=True)
    return models


def _assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max |logits - transformers| = {err:.3g} > {tol:.3g}"


def _check_parity(pipe: InProcessPipeline, hf: Any, prompt: Sequence[int], what: str) -> None:
    want_tokens, want_logits = hf_reference(hf, prompt, N_NEW)
    tokens, logits = generate(pipe, [prompt], N_NEW, bucket=16)
    assert tokens[0] == want_tokens, f"{what}: greedy tokens differ from transformers.generate"
    assert len(logits) == N_NEW
    _assert_logits_close(np.stack([lg[0] for lg in logits]), want_logits, what)


# ---------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("stages", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3: slow tier
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_parity(hf_models: dict[str, Any], tiny_pipes: Any, arch: str, stages: int) -> None:
    pipe = tiny_pipes(arch, stages)
    assert [u.name for u in pipe.model.units] == ["embed", "blk.0", "blk.1", "blk.2", "blk.3",
                                                  "head"]
    assert len(pipe.stages) == stages
    prompt = PROMPTS["short" if stages % 2 else "long"]
    _check_parity(pipe, hf_models[arch], prompt, f"{arch} on {stages} stages")


def _write_gguf(hf: Any, path: pathlib.Path, arch: str,
                rope_freqs: np.ndarray | None = None) -> None:
    """Write an HF model as an f32 GGUF the way llama.cpp's convert_hf_to_gguf.py does."""
    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads

    def permute(w: np.ndarray, heads: int) -> np.ndarray:
        # convert_hf_to_gguf.py LlamaModel.permute: halves -> interleaved pairs, per head.
        if arch != "llama":
            return w  # qwen2 is written as is and run in NeoX (rotate_half) mode
        return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_dimension_count(c.hidden_size // n_head)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    if rope_freqs is not None:  # llama.cpp's llama3 RoPE: per-frequency divisors
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for g, h in names.items():
            for kind in ("weight", "bias"):
                t = sd.get(f"model.layers.{i}.{h}.{kind}")
                if t is None:
                    continue
                if g in ("attn_q", "attn_k"):
                    t = permute(t, n_head if g == "attn_q" else n_kv)
                w.add_tensor(f"blk.{i}.{g}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_parity(hf_models: dict[str, Any], root: pathlib.Path, arch: str) -> None:
    _write_gguf(hf_models[arch], root / f"{arch}.gguf", arch)
    cfg = LlamaConfig.from_gguf(f"{arch}.gguf", roots=[root])
    assert cfg.rope_interleaved == (arch == "llama")
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 4, 2, 16)
    assert cfg.tied == (arch == "qwen2") and cfg.qkv_bias == (arch == "qwen2")
    model = llama_model(f"{arch}.gguf", roots=[root], return_logits=True, max_seq=64)
    with lazy_pipe(model, root, 2) as pipe:
        _check_parity(pipe, hf_models[arch], PROMPTS["long"], f"{arch} GGUF")


def test_llama3_rope_scaling(root: pathlib.Path) -> None:
    """Llama 3 RoPE scaling: from config.json (HF) and as GGUF's rope_freqs.weight factors."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    hf = _tiny("llama", rope_parameters=rope, max_position_embeddings=256)
    hf.save_pretrained(root / "llama3", safe_serialization=True)
    hd = 16
    base = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    scaled = hf.model.rotary_emb.inv_freq.numpy()
    assert not np.allclose(base, scaled), "the test model must really scale its RoPE"
    _write_gguf(hf, root / "llama3.gguf", "llama", rope_freqs=base / scaled)
    for path in ("llama3", "llama3.gguf"):
        model = llama_model(path, roots=[root], return_logits=True, max_seq=64)
        assert model.meta["config"].rope_type == ("llama3" if path == "llama3" else "freqs")
        with lazy_pipe(model, root, 1) as pipe:
            _check_parity(pipe, hf, PROMPTS["long"], f"llama3 RoPE from {path}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close(hf_models: dict[str, Any], root: pathlib.Path, dtype: str) -> None:
    model = llama_model("llama", roots=[root], return_logits=True, max_seq=64, dtype=dtype)
    prompt = PROMPTS["long"]
    _, want = hf_reference(hf_models["llama"], prompt, 1)
    with lazy_pipe(model, root, 2) as pipe:
        _, logits = generate(pipe, [prompt], 1)
    err = float(np.abs(logits[0][0] - want[0]).max())
    assert err <= 0.05 * float(np.abs(want).max()), f"{dtype}: max logits error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# Batching: rows in different slots, at different positions, padded


def test_batch_matches_solo(hf_models: dict[str, Any], tiny_pipes: Any) -> None:
    prompts = [PROMPTS["short"], PROMPTS["long"]]
    pipe = tiny_pipes("llama", 2)
    solo = [generate(pipe, [p], N_NEW, slots=[1])[0][0] for p in prompts]
    batched, _ = generate(pipe, prompts, N_NEW, slots=[3, 0])
    assert batched == solo
    # Continuous batching: row A decodes alone, then B's prompt joins A's decode in one
    # padded step (A: 1 true token at pos 7+k; B: 11 tokens at pos 0).
    with pipe.session() as session:
        a, b = prompts
        got_a = [int(session(step_inputs([a], slots=[2], pos=[0], width=16))["token"][0])]
        for k in range(3):
            got_a.append(int(session(step_inputs([[got_a[-1]]], slots=[2],
                                                 pos=[len(a) + k]))["token"][0]))
        out = session(step_inputs([[got_a[-1]], b], slots=[2, 1], pos=[len(a) + 3, 0],
                                  width=16))
        got_a.append(int(out["token"][0]))
        got_b = [int(out["token"][1])]
        for k in range(4):
            out = session(step_inputs([[got_a[-1]], [got_b[-1]]], slots=[2, 1],
                                      pos=[len(a) + 4 + k, len(b) + k]))
            got_a.append(int(out["token"][0]))
            got_b.append(int(out["token"][1]))
        # Slot reuse: B restarts in A's slot 2, over A's stale (longer) cache entries.
        reuse = [int(session(step_inputs([b], slots=[2], pos=[0], width=16))["token"][0])]
        for k in range(3):
            reuse.append(int(session(step_inputs([[reuse[-1]]], slots=[2],
                                                 pos=[len(b) + k]))["token"][0]))
    want_a, _ = hf_reference(hf_models["llama"], a, N_NEW)
    want_b, _ = hf_reference(hf_models["llama"], b, N_NEW)
    assert solo == [want_a, want_b]
    assert got_a == want_a[:len(got_a)] and got_b == want_b[:len(got_b)]
    assert reuse == want_b[:len(reuse)]


# ---------------------------------------------------------------------------------------------
# Sampling


def test_sampling_seeded(hf_models: dict[str, Any], tiny_pipes: Any) -> None:
    prompt = PROMPTS["short"]
    pipe = tiny_pipes("llama", 1)
    greedy = generate(pipe, [prompt], 8)[0][0]
    runs = {seed: generate(pipe, [prompt], 8, temperature=1.5, seed=seed)[0][0]
            for seed in (1, 2)}
    again = generate(pipe, [prompt], 8, temperature=1.5, seed=1)[0][0]
    top1 = generate(pipe, [prompt], 8, temperature=1.5, top_k=1, seed=3)[0][0]
    nucleus0 = generate(pipe, [prompt], 8, temperature=1.5, top_p=1e-6, seed=4)[0][0]
    assert runs[1] == again, "a seeded run must be reproducible"
    assert runs[1] != runs[2], "different seeds should give different samples"
    assert runs[1] != greedy
    assert top1 == greedy and nucleus0 == greedy, "top_k=1 / tiny top_p must reduce to greedy"


def test_sampling_distribution_matches_hf_warpers() -> None:
    """Empirical token frequencies follow softmax of transformers' TopK + TopP warped logits."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.2, -1.0, 0.9], np.float32)
    temperature, top_k, top_p, n = 0.8, 5, 0.85, 20000
    z = torch.tensor(logits[None] / temperature)
    z = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, z))
    want = torch.softmax(z, -1)[0].numpy()
    fn = jax.jit(layers.sample_tokens)
    tokens = np.asarray(fn(np.tile(logits, (n, 1)), np.full(n, temperature, np.float32),
                           np.full(n, top_k, np.int32), np.full(n, top_p, np.float32),
                           np.full(n, 7, np.uint32), np.arange(n, dtype=np.int32)))
    freq = np.bincount(tokens, minlength=len(logits)) / n
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(want)), (freq, want)
    np.testing.assert_allclose(freq, want, atol=0.015)


def test_greedy_matches_numpy_argmax_on_ties_and_nan() -> None:
    """Greedy picks numpy's argmax: the first of tied maxima, the first NaN, +-inf rows."""
    rng = np.random.default_rng(3)
    z = rng.standard_normal((6, 300)).astype(np.float32)
    z[0, [40, 7, 250]] = 9.0                      # ties: the first index wins
    z[1, [12, 90]] = np.nan                       # NaN beats everything, first NaN wins
    z[2] = -np.inf
    z[3, [5, 6]] = np.inf
    z[4, -1] = 50.0                               # the last index
    n = len(z)
    fn = jax.jit(layers.sample_tokens)
    got = np.asarray(fn(z, np.zeros(n, np.float32), np.zeros(n, np.int32),
                        np.ones(n, np.float32), np.zeros(n, np.uint32), np.zeros(n, np.int32)))
    np.testing.assert_array_equal(got, np.argmax(z, axis=-1))
    assert list(got[:5]) == [7, 12, 0, 5, 299]


# ---------------------------------------------------------------------------------------------
# Real model: SmolLM2-135M-Instruct (Q4_1/Q8_0 GGUF, tied embeddings)


@pytest.mark.slow
def test_smollm2_gguf_greedy(smollm2: pathlib.Path, smollm2_reference: Any) -> None:
    n_new, root, name = 24, smollm2.parent, smollm2.name
    prompt, want = smollm2_reference
    t0 = time.perf_counter()
    # Dequantized: float32 activations, as transformers computes (the quantized default has
    # its own reference in tests/test_quantized_llm.py).
    model = llama_model(name, roots=[root], max_slots=1, max_seq=128, quantized=False)
    cfg = model.meta["config"]
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.tied) == (
        30, 576, 9, 3, True)
    with lazy_pipe(model, root, 2) as pipe:
        got, _ = generate(pipe, [prompt], n_new, bucket=16)
    print(f"smollm2: jaxdist 2 stages in one process {time.perf_counter() - t0:.1f}s")
    assert len(want) >= n_new - 1 and got[0][:len(want)] == want


# ---------------------------------------------------------------------------------------------
# Errors


def test_error_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(SpecError, match=r"architectures \['GPT2LMHeadModel'\] are not supported"):
        llama_model("gpt2", roots=[tmp_path])


def test_error_bad_dtype(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match=r"dtype 'int8' is not supported; expected one of"):
        llama_model("llama", roots=[root], dtype="int8")


def test_mistral_sliding_window_parity(root: pathlib.Path) -> None:
    """Mistral v0.1's sliding window (8 positions, max_seq 64) with a prompt and a generation
    longer than it (11 + 16 tokens): transformers' logits and greedy tokens, on 2 stages."""
    torch.manual_seed(1)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=8, **common))
    hf.eval().save_pretrained(root / "mistral", safe_serialization=True)
    model = llama_model("mistral", roots=[root], return_logits=True, max_seq=64)
    assert model.meta["config"].sliding_window == 8
    with lazy_pipe(model, root, 2) as pipe:
        _check_parity(pipe, hf, PROMPTS["long"], "Mistral, window 8")
    # The window shows in the logits: without it transformers computes something else, far
    # beyond the tolerance, so the parity above would catch a window left out.
    full = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None,
                                                                      **common)).eval()
    full.load_state_dict(hf.state_dict())
    _, windowed = hf_reference(hf, PROMPTS["long"], N_NEW)
    _, unwindowed = hf_reference(full, PROMPTS["long"], N_NEW)
    assert float(np.abs(windowed - unwindowed).max()) > 100 * 1e-4 * float(
        np.abs(windowed).max())


def test_error_qwen2_sliding_window(root: pathlib.Path) -> None:
    """Qwen2's window covers only the layers from max_window_layers on: refused past it."""
    config = dict(architectures=["Qwen2ForCausalLM"], vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
                  max_window_layers=2)
    (root / "qwen2-swa").mkdir(exist_ok=True)
    (root / "qwen2-swa" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=r"Qwen2's sliding-window attention \(use_sliding_window, "
                                        r"window 32 on the layers from max_window_layers on\) "
                                        r"is not supported; pass max_seq <= 32"):
        llama_model("qwen2-swa", roots=[root], max_seq=64)
