"""Parity of the llama exporter's Qwen3 and Phi-3 paths with transformers: HF, GGUF F32, Q8_0, Q4_0.

Tiny random models are built here from transformers configs, with every RMSNorm weight drawn
at random (q_norm/k_norm included) so a norm applied in the wrong place shows. The Qwen3 model
has ``head_dim`` 24 with 4 heads over a width of 64 (so q is 96 wide, not 64) and its own output
matrix; the Phi-3 model has Phi-4-mini's features: partial RoPE (3/4 of each head), ``longrope``
with random short factors and an attention factor (``max_position_embeddings`` 4 times
``original_max_position_embeddings``), and tied embeddings.

Every expected value comes from transformers: its forward pass and greedy ``generate`` on the
HF files and on the F32 GGUF the tests write (names, keys and tensor layout as llama.cpp's
``convert_hf_to_gguf.py`` writes them: neither arch has its q/k rows permuted). The Q8_0 and
Q4_0 files (blocks from ``gguf.quants``) are checked against transformers run on the weights
``gguf.quants`` decodes from those blocks, so the weights' own rounding is no error; what is left
is the activation quantization of the CPU kernels (Q8_0 blocks of 32 before each product, as
llama.cpp's ``vec_dot_type``). Its tolerance is derived as tests/test_kernels.py derives the
bound of one product, carried through the network to first order (tests/quant_bound.py).
Tiny random models have small top-2 margins and quantized activations move logits, so those
files are compared by logits over a few teacher-forced steps (a logit within its bound can
change the greedy token only where the reference has a near-tie), not by long token runs.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ggml_blocks  # noqa: E402
import gguf  # noqa: E402
from llm_utils import (  # noqa: E402
    float_tolerance, forced_logits, generate, hf_reference, lazy_pipe)
from quant_bound import activation_bound  # noqa: E402

from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.export.plugins import architecture_of, find_exporter  # noqa: E402
from jaxdist.exporters import layers  # noqa: E402
from jaxdist.exporters.llama import EXPORTER, LlamaConfig, llama_model  # noqa: E402

pytestmark = pytest.mark.reference

ARCHS = ("qwen3", "phi3")
N_NEW = 16
N_FORCED = 3  # teacher-forced decode steps after the prompt in the quantized comparisons
PROMPTS = {"short": [5, 17, 99, 3, 200, 41, 7],
           "long": [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180]}
MAX_SEQ = 64  # = the Phi-3 model's original_max_position_embeddings: longrope's short factors


def _tiny(arch: str) -> Any:
    """A random tiny HF Qwen3 or Phi-3 (see the module docstring), in float32, eager attention."""
    torch.manual_seed(0 if arch == "qwen3" else 1)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  attn_implementation="eager")
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=24, tie_word_embeddings=False, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        rotary = int(16 * 0.75)
        gen = torch.Generator().manual_seed(2)
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": (1 + torch.rand(rotary // 2, generator=gen)).tolist(),
                "long_factor": (4 + 4 * torch.rand(rotary // 2, generator=gen)).tolist(),
                "original_max_position_embeddings": MAX_SEQ}
        config = transformers.Phi3Config(tie_word_embeddings=True, rope_parameters=rope,
                                         max_position_embeddings=4 * MAX_SEQ,
                                         original_max_position_embeddings=MAX_SEQ, **common)
        model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("qwen3_phi3_root")


@pytest.fixture(scope="module")
def hf_models(root: pathlib.Path) -> dict[str, Any]:
    models = {arch: _tiny(arch) for arch in ARCHS}
    for arch, model in models.items():
        model.save_pretrained(root / arch, safe_serialization=True)
    return models


@pytest.fixture(scope="module")
def tiny_pipes(root: pathlib.Path, hf_models: dict[str, Any]) -> Any:
    """``get(arch, stages)``: a tiny HF model's pipeline, shared by tests (compiling dominates)."""
    pipes: dict[tuple[str, int], InProcessPipeline] = {}

    def get(arch: str, stages: int) -> InProcessPipeline:
        if (arch, stages) not in pipes:
            model = llama_model(arch, roots=[root], return_logits=True, max_seq=MAX_SEQ)
            pipes[arch, stages] = lazy_pipe(model, root, stages)
        return pipes[arch, stages]

    yield get
    for pipe in pipes.values():
        pipe.close()


def _check_parity(pipe: InProcessPipeline, hf: Any, prompt: Sequence[int], what: str) -> None:
    want_tokens, want_logits = hf_reference(hf, prompt, N_NEW)
    tokens, logits = generate(pipe, [prompt], N_NEW, bucket=16)
    got = np.stack([lg[0] for lg in logits])
    err, tol = float(np.abs(got - want_logits).max()), float_tolerance(want_logits)
    assert err <= tol, f"{what}: max |logits - transformers| = {err:.3g} > {tol:.3g}"
    assert tokens[0] == want_tokens, f"{what}: greedy tokens differ from transformers.generate"


# ---------------------------------------------------------------------------------------------
# The config, against the numbers transformers derives from it


def test_config_from_hf(hf_models: dict[str, Any], root: pathlib.Path) -> None:
    for arch, hf in hf_models.items():
        cfg = LlamaConfig.from_hf(root / arch)
        rotary = hf.model.rotary_emb
        assert cfg.arch == arch and cfg.head_dim == hf.model.layers[0].self_attn.head_dim
        inv = layers.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta)
        if cfg.rope_short_factor:
            inv = inv / np.asarray(cfg.rope_short_factor, np.float32)
        np.testing.assert_allclose(inv, rotary.inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_attn_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    qwen3, phi3 = (LlamaConfig.from_hf(root / a) for a in ARCHS)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.tied, qwen3.qkv_bias) == (24, True, False, False)
    assert (phi3.rotary_dim, phi3.rope_type, phi3.fused_qkv, phi3.fused_gate_up, phi3.tied) == (
        12, "longrope", True, True, True)
    assert phi3.rope_attn_factor > 1.0, "the test model must really scale its attention"
    for arch in ARCHS:  # what `jaxdist generate --model DIR` looks up
        assert find_exporter(architecture_of(root / arch)).name == EXPORTER.name


# ---------------------------------------------------------------------------------------------
# Parity with transformers, HF files


@pytest.mark.parametrize("stages", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3: slow tier
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_parity(hf_models: dict[str, Any], tiny_pipes: Any, arch: str, stages: int) -> None:
    pipe = tiny_pipes(arch, stages)
    assert [u.name for u in pipe.model.units] == ["embed", "blk.0", "blk.1", "blk.2", "head"]
    assert len(pipe.stages) == stages
    prompt = PROMPTS["short" if stages % 2 else "long"]
    _check_parity(pipe, hf_models[arch], prompt, f"{arch} on {stages} stages")


# ---------------------------------------------------------------------------------------------
# GGUF, written as llama.cpp's converter writes these archs

# GGUF tensor name (per layer: blk.{i}.NAME) -> the HF tensor, per arch.
_GGUF_NAMES = {
    "qwen3": {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
              "ffn_up": "mlp.up_proj"},
    # phi3: qkv_proj is attn_qkv, and gate_up_proj is ffn_up (gate rows, then up rows)
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
_GGUF_COMMON = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_output": "self_attn.o_proj", "ffn_down": "mlp.down_proj"}


def _write_gguf(hf: Any, path: pathlib.Path, arch: str, qtype: str = "F32") -> Any:
    """Write ``hf`` as a GGUF the way convert_hf_to_gguf.py writes ``arch``, its matrices in
    ``qtype`` (norms and RoPE factors stay F32, as llama.cpp keeps 1-D tensors). Returns a copy
    of ``hf`` holding the weights ``gguf.quants`` decodes from the file (``hf`` itself for F32)."""
    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    decoded: dict[str, np.ndarray] = {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    rope = c.rope_parameters
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "qwen3":  # TextModel.set_gguf_parameters: head_dim is in the config
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    else:  # Phi3MiniModel.set_gguf_parameters and generate_extra_tensors
        original = rope["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c.hidden_size)
                                   // c.num_attention_heads)
        w.add_sliding_window(c.sliding_window or 0)
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.asarray(rope[f"{kind}_factor"], np.float32))

    def add(name: str, hf_name: str) -> None:
        t = sd[hf_name]
        if t.ndim == 2 and qtype != "F32":
            blocks = ggml_blocks.quantize(t, qtype)
            w.add_tensor(name, blocks, raw_shape=blocks.shape,
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
            decoded[hf_name] = ggml_blocks.dequantize(blocks, qtype)
        else:
            w.add_tensor(name, t)

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    if not c.tie_word_embeddings:
        add("output.weight", "lm_head.weight")
    for i in range(c.num_hidden_layers):
        for g, h in (_GGUF_COMMON | _GGUF_NAMES[arch]).items():
            add(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight")
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


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_parity(hf_models: dict[str, Any], root: pathlib.Path, arch: str) -> None:
    _write_gguf(hf_models[arch], root / f"{arch}.gguf", arch)
    assert find_exporter(architecture_of(root / f"{arch}.gguf")).name == EXPORTER.name
    cfg = LlamaConfig.from_gguf(f"{arch}.gguf", roots=[root])
    want = LlamaConfig.from_hf(root / arch)
    assert not cfg.rope_interleaved, "llama.cpp runs qwen3 and phi3 in NeoX mode"
    for field in ("head_dim", "rotary_dim", "qk_norm", "fused_qkv", "fused_gate_up", "tied",
                  "rope_original_max_position"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert cfg.rope_attn_factor == pytest.approx(want.rope_attn_factor, rel=1e-6)
    assert cfg.rope_type == want.rope_type and not cfg.rope_short_factor  # bound as a tensor
    model = llama_model(f"{arch}.gguf", roots=[root], return_logits=True, max_seq=MAX_SEQ)
    with lazy_pipe(model, root, 2) as pipe:
        _check_parity(pipe, hf_models[arch], PROMPTS["long"], f"{arch} GGUF")


# The fast tier runs each arch and each type once; the slow tier the other two pairs.
@pytest.mark.parametrize(("arch", "qtype"), [
    ("phi3", "Q4_0"), ("qwen3", "Q8_0"),
    pytest.param("phi3", "Q8_0", marks=pytest.mark.slow),
    pytest.param("qwen3", "Q4_0", marks=pytest.mark.slow)])
def test_gguf_quantized_close(hf_models: dict[str, Any], root: pathlib.Path, arch: str,
                              qtype: str) -> None:
    """Packed Q8_0/Q4_0 matrices (fused ones included) against transformers on the decoded
    weights, within the activation-quantization bound."""
    name = f"{arch}.{qtype}.gguf"
    ref = _write_gguf(hf_models[arch], root / name, arch, qtype)
    prompt = PROMPTS["long"]
    continuation, _ = hf_reference(ref, prompt, N_FORCED)
    tokens = [*prompt, *continuation]
    rows = slice(len(prompt) - 1, len(tokens))
    with torch.no_grad():
        want = ref(torch.tensor([tokens])).logits[0, rows].numpy()
    bound = activation_bound(ref, tokens, rows, qtype) + float_tolerance(want)
    model = llama_model(name, roots=[root], return_logits=True, max_seq=MAX_SEQ)
    packed = {p.uri.rsplit("#", 1)[1]: p.quant for u in model.units for p in u.params.values()
              if p.packed}
    fused = ["blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"] if arch == "phi3" else []
    assert all(packed.get(n) == qtype for n in [*fused, "blk.0.attn_output.weight"]), packed
    with lazy_pipe(model, root, 1) as pipe:
        got = forced_logits(pipe, [tokens[:len(prompt)]], [tokens[len(prompt):]])[:, 0]
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{arch} {qtype}: |logits - transformers| {err[worst]:.3g} "
                                  f"over the bound {bound[worst]:.3g} at (step, token) {worst}")


# ---------------------------------------------------------------------------------------------
# Refusals, each named with what is supported


def _variant(root: pathlib.Path, arch: str, name: str, **changes: Any) -> str:
    """A copy of the saved ``arch`` checkpoint's directory whose config.json has ``changes``."""
    config = json.loads((root / arch / "config.json").read_text())
    config.update(changes)
    out = root / name
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    for f in (root / arch).glob("*.safetensors"):
        (out / f.name).write_bytes(f.read_bytes())
    return name


def test_error_qwen3_sliding_window(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    path = _variant(root, "qwen3", "qwen3_swa", use_sliding_window=True, sliding_window=32)
    with pytest.raises(SpecError, match=r"\(Qwen3ForCausalLM\): use_sliding_window=true "
                                        r"\(sliding-window attention .*supported: false\)"):
        llama_model(path, roots=[root], max_seq=MAX_SEQ)


def test_error_phi3_rope_type(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    rope = json.loads((root / "phi3" / "config.json").read_text())["rope_parameters"]
    path = _variant(root, "phi3", "phi3_dynamic", rope_parameters=rope | {"rope_type": "dynamic"})
    with pytest.raises(SpecError, match=r"RoPE scaling type 'dynamic' \(supported for "
                                        r"Phi3ForCausalLM: default, longrope, su\)"):
        llama_model(path, roots=[root], max_seq=MAX_SEQ)


def test_error_longrope_past_original(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    _write_gguf(hf_models["phi3"], root / "phi3_long.gguf", "phi3")
    for path in ("phi3", "phi3_long.gguf"):
        with pytest.raises(SpecError, match=rf"longrope RoPE past original_max_position_embeddings"
                                            rf" \({MAX_SEQ}\) switches to its long factors.*pass "
                                            rf"max_seq <= {MAX_SEQ}"):
            llama_model(path, roots=[root], max_seq=MAX_SEQ + 1)


def test_error_longrope_factor_length(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    rope = json.loads((root / "phi3" / "config.json").read_text())["rope_parameters"]
    path = _variant(root, "phi3", "phi3_bad_factors",
                    rope_parameters=rope | {"short_factor": rope["short_factor"][:-1]})
    with pytest.raises(SpecError, match=r"rope_scaling.short_factor must be a list of 6 numbers "
                                        r"\(half the 12 rotated dims\), found \["):
        llama_model(path, roots=[root], max_seq=MAX_SEQ)


def test_error_gguf_partial_rope_outside_phi3(tmp_path: pathlib.Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "partial.gguf"), "qwen3")
    for add, value in ((w.add_embedding_length, 64), (w.add_head_count, 4),
                       (w.add_key_length, 24), (w.add_rope_dimension_count, 16)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecError, match=r"partial RoPE \(rope.dimension_count 16, head_dim 24\) "
                                        r"is not supported for qwen3; expected 24 \(phi3: an even "
                                        r"count below it\)"):
        LlamaConfig.from_gguf("partial.gguf", roots=[tmp_path])

