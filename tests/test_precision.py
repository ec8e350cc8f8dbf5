"""Float32 means float32 on every platform: every product of a float32 artifact is pinned.

A ``dot_general`` without a precision config runs at the platform's default, TF32 on NVIDIA
GPUs and one bf16 pass on TPUs, so an unpinned float32 stage is only float32 on a CPU. These
tests read the StableHLO of real exported stages of every family, dense and quantized, lowered
for cpu, cuda and tpu, and check each product. (The GPU's arithmetic itself cannot be checked
here: no accelerator on these machines.)
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax import export as jexport  # noqa: E402
from models import mlp, save_tiny_llama  # noqa: E402

from jaxdist.core.artifacts import export_stage  # noqa: E402
from jaxdist.core.errors import ArtifactError  # noqa: E402
from jaxdist.export.model import Model  # noqa: E402
from jaxdist.export.stages import build_stage_specs  # noqa: E402
from jaxdist.exporters.bert import bert_model  # noqa: E402
from jaxdist.exporters.gemma3 import gemma3_model  # noqa: E402
from jaxdist.exporters.gpt2 import gpt2_model  # noqa: E402
from jaxdist.exporters.llama import llama_model  # noqa: E402

PLATFORMS = ("cpu", "cuda", "tpu")
_DOT = re.compile(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)")


def _products(model: Model, *, stages: int = 2) -> list[tuple[str, str, str]]:
    """(stage, operand types, line) of every product in the model's stages."""
    n = len(model.units)
    cut = max(1, n // stages)
    ranges = [range(0, cut), range(cut, n)] if stages > 1 and n > 1 else [range(n)]
    found = []
    for built in build_stage_specs(model, ranges, platforms=PLATFORMS):
        text = jexport.deserialize(bytearray(built.artifact.data)).mlir_module()
        for line in text.splitlines():
            m = _DOT.search(line)
            if m:
                found.append((f"stage {built.spec.stage_index}", f"{m[1]} x {m[2]}", line))
    return found


def _assert_pinned(model: Model, what: str) -> None:
    products = _products(model)
    f32 = [p for p in products if "xf32>" in p[1]]
    assert f32, f"{what}: found no float32 products to check (the pattern is stale?)"
    loose = [p for p in f32 if "precision = [HIGHEST, HIGHEST]" not in p[2]]
    assert not loose, (f"{what}: {len(loose)} of {len(f32)} float32 products are not pinned, "
                       f"first in {loose[0][0]}: {loose[0][2].strip()[:300]}")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("precision")
    save_tiny_llama(root / "llama", layers=2)
    torch.manual_seed(0)
    small = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **small)
                                  ).save_pretrained(root / "qwen2", safe_serialization=True)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=24, **small)
                                  ).save_pretrained(root / "qwen3", safe_serialization=True)
    transformers.Phi3ForCausalLM(transformers.Phi3Config(**small)
                                 ).save_pretrained(root / "phi3", safe_serialization=True)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        head_dim=16, sliding_window=8, **small)
    ).save_pretrained(root / "gemma3", safe_serialization=True)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    ).save_pretrained(root / "gpt2", safe_serialization=True)
    transformers.BertModel(transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64)
    ).save_pretrained(root / "bert", safe_serialization=True)
    return root


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_llama_family_float32_products_are_pinned(root: pathlib.Path, arch: str) -> None:
    model = llama_model(root / arch, roots=[root], max_seq=64, prefill_buckets=(16,))
    _assert_pinned(model, f"{arch} float32")


def test_gemma3_float32_products_are_pinned(root: pathlib.Path) -> None:
    _assert_pinned(gemma3_model(root / "gemma3", roots=[root], max_seq=64, prefill_buckets=(16,)),
                   "gemma3 float32")


def test_gpt2_float32_products_are_pinned(root: pathlib.Path) -> None:
    _assert_pinned(gpt2_model(root / "gpt2", roots=[root], max_seq=64, prefill_buckets=(16,)),
                   "gpt2 float32")


def test_bert_float32_products_are_pinned(root: pathlib.Path) -> None:
    _assert_pinned(bert_model(root / "bert", roots=[root], buckets=(16,)), "bert float32")


def test_quantized_gguf_products_are_pinned(smollm2: pathlib.Path) -> None:
    """SmolLM2's Q4_1 GGUF: on the CPU its products are kernels (custom calls); the portable
    branch every other platform runs dequantizes and multiplies in float32, pinned."""
    model = llama_model(smollm2.name, roots=[smollm2.parent], max_seq=64, prefill_buckets=(16,))
    model = Model(model.name, [model.units[0], *model.units[1:3], model.units[-1]],
                  inputs=model.inputs, control=model.control, buckets=model.buckets,
                  constraints=model.constraints)
    products = _products(model)
    assert any("xui8>" in p[1] or "xf32>" in p[1] for p in products)
    _assert_pinned(model, "SmolLM2 Q4_1")


def test_user_model_float32_products_are_pinned() -> None:
    _assert_pinned(mlp(n_layers=2), "a user's float32 MLP")


def test_half_precision_keeps_fast_products(root: pathlib.Path) -> None:
    """A bfloat16 stage keeps the platform's fast products: none is pinned to HIGHEST."""
    model = llama_model(root / "llama", roots=[root], max_seq=64, prefill_buckets=(16,),
                        dtype="bfloat16")
    products = _products(model)
    half = [p for p in products if "xbf16>" in p[1]]
    assert half, "no bfloat16 products found"
    pinned = [p for p in products if "HIGHEST" in p[2]]
    assert not pinned, f"bfloat16 stage has pinned products: {pinned[0][2].strip()[:300]}"


def test_precision_override_and_bad_value() -> None:
    def fn(p: dict[str, Any], s: dict[str, Any], x: dict[str, Any]) -> Any:
        return {"y": x["x"] @ p["w"]}, {}

    spec = dict(params={"w": ((4, 4), "float32")}, inputs={"x": ("b, 4", "float32")},
                platforms=("cpu", "cuda"))
    loose = export_stage(fn, matmul_precision="default", **spec)
    text = jexport.deserialize(bytearray(loose.data)).mlir_module()
    assert "dot_general" in text and "HIGHEST" not in text
    pinned = export_stage(fn, **spec)
    assert pinned.digest != loose.digest
    assert "precision = [HIGHEST, HIGHEST]" in jexport.deserialize(
        bytearray(pinned.data)).mlir_module()
    with pytest.raises(ArtifactError, match="matmul_precision 'tf32'.*auto"):
        export_stage(fn, matmul_precision="tf32", **spec)
