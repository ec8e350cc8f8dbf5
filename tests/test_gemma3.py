"""Parity of the Gemma 3 exporter with independent references.

* Tiny random Gemma 3 text models, built here from transformers configs: local sliding-window
  layers (window 5, prompts of 11 tokens and 16 more generated) mixed with a global layer, each
  with its own RoPE (the global one linearly scaled), ``head_dim`` apart from ``hidden / heads``,
  ``query_pre_attn_scalar`` apart from ``head_dim``, a final logit softcap, and random norm
  weights (transformers initializes them to zero, where a missing ``1 +`` would not show).
  transformers' logits and greedy tokens are the reference, on 1, 2 (and 3, slow) stages, and
  for a float32 GGUF of the same weights written as llama.cpp's converter writes gemma3. Q8_0
  and Q4_0 files of them are held to transformers on the weights decoded from their blocks,
  within the activation-quantization bound (tests/quant_bound.py), and to llama.cpp on the
  same files (slow tier).
* The real Gemma 3 270M Q4_K_M file (the ``gemma3_270m`` fixture): llama.cpp (llama-cpp-python,
  built by bench/llamacpp.py in ``bench/.venv-llamacpp``, run as a subprocess) is the reference
  for its tokenizer, its chat format and its greedy tokens. jaxdist binds the file's matrices as
  stored and quantizes activations as llama.cpp does (docs/kernels.md), so greedy decoding may
  part at llama.cpp's near-ties: tokens must match up to its first top-2 margin under NEAR_TIE,
  and a first difference must be at one (as tests/test_quantized_llm.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import pathlib
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ggml_blocks  # noqa: E402
import gguf  # noqa: E402
from llamacpp_ref import check_tokens as _check_tokens  # noqa: E402
from llamacpp_ref import NEAR_TIE  # noqa: E402
from llamacpp_ref import llamacpp as _llamacpp  # noqa: E402
from llm_utils import (  # noqa: E402
    float_tolerance, forced_logits, generate, hf_reference, lazy_pipe)
from quant_bound import activation_bound  # noqa: E402

from jaxdist.coordinator.cluster import Cluster  # noqa: E402
from jaxdist.coordinator.generation import Generator, SamplingParams  # noqa: E402
from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core import kernels  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.core.weights import WeightInfo  # noqa: E402
from jaxdist.export.plugins import load_model  # noqa: E402
from jaxdist.exporters.gemma3 import (  # noqa: E402
    CHAT_TEMPLATE,
    _gguf_config,
    _hf_config,
    gemma3_model,
)

pytestmark = pytest.mark.reference

N_NEW = 16
WINDOW = 5
PROMPT = [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180]  # longer than the window
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _tiny(**overrides: Any) -> Any:
    """A random tiny Gemma3ForCausalLM; weights scaled so that logits are peaked (see the
    margins check in _check_parity) and every norm weight random."""
    torch.manual_seed(2)
    config = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
        sliding_window=WINDOW, layer_types=LAYERS, final_logit_softcapping=20.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        initializer_range=0.2, max_position_embeddings=128, bos_token_id=None,
        eos_token_id=None, pad_token_id=None) | overrides
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("gemma3_root")


@pytest.fixture(scope="module")
def hf_model(root: pathlib.Path) -> Any:
    model = _tiny()
    model.save_pretrained(root / "gemma3", safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def pipes(root: pathlib.Path, hf_model: Any) -> Any:
    """``get(stages)``: the tiny HF model's pipeline, shared by tests (compiling dominates)."""
    made: dict[int, InProcessPipeline] = {}

    def get(stages: int) -> InProcessPipeline:
        if stages not in made:
            model = gemma3_model("gemma3", roots=[root], return_logits=True, max_seq=64)
            made[stages] = lazy_pipe(model, root, stages)
        return made[stages]

    yield get
    for pipe in made.values():
        pipe.close()


def _check_parity(pipe: InProcessPipeline, hf: Any, what: str) -> None:
    want_tokens, want_logits = hf_reference(hf, PROMPT, N_NEW)
    tol = float_tolerance(want_logits)
    top2 = np.sort(want_logits, axis=-1)[:, -2:]
    # Greedy tokens are compared exactly only where the reference is not at a near-tie.
    assert float((top2[:, 1] - top2[:, 0]).min()) > 20 * tol, "reference has a near-tie"
    tokens, logits = generate(pipe, [PROMPT], N_NEW, bucket=16)
    assert tokens[0] == want_tokens, f"{what}: greedy tokens differ from transformers.generate"
    err = float(np.abs(np.stack([lg[0] for lg in logits]) - want_logits).max())
    assert err <= tol, f"{what}: max |logits - transformers| = {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------------------------
# Tiny models against transformers


@pytest.mark.parametrize("stages", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_hf_parity(hf_model: Any, pipes: Any, stages: int) -> None:
    pipe = pipes(stages)
    cfg = pipe.model.meta["config"]
    assert [u.name for u in pipe.model.units] == ["embed", "blk.0", "blk.1", "blk.2", "blk.3",
                                                  "head"]
    assert cfg.local_layers == (True, True, False, True) and cfg.sliding_window == WINDOW
    assert (cfg.head_dim, cfg.norm_offset, cfg.final_softcap) == (24, 1.0, 20.0)
    assert cfg.attn_scale == pytest.approx(20 ** -0.5)
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_local_theta) == ("linear", 4.0, 1e4)
    _check_parity(pipe, hf_model, f"Gemma 3 on {stages} stages")


def test_hf_old_config_spelling(root: pathlib.Path, hf_model: Any) -> None:
    """The config.json keys of the checkpoints on the Hub (rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern) give the config transformers' new spelling does."""
    new = gemma3_model("gemma3", roots=[root]).meta["config"]
    config = json.loads((root / "gemma3" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        config.pop(key, None)
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    old = root / "gemma3-old"
    old.mkdir(exist_ok=True)
    (old / "config.json").write_text(json.dumps(config))
    for f in (root / "gemma3").glob("*.safetensors"):
        (old / f.name).write_bytes(f.read_bytes())
    # Pattern 3 makes every third layer global: layer 2 of 4, as LAYERS says.
    assert gemma3_model("gemma3-old", roots=[root]).meta["config"] == new


def _write_gguf(hf: Any, path: pathlib.Path, qtype: str = "F32") -> Any:
    """Write an HF Gemma 3 as a GGUF the way llama.cpp's converter writes gemma3 (its
    Gemma3Model: keys, tensor names, 1 added to every norm weight, no lm_head for tied
    embeddings), its matrices in ``qtype`` (blocks from gguf.quants / ggml), norms F32. The
    layer pattern goes in as one bool per layer, which llama.cpp reads, since this model's is
    not the default (every 6th layer global); no vocabulary (token ids only), so llama.cpp
    reads the vocabulary size. Returns a copy of ``hf`` holding the weights ``gguf.quants``
    decodes from the file (``hf`` itself for F32)."""
    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    w.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
    if rope["full_attention"].get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(float(c.final_logit_softcapping))
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    w.add_tokenizer_model("none")
    w.add_vocab_size(c.vocab_size)
    decoded: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, t: np.ndarray) -> None:
        if t.ndim == 2 and qtype != "F32":
            blocks = ggml_blocks.quantize(t, qtype)
            w.add_tensor(name, blocks, raw_shape=blocks.shape,
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
            decoded[hf_name] = ggml_blocks.dequantize(blocks, qtype)
        else:
            w.add_tensor(name, t)

    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    add("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", "model.norm.weight", sd["model.norm.weight"] + np.float32(1))
    for i in range(c.num_hidden_layers):
        for g, h in names.items():
            t = sd[f"model.layers.{i}.{h}.weight"]
            add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight",
                t + np.float32(1) if "norm" in g else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if not decoded:
        return hf
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():  # the tied lm_head shares embed_tokens
            if name in decoded:
                p.copy_(torch.from_numpy(decoded[name]))
    return ref


def test_gguf_f32_parity(root: pathlib.Path) -> None:
    """A float32 GGUF written as llama.cpp writes gemma3. Its score scale is llama.cpp's
    (head_dim ** -0.5: a GGUF holds no query_pre_attn_scalar), so the model here has
    query_pre_attn_scalar = head_dim, as every Gemma 3 but the 27B."""
    hf = _tiny(query_pre_attn_scalar=24)
    _write_gguf(hf, root / "gemma3.gguf")
    model = gemma3_model("gemma3.gguf", roots=[root], return_logits=True, max_seq=64)
    cfg = model.meta["config"]
    assert (cfg.norm_offset, cfg.local_layers, cfg.sliding_window) == (0.0, (True, True, False,
                                                                             True), WINDOW)
    assert cfg.attn_scale == pytest.approx(24 ** -0.5) and cfg.tied
    with lazy_pipe(model, root, 1) as pipe:
        _check_parity(pipe, hf, "Gemma 3 F32 GGUF")


@pytest.fixture(scope="module")
def quantized_files(root: pathlib.Path) -> dict[str, Any]:
    """Q8_0 and Q4_0 GGUFs of one tiny model (query_pre_attn_scalar = head_dim, as for the
    F32 file), and for each the HF model holding the weights decoded from its blocks."""
    hf = _tiny(query_pre_attn_scalar=24)
    return {q: _write_gguf(hf, root / f"gemma3.{q}.gguf", q) for q in ("Q8_0", "Q4_0")}


# Q4_0 in the slow tier: the same kernels' path with another block type.
@pytest.mark.parametrize("qtype", ["Q8_0", pytest.param("Q4_0", marks=pytest.mark.slow)])
def test_gguf_quantized_close(root: pathlib.Path, quantized_files: dict[str, Any],
                              qtype: str) -> None:
    """Packed Q8_0/Q4_0 matrices (the tied embedding too, gathered and as the LM head) against
    transformers on the decoded weights, within the activation-quantization bound
    (tests/quant_bound.py), teacher-forced past the local layers' window."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    ref = quantized_files[qtype]
    want_tokens, _ = hf_reference(ref, PROMPT, 4)
    tokens = [*PROMPT, *want_tokens]
    rows = slice(len(PROMPT) - 1, len(tokens))
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, rows].numpy()
    bound = activation_bound(ref, tokens, rows, qtype) + float_tolerance(want)
    model = gemma3_model(f"gemma3.{qtype}.gguf", roots=[root], return_logits=True, max_seq=64)
    packed = {p.uri.rsplit("#", 1)[1]: p.quant for u in model.units for p in u.params.values()
              if p.packed}
    assert packed.get("blk.0.attn_q.weight") == qtype and packed.get("token_embd.weight") == qtype
    with lazy_pipe(model, root, 2) as pipe:
        got = forced_logits(pipe, [tokens[:len(PROMPT)]], [tokens[len(PROMPT):]])[:, 0]
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"Gemma 3 {qtype}: |logits - transformers| {err[worst]:.3g} "
                                  f"over the bound {bound[worst]:.3g} at (step, token) {worst}")


@pytest.mark.slow  # llama.cpp's bindings: make test-slow builds them (bench/llamacpp.py)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_gguf_quantized_matches_llamacpp(root: pathlib.Path, quantized_files: dict[str, Any],
                                         qtype: str) -> None:
    """The same tiny files in llama.cpp (its own Gemma 3 graph and quantized arithmetic):
    teacher-forced logits along llama.cpp's greedy run within NEAR_TIE of its own, and the
    same greedy token wherever its top-2 margin is not a near-tie."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    path = root / f"gemma3.{qtype}.gguf"
    (greedy,) = _llamacpp(model=str(path), prompts=[PROMPT], n_new=N_NEW, n_ctx=64,
                          text=False)["greedy"]
    tokens = [*PROMPT, *greedy["tokens"][:-1]]
    (want,) = _llamacpp(model=str(path), forced=[tokens], n_prompt=len(PROMPT),
                        n_ctx=64)["logits"]
    model = gemma3_model(path.name, roots=[root], return_logits=True, max_seq=64)
    with lazy_pipe(model, root, 1) as pipe:
        got = forced_logits(pipe, [tokens[:len(PROMPT)]], [tokens[len(PROMPT):]])[:, 0]
    err = float(np.abs(got - np.asarray(want)).max())
    assert err <= NEAR_TIE, f"Gemma 3 {qtype}: max |logits - llama.cpp| = {err:.3g}"
    for step, (token, margin) in enumerate(zip(greedy["tokens"], greedy["margins"])):
        if margin >= NEAR_TIE:
            assert int(np.argmax(got[step])) == token, f"Gemma 3 {qtype} step {step}"


def test_conditional_generation_exports_the_text_model(root: pathlib.Path, hf_model: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Gemma3ForConditionalGeneration: the text model's tensors (under language_model.), and a
    warning naming the vision tower that is left out."""
    text = _tiny().config.to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4)
    transformers.Gemma3ForConditionalGeneration(config).save_pretrained(root / "gemma3-vl")
    with caplog.at_level(logging.WARNING, logger="jaxdist.exporters.gemma3"):
        model = gemma3_model("gemma3-vl", roots=[root])
    assert "vision tower (siglip_vision_model)" in caplog.text
    assert "images cannot be given" in caplog.text
    uris = [p.uri for u in model.units for p in u.params.values()]
    assert all("#language_model.model." in u for u in uris), uris
    assert not any("vision" in u or "multi_modal" in u for u in uris)
    assert model.meta["config"] == gemma3_model("gemma3", roots=[root]).meta["config"]


# ---------------------------------------------------------------------------------------------
# The config: what is read, what is refused


def test_hf_config_takes_transformers_defaults() -> None:
    """gemma-3-4b-it's config.json names only some keys of its text_config; the rest are
    transformers' Gemma3TextConfig defaults, and its rope_scaling (linear, 8) is the global
    layers'."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    cfg = _hf_config({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
                      "vision_config": {"model_type": "siglip_vision_model"}}, "4b")
    want = transformers.Gemma3TextConfig(**text)
    assert (cfg.vocab, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        want.vocab_size, want.num_attention_heads, want.num_key_value_heads, want.head_dim)
    assert cfg.attn_scale == pytest.approx(want.query_pre_attn_scalar ** -0.5)
    assert cfg.local_layers == tuple(t == "sliding_attention" for t in want.layer_types)
    rope = want.rope_parameters
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta, cfg.rope_local_theta) == (
        "linear", 8.0, rope["full_attention"]["rope_theta"],
        rope["sliding_attention"]["rope_theta"])
    assert (cfg.sliding_window, cfg.tied, cfg.max_position) == (
        1024, want.tie_word_embeddings, want.max_position_embeddings)


def _meta(**keys: Any) -> dict[str, Any]:
    meta = {"general.architecture": "gemma3", "gemma3.embedding_length": 64,
            "gemma3.attention.head_count": 4, "gemma3.block_count": 8,
            "gemma3.feed_forward_length": 128, "gemma3.attention.key_length": 24}
    return meta | {f"gemma3.{k}": v for k, v in keys.items()}


def test_gguf_layer_pattern_as_llamacpp_reads_it() -> None:
    """llama.cpp's rules (src/models/gemma3.cpp, load_swa_pattern): no window, every layer
    global; no pattern key, every 6th layer global; an int n, every n-th; a bool per layer."""
    infos = {"token_embd.weight": gguf_info((256, 64))}

    def local(**keys: Any) -> tuple[bool, ...]:
        return _gguf_config(_meta(**keys), infos, "t.gguf").local_layers

    assert local() == (False,) * 8
    w = {"attention.sliding_window": 4}
    assert local(**w) == (True,) * 5 + (False,) + (True,) * 2
    assert local(**w, **{"attention.sliding_window_pattern": 3}) == (True, True, False) * 2 + (
        True, True)
    pattern = [True, False] * 4
    assert local(**w, **{"attention.sliding_window_pattern": pattern}) == tuple(pattern)
    cfg = _gguf_config(_meta(**w), infos, "t.gguf")
    assert (cfg.rope_local_theta, cfg.norm_offset, cfg.tied) == (10000.0, 0.0, True)


def gguf_info(shape: tuple[int, ...]) -> WeightInfo:
    return WeightInfo("token_embd.weight", shape, "float32", None, 4 * int(np.prod(shape)),
                      "t.gguf")


def test_error_refused_gguf_keys() -> None:
    infos = {"token_embd.weight": gguf_info((256, 64))}
    with pytest.raises(SpecError, match=r"'gemma3.attn_logit_softcapping' = 50.0 \(attention "
                                        r"logit softcapping, Gemma 2's\) is not supported"):
        _gguf_config(_meta(attn_logit_softcapping=50.0), infos, "t.gguf")
    with pytest.raises(SpecError, match=r"'gemma3.rope.scaling.type' = 'yarn' is not supported; "
                                        r"expected none or linear"):
        _gguf_config(_meta(**{"rope.scaling.type": "yarn"}), infos, "t.gguf")
    with pytest.raises(SpecError, match=r"'gemma3.attention.sliding_window_pattern' has 3 "
                                        r"entries, expected one per layer \(8\)"):
        _gguf_config(_meta(**{"attention.sliding_window": 4,
                              "attention.sliding_window_pattern": [True] * 3}), infos, "t.gguf")
    with pytest.raises(SpecError, match=r"architecture 'llama' is not supported by the gemma3 "
                                        r"exporter"):
        _gguf_config({"general.architecture": "llama"}, infos, "t.gguf")


def test_error_refused_hf_features(root: pathlib.Path, hf_model: Any) -> None:
    """Each refusal names the key, what was found and what is supported, all at once."""
    config = json.loads((root / "gemma3" / "config.json").read_text())
    config.update(attn_logit_softcapping=50.0, use_bidirectional_attention=True,
                  hidden_activation="gelu")
    config["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 8.0}
    bad = root / "gemma3-bad"
    bad.mkdir(exist_ok=True)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError) as err:
        gemma3_model("gemma3-bad", roots=[root])
    msg = str(err.value)
    for part in ("attn_logit_softcapping=50.0 (attention logit softcapping, Gemma 2's; "
                 "supported: null)", "use_bidirectional_attention=true (supported: false)",
                 "hidden_activation='gelu' (supported: 'gelu_pytorch_tanh')",
                 "RoPE scaling type 'yarn' on the full_attention layers (supported: default, "
                 "linear)"):
        assert part in msg, msg


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M Q4_K_M against llama.cpp

TEXTS = ["The capital of France is", "Hello world!  Two  spaces\nnewline\n\n\ttab",
         "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
         "naïve café 日本語 😀 émoji \u200b", "   leading spaces", "x" * 40,
         "1234567890 3.14159 -0.5e10", "def f(x):\n    return x**2  # square\n",
         "<bos><eos> <pad> <unused0> <start_of_image>", "Ünïcödé ∑∫√ ← → ✓", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def real_tokenizer(gemma3_270m: pathlib.Path) -> Any:
    """The real file's tokenizer as the exporter gives it (building its merges takes seconds)."""
    loaded = load_model(gemma3_270m.name, roots=[str(gemma3_270m.parent)], max_seq=64)
    return loaded.tokenizer


@pytest.mark.slow  # llama.cpp's bindings: make test-slow builds them (bench/llamacpp.py)
def test_real_tokenizer_and_chat_format_match_llamacpp(gemma3_270m: pathlib.Path,
                                                        real_tokenizer: Any) -> None:
    """The SentencePiece-style vocabulary (262144 tokens, byte fallback, no space prefix, BOS
    added) tokenizes as llama.cpp does, special tokens included; the chat format is llama.cpp's
    Gemma template (after the BOS that jaxdist's template writes and llama.cpp adds when it
    tokenizes)."""
    want = _llamacpp(model=str(gemma3_270m), texts=TEXTS, chat=CHAT)
    tok = real_tokenizer
    assert tok is not None and tok.vocab_size == 262144 and tok.bos_id == 2
    assert {1, 106} <= tok.eos_ids  # <eos>, <end_of_turn>
    for text, ids in zip(TEXTS, want["ids"], strict=True):
        assert tok.encode(text) == ids, f"{text!r}: {tok.encode(text)} != llama.cpp {ids}"
        if "<" not in text:
            assert tok.decode(ids) == text
    assert tok.chat_template == CHAT_TEMPLATE  # the file carries none
    assert tok.apply_chat_template(CHAT) == "<bos>" + want["chat"]
    with pytest.raises(SpecError, match=r"only text is supported \(the vision tower is not "
                                        r"exported\)"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}])


REAL_PROMPT = "Monday, Tuesday, Wednesday,"
REAL_NEW = 24


@pytest.fixture(scope="module")
def real_reference(gemma3_270m: pathlib.Path, real_tokenizer: Any
                   ) -> tuple[list[int], dict[str, Any]]:
    prompt = real_tokenizer.encode(REAL_PROMPT)
    (greedy,) = _llamacpp(model=str(gemma3_270m), prompts=[prompt], n_new=REAL_NEW,
                          n_ctx=128)["greedy"]
    return prompt, greedy


# Two workers in the fast tier (the real model split across processes); one in the slow.
@pytest.mark.slow  # llama.cpp's bindings: make test-slow builds them (bench/llamacpp.py)
@pytest.mark.parametrize("workers", [1, 2])
def test_real_gemma3_matches_llamacpp(gemma3_270m: pathlib.Path, real_reference: Any,
                                      workers: int) -> None:
    """Greedy tokens of the real file, its matrices bound as stored (Q5_0, Q8_0, Q4_K, Q6_K all
    have kernels), on real workers, against llama.cpp's."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    prompt, want = real_reference
    root, name = gemma3_270m.parent, gemma3_270m.name
    model = gemma3_model(name, roots=[root], max_slots=1, max_seq=128, prefill_buckets=(16,))
    assert all(p.packed for u in model.units for n, p in u.params.items() if n.startswith("w"))
    model = dataclasses.replace(model, buckets=[{"b": 1, "s": 1}, {"b": 1, "s": 16}])
    with Cluster.local(workers, weights_roots=[str(root)]) as cluster:
        with cluster.deploy(model, stages=workers) as pipe:
            gen = Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                            max_slots=1, max_seq=128, prefill_buckets=(16,))
            (result,) = gen.run([prompt], SamplingParams(max_tokens=REAL_NEW, ignore_eos=True))
            memory = pipe.stage_memory()
    _check_tokens(result.tokens, want, f"{workers} workers")
    assert all(m["dequantized_types"] == [] for m in memory)


@pytest.mark.slow
def test_real_gemma3_past_its_window(gemma3_270m: pathlib.Path, real_tokenizer: Any) -> None:
    """A prompt longer than the local layers' window (512): 1, 2, ... 185 is 555 tokens, and
    the counting goes on. Quantized, in process, against llama.cpp; the decode steps read their
    windows through the CPU kernel (v2). The window shows here: run without it, the model
    skips to 187, where llama.cpp's top-2 margin is 10."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    root, name = gemma3_270m.parent, gemma3_270m.name
    prompt = real_tokenizer.encode(", ".join(str(i) for i in range(1, 186)) + ",")
    assert len(prompt) > 512
    (want,) = _llamacpp(model=str(gemma3_270m), prompts=[prompt], n_new=12,
                        n_ctx=1024)["greedy"]
    model = gemma3_model(name, roots=[root], max_slots=1, max_seq=1024)
    with lazy_pipe(model, root, 1) as pipe:
        got, _ = generate(pipe, [prompt], 12, bucket=len(prompt))
    _check_tokens(got[0], want, "past the window")


@pytest.mark.slow
def test_real_gemma3_dequantized_matches_transformers(gemma3_270m: pathlib.Path,
                                                      real_tokenizer: Any) -> None:
    """The real file bound as float32 (``quantized=False``, ``--dequantize``), float32
    activations, on 2 stages, against transformers' own GGUF loader and tokenizer (which
    decode the same file with gguf.quants and undo llama.cpp's norm +1): the prompt's ids, the
    logits and the greedy tokens. A reference that needs no llama.cpp build."""
    root, name = gemma3_270m.parent, gemma3_270m.name
    hf_tok = transformers.AutoTokenizer.from_pretrained(root, gguf_file=name)
    prompt = hf_tok(REAL_PROMPT).input_ids
    assert real_tokenizer.encode(REAL_PROMPT) == prompt
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=name,
                                                           dtype=torch.float32).eval()
    want_tokens, want_logits = hf_reference(hf, prompt, REAL_NEW)
    del hf
    model = gemma3_model(name, roots=[root], max_slots=1, max_seq=128, quantized=False,
                         return_logits=True)
    with lazy_pipe(model, root, 2) as pipe:
        tokens, logits = generate(pipe, [prompt], REAL_NEW, bucket=16)
    got = np.stack([lg[0] for lg in logits])
    err, tol = float(np.abs(got - want_logits).max()), float_tolerance(want_logits)
    assert err <= tol, f"max |logits - transformers| = {err:.3g} > {tol:.3g}"
    top2 = np.sort(want_logits, axis=-1)[:, -2:]
    assert float((top2[:, 1] - top2[:, 0]).min()) > 2 * tol, "reference has a near-tie"
    assert tokens[0] == want_tokens


@pytest.mark.slow
def test_cli_generate_on_two_local_workers(gemma3_270m: pathlib.Path,
                                           real_reference: Any) -> None:
    """``jaxdist generate --model <the GGUF>``, its default of 2 local workers, as a user runs
    it: llama.cpp's greedy tokens (up to its near-ties) and its text."""
    prompt, want = real_reference
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", "generate", "--model", str(gemma3_270m),
         "--prompt", REAL_PROMPT, "--max-tokens", str(REAL_NEW), "--max-seq", "128",
         "--slots", "1", "--buckets", "16", "--json"],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == prompt and out["stages"] == 2
    _check_tokens(out["tokens"], want, "jaxdist generate")
    if out["tokens"] == want["tokens"]:
        assert out["text"] == want["text"]
