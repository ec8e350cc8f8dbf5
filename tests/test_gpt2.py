"""Parity of the GPT-2 exporter with transformers: random tiny HF GPT-2, and the same as GGUF.

Every expected value comes from transformers: its forward pass (logits) and ``generate`` (greedy
tokens). The GGUF file is written from the HF weights the way llama.cpp's converter writes arch
``gpt2`` (Conv1D matrices transposed to ``(out, in)``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import gguf  # noqa: E402
from llm_utils import generate  # noqa: E402

from jaxdist.coordinator.generation import Generator, SamplingParams  # noqa: E402
from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.exporters.gpt2 import EXPORTER, GPT2Config, gpt2_model  # noqa: E402

pytestmark = pytest.mark.reference

N_NEW = 16
PROMPTS = [[5, 17, 99, 3, 200, 41, 7], [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("gpt2_root")


@pytest.fixture(scope="module")
def hf(root: pathlib.Path) -> Any:
    """A random tiny GPT-2; weights scaled up (peaked logits, no greedy ties) and the biases and
    LayerNorm parameters randomised (they are zeros and ones at init, which would hide bugs)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256,
                                     n_positions=128, initializer_range=0.1,
                                     bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(root / "gpt2", safe_serialization=True)
    return model


def _hf_reference(model: Any, prompt: Sequence[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens from ``generate`` and the logits predicting each of them."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=n_new, min_new_tokens=0,
                             pad_token_id=0, eos_token_id=None)
        new = out[0, len(prompt):].tolist()
        full = model(out[:, :-1]).logits[0].numpy()
    return new, full[len(prompt) - 1:]


def _pipe(model: Any, root: pathlib.Path, stages: int) -> InProcessPipeline:
    # Compile only the shapes a test uses: the ahead-of-time buckets would triple the load time.
    return InProcessPipeline(dataclasses.replace(model, buckets=()), weights_roots=[str(root)],
                             stages=stages)


def _assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    tol = 1e-4 * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{what}: max |logits - transformers| = {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("stages", [1, 2, pytest.param(3, marks=pytest.mark.slow)])  # 3: slow tier
def test_hf_parity(hf: Any, root: pathlib.Path, stages: int) -> None:
    model = gpt2_model("gpt2", roots=[root], return_logits=True, max_seq=64)
    assert [u.name for u in model.units] == ["embed", "blk.0", "blk.1", "blk.2", "blk.3", "head"]
    assert not any(p.transpose for p in model.units[1].params.values()), "HF Conv1D is (in, out)"
    prompt = PROMPTS[stages % 2]
    want_tokens, want_logits = _hf_reference(hf, prompt, N_NEW)
    with _pipe(model, root, stages) as pipe:
        assert len(pipe.stages) == stages
        tokens, logits = generate(pipe, [prompt], N_NEW, bucket=16)
    what = f"gpt2 on {stages} stages"
    assert tokens[0] == want_tokens, f"{what}: greedy tokens differ from transformers.generate"
    _assert_logits_close(np.stack([lg[0] for lg in logits]), want_logits, what)


def test_generator_batch(hf: Any, root: pathlib.Path) -> None:
    """The generation engine drives the exporter's step contract: two prompts batched."""
    model = gpt2_model("gpt2", roots=[root], max_seq=64, max_slots=2, prefill_buckets=(16,))
    with _pipe(model, root, 1) as pipe:
        gen = Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                        max_slots=2, max_seq=64, prefill_buckets=model.meta["prefill_buckets"])
        results = gen.run(PROMPTS, SamplingParams(max_tokens=8))
    for prompt, result in zip(PROMPTS, results):
        assert result.tokens == _hf_reference(hf, prompt, 8)[0]


def _write_gguf(hf: Any, path: pathlib.Path) -> None:
    """Write the HF model as an f32 GGUF the way llama.cpp's convert_hf_to_gguf.py does (arch
    gpt2), with the optional output.weight copy of the embedding older converters wrote."""
    c = hf.config
    sd = {k.removeprefix("transformer."): v.detach().numpy().astype(np.float32)
          for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(c.n_layer)
    w.add_context_length(c.n_positions)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(4 * c.n_embd)
    w.add_head_count(c.n_head)
    w.add_layer_norm_eps(float(c.layer_norm_epsilon))
    w.add_tensor("token_embd.weight", sd["wte.weight"])
    w.add_tensor("position_embd.weight", sd["wpe.weight"])
    w.add_tensor("output_norm.weight", sd["ln_f.weight"])
    w.add_tensor("output_norm.bias", sd["ln_f.bias"])
    w.add_tensor("output.weight", sd["wte.weight"])
    names = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
             "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
    for i in range(c.n_layer):
        for g, h in names.items():
            weight = sd[f"h.{i}.{h}.weight"]
            w.add_tensor(f"blk.{i}.{g}.weight", weight if g.endswith("norm") else weight.T.copy())
            w.add_tensor(f"blk.{i}.{g}.bias", sd[f"h.{i}.{h}.bias"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_parity(hf: Any, root: pathlib.Path) -> None:
    _write_gguf(hf, root / "gpt2.gguf")
    cfg = GPT2Config.from_gguf("gpt2.gguf", roots=[root])
    want = GPT2Config.from_hf(root / "gpt2")
    assert cfg.ln_eps == pytest.approx(want.ln_eps)  # GGUF stores it as float32
    assert cfg == dataclasses.replace(want, ln_eps=cfg.ln_eps, bos_id=None, eos_ids=())
    model = gpt2_model("gpt2.gguf", roots=[root], return_logits=True, max_seq=64)
    assert model.units[1].params["w_qkv"].transpose, "GGUF matrices are (out, in)"
    prompt = PROMPTS[1]
    want_tokens, want_logits = _hf_reference(hf, prompt, 4)
    with _pipe(model, root, 2) as pipe:
        tokens, logits = generate(pipe, [prompt], 4, bucket=16)
    assert tokens[0] == want_tokens
    _assert_logits_close(np.stack([lg[0] for lg in logits]), want_logits, "gpt2 GGUF")
    loaded = EXPORTER.load("gpt2.gguf", roots=[str(root)], max_seq=32)
    assert (loaded.architecture, loaded.tokenizer) == ("gpt2", None)  # no tokenizer.ggml keys


def test_exporter_load(hf: Any, root: pathlib.Path) -> None:
    loaded = EXPORTER.load("gpt2", roots=[str(root)], max_seq=32, max_slots=2)
    assert {"gpt2", "GPT2LMHeadModel"} <= EXPORTER.architectures and EXPORTER.name == "gpt2"
    assert (loaded.kind, loaded.architecture, loaded.tokenizer) == (
        "causal-lm", "GPT2LMHeadModel", None)  # the tiny model ships no tokenizer.json
    assert dict(loaded.options) == {"max_slots": 2, "max_seq": 32, "prefill_buckets": (16,),
                                    "prefill_rows": 2, "eos_ids": ()}


# ---------------------------------------------------------------------------------------------
# Errors


def test_error_max_seq_beyond_positions(hf: Any, root: pathlib.Path) -> None:
    with pytest.raises(SpecError, match=r"max_seq 256 exceeds the 128 learned positions of "
                                        r"'gpt2'; pass max_seq <= 128"):
        gpt2_model("gpt2", roots=[root], max_seq=256)


def test_error_unsupported_architecture(tmp_path: pathlib.Path) -> None:
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(SpecError, match=r"architectures \['LlamaForCausalLM'\] are not "
                                        r"supported by the gpt2 exporter"):
        gpt2_model("llama", roots=[tmp_path])


def test_error_unsupported_option(hf: Any, root: pathlib.Path, tmp_path: pathlib.Path) -> None:
    config = json.loads((root / "gpt2" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {
        "scale_attn_by_inverse_layer_idx": True}))
    with pytest.raises(SpecError, match=r"\['scale_attn_by_inverse_layer_idx=True'\] not "
                                        r"supported by the gpt2 exporter"):
        GPT2Config.from_hf(tmp_path)
