"""Mixture-of-Experts (Mixtral, Qwen3-MoE) through the llama exporter: HF, GGUF F32, Q8_0, Q4_0.

Tiny random models are built here from transformers configs (8 experts; Mixtral routes each
token to 2, Qwen3-MoE to 3), every RMSNorm weight drawn at random so a norm in the wrong place
shows.

* HF checkpoints and F32 GGUF files (written here as llama.cpp's ``convert_hf_to_gguf.py``
  writes them: Mixtral as arch ``llama`` with its q/k rows permuted and its experts stacked in
  ``ffn_{gate,up,down}_exps``, Qwen3-MoE as ``qwen3moe``) match transformers' logits and greedy
  tokens, on 1, 2 (and 3, slow) stages.
* Q8_0 and Q4_0 files keep their experts packed; the CPU kernel (``jaxdist_ggml_moe_matmul_v1``)
  multiplies only the chosen experts' blocks. The reference is the same exported function with
  each expert product computed by the dense quantized kernel instead (``quant_matmul`` on every
  expert's matrix, then the chosen ones picked): the activations are quantized the same way,
  so the logits agree to float32 rounding. tests/test_moe_kernel.py checks the MoE kernel
  against gguf.quants' blocks, and the slow tier checks the quantized files against llama.cpp.
* Batches route each row on its own: several prompts at once (rows choosing different experts)
  and a prompt of one repeated token (every row and step choosing the same experts in each
  layer: identical hidden states).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ggml_blocks  # noqa: E402
import gguf  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from llamacpp_ref import NEAR_TIE, llamacpp  # noqa: E402
from llm_utils import (  # noqa: E402
    float_tolerance, forced_logits, generate, hf_reference, lazy_pipe)

from jaxdist.coordinator.inprocess import InProcessPipeline  # noqa: E402
from jaxdist.core import kernels  # noqa: E402
from jaxdist.core.errors import SpecError  # noqa: E402
from jaxdist.core.kernels import ops  # noqa: E402
from jaxdist.export.plugins import architecture_of, find_exporter  # noqa: E402
from jaxdist.exporters.llama import EXPORTER, LlamaConfig, llama_model  # noqa: E402

pytestmark = pytest.mark.reference

ARCHS = ("mixtral", "qwen3moe")
N_NEW = 12
MAX_SEQ = 64
PROMPTS = {"short": [5, 17, 99, 3, 200, 41, 7],
           "long": [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180]}
SAME = [7] * 9  # one token repeated: every row picks the same experts in each layer
FED = [[1, 2, 3], [2, 3, 4], [3, 4, 5]]  # teacher-forced tokens after each prompt of a batch


def _tiny(arch: str, **overrides: Any) -> Any:
    torch.manual_seed(3 if arch == "mixtral" else 4)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.1, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, attn_implementation="eager",
                  tie_word_embeddings=False)
    if arch == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=96, num_local_experts=8,
                                            num_experts_per_tok=2, **common | overrides)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=64,
                                             num_experts=8, num_experts_per_tok=3, head_dim=24,
                                             **common | {"norm_topk_prob": True} | overrides)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("moe_root")


@pytest.fixture(scope="module")
def hf_models(root: pathlib.Path) -> dict[str, Any]:
    models = {arch: _tiny(arch) for arch in ARCHS}
    for arch, model in models.items():
        model.save_pretrained(root / arch, safe_serialization=True)
    return models


def _check_parity(pipe: InProcessPipeline, hf: Any, prompts: Sequence[Sequence[int]],
                  what: str) -> None:
    """Each prompt's greedy run against transformers, all of them in one batch."""
    tokens, logits = generate(pipe, prompts, N_NEW, bucket=16)
    for row, prompt in enumerate(prompts):
        want_tokens, want_logits = hf_reference(hf, prompt, N_NEW)
        got = np.stack([lg[row] for lg in logits])
        err, tol = float(np.abs(got - want_logits).max()), float_tolerance(want_logits)
        assert err <= tol, f"{what}, row {row}: max |logits - transformers| = {err:.3g} > {tol:.3g}"
        assert tokens[row] == want_tokens, f"{what}, row {row}: greedy tokens differ"


def _routes(hf: Any, prompt: Sequence[int]) -> list[np.ndarray]:
    """The experts transformers' router picks for each token of ``prompt``, per layer."""
    picks: list[np.ndarray] = []
    n = hf.config.num_experts_per_tok

    def hook(_mod: Any, _inp: Any, out: Any) -> None:
        logits = out[0] if isinstance(out, tuple) else out
        picks.append(torch.topk(logits.float(), n, dim=-1).indices.sort(-1).values.numpy())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor([list(prompt)]))
    finally:
        for h in handles:
            h.remove()
    return picks


# ---------------------------------------------------------------------------------------------
# Config and routing cases


def test_config_from_hf(hf_models: dict[str, Any], root: pathlib.Path) -> None:
    mixtral, qwen = (LlamaConfig.from_hf(root / a) for a in ARCHS)
    assert (mixtral.arch, mixtral.n_experts, mixtral.n_experts_used, mixtral.ffn_dim,
            mixtral.expert_norm_topk) == ("llama", 8, 2, 96, True)
    assert (qwen.arch, qwen.n_experts, qwen.n_experts_used, qwen.ffn_dim, qwen.qk_norm,
            qwen.head_dim) == ("qwen3moe", 8, 3, 64, True, 24)
    for arch in ARCHS:  # what `jaxdist generate --model DIR` looks up
        assert find_exporter(architecture_of(root / arch)).name == EXPORTER.name


def test_prompts_cover_both_routing_cases(hf_models: dict[str, Any]) -> None:
    """The batch tests' premise, checked on transformers' own router: the prompts' tokens pick
    different experts, and the repeated token the same experts on every row of a layer."""
    for hf in hf_models.values():
        for picks in _routes(hf, PROMPTS["long"]):  # (tokens, n_used) per layer
            assert len({tuple(p) for p in picks.reshape(-1, picks.shape[-1])}) > 1
        for picks in _routes(hf, SAME):
            assert len({tuple(p) for p in picks.reshape(-1, picks.shape[-1])}) == 1


# ---------------------------------------------------------------------------------------------
# Parity with transformers: HF files


@pytest.fixture(scope="module")
def tiny_pipes(root: pathlib.Path, hf_models: dict[str, Any]) -> Any:
    pipes: dict[tuple[str, int], InProcessPipeline] = {}

    def get(arch: str, stages: int) -> InProcessPipeline:
        if (arch, stages) not in pipes:
            model = llama_model(arch, roots=[root], return_logits=True, max_seq=MAX_SEQ)
            pipes[arch, stages] = lazy_pipe(model, root, stages)
        return pipes[arch, stages]

    yield get
    for pipe in pipes.values():
        pipe.close()


# The fast tier runs Qwen3-MoE's checkpoint on 2 stages (the same block on both sides of a
# split); Mixtral's experts reach transformers there through its F32 GGUF. The rest is slow.
@pytest.mark.parametrize(("arch", "stages"), [
    ("qwen3moe", 2), *[pytest.param(a, n, marks=pytest.mark.slow)
                       for a, n in (("qwen3moe", 1), ("qwen3moe", 3), ("mixtral", 1),
                                    ("mixtral", 2), ("mixtral", 3))]])
def test_hf_parity(hf_models: dict[str, Any], tiny_pipes: Any, arch: str, stages: int) -> None:
    pipe = tiny_pipes(arch, stages)
    assert len(pipe.stages) == stages
    prompts = [PROMPTS["short"], SAME] if stages != 3 else [PROMPTS["long"], PROMPTS["short"]]
    _check_parity(pipe, hf_models[arch], prompts, f"{arch} on {stages} stages")


@pytest.mark.slow  # 20 s of compiling a third model; the fast tier renormalizes (Mixtral's rule)
def test_hf_qwen3moe_without_renormalization(root: pathlib.Path) -> None:
    """norm_topk_prob=false: the chosen experts keep their softmax weights (Qwen3-MoE only)."""
    hf = _tiny("qwen3moe", norm_topk_prob=False)
    hf.save_pretrained(root / "qwen3moe_raw", safe_serialization=True)
    model = llama_model("qwen3moe_raw", roots=[root], return_logits=True, max_seq=MAX_SEQ)
    assert not model.meta["config"].expert_norm_topk
    with lazy_pipe(model, root, 1) as pipe:
        _check_parity(pipe, hf, [PROMPTS["short"]], "qwen3moe, norm_topk_prob=false")


# ---------------------------------------------------------------------------------------------
# GGUF, written as llama.cpp's converter writes these archs


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the q/k rows of arch llama."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _experts(sd: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s stacked experts (E, out, in) by GGUF name. transformers 5 holds both
    families' experts fused in memory: ``mlp.experts.gate_up_proj`` (E, 2f, d), gate rows
    first, and ``mlp.experts.down_proj`` (E, d, f)."""
    gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    f = gate_up.shape[1] // 2
    return {"ffn_gate_exps": gate_up[:, :f], "ffn_up_exps": gate_up[:, f:],
            "ffn_down_exps": sd[f"model.layers.{layer}.mlp.experts.down_proj"]}


def _write_gguf(hf: Any, path: pathlib.Path, arch: str, qtype: str = "F32") -> None:
    """Write ``hf`` as llama.cpp's converter writes it: matrices, experts included, in
    ``qtype`` (blocks from gguf.quants / ggml), norms and the router F32."""
    c = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    gguf_arch = "llama" if arch == "mixtral" else "qwen3moe"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    n_experts = c.num_local_experts
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_tokenizer_model("none")  # token ids only: llama.cpp then reads the vocabulary size
    w.add_vocab_size(c.vocab_size)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    def add(name: str, t: np.ndarray, quantize: bool = True) -> None:
        if quantize and t.ndim >= 2 and qtype != "F32":
            t = np.ascontiguousarray(t)
            blocks = ggml_blocks.quantize(t.reshape(-1, t.shape[-1]), qtype)
            blocks = blocks.reshape(*t.shape[:-1], blocks.shape[-1])
            w.add_tensor(name, blocks, raw_shape=blocks.shape,
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, np.ascontiguousarray(t))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}"
        q, k = sd[f"{pre}.self_attn.q_proj.weight"], sd[f"{pre}.self_attn.k_proj.weight"]
        if gguf_arch == "llama":
            q, k = _permute(q, c.num_attention_heads), _permute(k, c.num_key_value_heads)
        add(f"blk.{i}.attn_q.weight", q)
        add(f"blk.{i}.attn_k.weight", k)
        for g, h in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj")):
            add(f"blk.{i}.{g}.weight", sd[f"{pre}.{h}.weight"])
        for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                     ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")):
            if f"{pre}.{h}.weight" in sd:
                add(f"blk.{i}.{g}.weight", sd[f"{pre}.{h}.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", sd[f"{pre}.mlp.gate.weight"], quantize=False)
        for g, t in _experts(sd, i).items():
            assert t.shape[0] == n_experts
            add(f"blk.{i}.{g}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_files(root: pathlib.Path, hf_models: dict[str, Any]) -> dict[tuple[str, str], str]:
    files = {}
    for arch, hf in hf_models.items():
        for qtype in ("F32", "Q8_0", "Q4_0"):
            name = f"{arch}-{qtype}.gguf"
            _write_gguf(hf, root / name, arch, qtype)
            files[arch, qtype] = name
    return files


# Qwen3-MoE's F32 file in the slow tier: Mixtral's checks the stacked experts (and its permuted
# q/k), and the fast quantized tests read Qwen3-MoE's GGUF layout.
@pytest.mark.parametrize("arch", ["mixtral", pytest.param("qwen3moe", marks=pytest.mark.slow)])
def test_gguf_f32_parity(hf_models: dict[str, Any], root: pathlib.Path,
                         gguf_files: dict[tuple[str, str], str], arch: str) -> None:
    name = gguf_files[arch, "F32"]
    assert find_exporter(architecture_of(root / name)).name == EXPORTER.name
    cfg, want = LlamaConfig.from_gguf(name, roots=[root]), LlamaConfig.from_hf(root / arch)
    for field in ("arch", "n_experts", "n_experts_used", "ffn_dim", "head_dim", "qk_norm",
                  "expert_norm_topk"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert cfg.rope_interleaved == (arch == "mixtral"), "llama.cpp permutes arch llama's q/k"
    model = llama_model(name, roots=[root], return_logits=True, max_seq=MAX_SEQ)
    with lazy_pipe(model, root, 2) as pipe:
        _check_parity(pipe, hf_models[arch], [PROMPTS["long"], SAME], f"{arch} GGUF F32")


# ---------------------------------------------------------------------------------------------
# Quantized experts, packed


def _dense_kernel_experts(x: Any, w: Any, ids: Any, rows: Any = None) -> Any:
    """The reference for ``ops.expert_linear`` on packed experts: every expert's product by the
    dense quantized kernel (``quant_matmul``), then each (token, slot) takes its expert's."""
    if not isinstance(w, ops.QTensor):
        return _original_expert_linear(x, w, ids, rows)
    slots = ids.shape[1]
    xr = x if x.ndim == 3 else jnp.broadcast_to(x[:, None, :], (x.shape[0], slots, x.shape[1]))
    ys = jnp.stack([ops.quant_matmul(xr, w.blocks[e], w.qtype)
                    for e in range(w.blocks.shape[0])], axis=0)       # (E, T, S, N)
    onehot = (ids[None] == jnp.arange(w.blocks.shape[0])[:, None, None]).astype(jnp.float32)
    return jnp.einsum("ets,etsn->tsn", onehot, ys)


_original_expert_linear = ops.expert_linear


# The fast tier runs Mixtral's Q4_0 file; Qwen3-MoE's Q4_0 experts run there on 2 workers
# (test_gguf_quantized_on_workers), and Q8_0 is the same kernel path with another block type.
@pytest.mark.parametrize(("arch", "qtype"), [
    ("mixtral", "Q4_0"), *[pytest.param(a, q, marks=pytest.mark.slow)
                           for a, q in (("mixtral", "Q8_0"), ("qwen3moe", "Q8_0"),
                                        ("qwen3moe", "Q4_0"))]])
def test_gguf_quantized_experts_packed(root: pathlib.Path, gguf_files: dict[tuple[str, str], str],
                                       monkeypatch: pytest.MonkeyPatch, arch: str,
                                       qtype: str) -> None:
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    name = gguf_files[arch, qtype]
    model = llama_model(name, roots=[root], return_logits=True, max_seq=MAX_SEQ)
    params = model.units[1].params
    for p in ("x_gate", "x_up", "x_down"):
        assert params[p].packed and params[p].quant == qtype and len(params[p].shape) == 3
    prompts = [PROMPTS["long"], PROMPTS["short"], SAME]
    with lazy_pipe(model, root, 2) as pipe:
        got = forced_logits(pipe, prompts, FED)
    monkeypatch.setattr(ops, "expert_linear", _dense_kernel_experts)
    with lazy_pipe(model, root, 2) as pipe:
        want = forced_logits(pipe, prompts, FED)
    err, tol = float(np.abs(got - want).max()), float_tolerance(want)
    assert err <= tol, f"{arch} {qtype}: max |MoE kernel - dense kernel| = {err:.3g} > {tol:.3g}"


def test_gguf_quantized_bound_bytes(root: pathlib.Path,
                                    gguf_files: dict[tuple[str, str], str]) -> None:
    """Packed experts bind the file's bytes: bound bytes <= 1.1x the file's tensor bytes, and
    no fewer (the units' weight bytes, which partitioning balances, count every expert)."""
    for arch in ARCHS:
        name = gguf_files[arch, "Q4_0"]
        model = llama_model(name, roots=[root], max_seq=MAX_SEQ)
        reader = gguf.GGUFReader(str(root / name))
        file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
        assert 0.95 * file_bytes <= model.weight_bytes <= 1.1 * file_bytes, (
            model.weight_bytes, file_bytes)


# ---------------------------------------------------------------------------------------------
# Refused, by name


def _meta_gguf(path: pathlib.Path, arch: str, tensors: dict[str, np.ndarray], **keys: Any) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    for k, v in keys.items():
        getattr(w, f"add_{k}")(v)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_error_gguf_experts_one_tensor_each(tmp_path: pathlib.Path) -> None:
    """llama.cpp's layout before 2024 (blk.N.ffn_gate.E.weight) is refused with the fix."""
    z = np.zeros((64, 32), np.float32)
    _meta_gguf(tmp_path / "old.gguf", "llama",
               {"token_embd.weight": np.zeros((16, 32), np.float32),
                "blk.0.ffn_gate.0.weight": z}, expert_count=4, expert_used_count=2)
    with pytest.raises(SpecError, match=r"ffn_gate_exps.*one tensor per expert.*convert"):
        LlamaConfig.from_gguf("old.gguf", roots=[tmp_path])


def test_error_hf_qwen3moe_dense_layers(root: pathlib.Path, hf_models: dict[str, Any]) -> None:
    import json  # noqa: PLC0415

    cfg = json.loads((root / "qwen3moe" / "config.json").read_text())
    for change, key in (({"mlp_only_layers": [1]}, "mlp_only_layers"),
                        ({"decoder_sparse_step": 2}, "decoder_sparse_step")):
        d = root / f"qwen3moe_{key}"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg | change))
        with pytest.raises(SpecError, match=rf"dense layers among the MoE layers.*{key}"):
            LlamaConfig.from_hf(d)


def test_error_more_experts_used_than_exist(root: pathlib.Path,
                                            hf_models: dict[str, Any]) -> None:
    import json  # noqa: PLC0415

    cfg = json.loads((root / "mixtral" / "config.json").read_text())
    d = root / "mixtral_topk"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg | {"num_experts_per_tok": 9}))
    with pytest.raises(SpecError, match=r"8 experts, of which each token uses 9"):
        llama_model("mixtral_topk", roots=[root])


@pytest.mark.slow  # llama.cpp's bindings: make test-slow builds them (bench/llamacpp.py)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_quantized_matches_llamacpp(root: pathlib.Path,
                                         gguf_files: dict[tuple[str, str], str], arch: str,
                                         qtype: str) -> None:
    """The same file in llama.cpp (its own MoE graph, ``mul_mat_id``, and its quantized
    arithmetic): teacher-forced logits along llama.cpp's own greedy run, all positions within
    NEAR_TIE (one activation rounded to the other 8-bit neighbour moves a logit by about a
    tenth), and the same greedy token wherever llama.cpp's top-2 margin is not a near-tie."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    name = gguf_files[arch, qtype]
    prompts = [PROMPTS["long"], SAME]
    greedy = llamacpp(model=str(root / name), prompts=prompts, n_new=N_NEW, n_ctx=MAX_SEQ,
                      text=False)
    fed = [g["tokens"] for g in greedy["greedy"]]
    model = llama_model(name, roots=[root], return_logits=True, max_seq=MAX_SEQ)
    with lazy_pipe(model, root, 2) as pipe:
        got = forced_logits(pipe, prompts, [f[:N_NEW - 1] for f in fed])
    for row, g in enumerate(greedy["greedy"]):
        z = got[:, row]
        err = float(np.abs(z - np.asarray(
            llamacpp_logits(root / name, prompts[row], fed[row][:-1]))).max())
        assert err <= NEAR_TIE, f"{arch} {qtype} row {row}: max |logits - llama.cpp| = {err:.3g}"
        for step, (token, margin) in enumerate(zip(g["tokens"], g["margins"])):
            if margin >= NEAR_TIE:
                assert int(np.argmax(z[step])) == token, f"{arch} {qtype} row {row} step {step}"


def llamacpp_logits(path: pathlib.Path, prompt: Sequence[int], fed: Sequence[int]
                    ) -> list[list[float]]:
    """llama.cpp's logits after ``prompt`` and after each token of ``fed`` in turn."""
    (logits,) = llamacpp(model=str(path), forced=[list(prompt) + list(fed)],
                         n_prompt=len(prompt), n_ctx=MAX_SEQ)["logits"]
    return logits


def test_gguf_quantized_on_workers(root: pathlib.Path,
                                   gguf_files: dict[tuple[str, str], str]) -> None:
    """Q4_0 experts packed, split across 2 real worker processes: the same greedy tokens and
    logits as the same stages in this process (the same kernels, the same arithmetic)."""
    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415

    name = gguf_files["qwen3moe", "Q4_0"]
    model = dataclasses.replace(llama_model(name, roots=[root], return_logits=True,
                                            max_seq=MAX_SEQ), buckets=())
    prompts = [PROMPTS["long"], SAME]
    with lazy_pipe(model, root, 2) as pipe:
        want_tokens, want_logits = generate(pipe, prompts, N_NEW, bucket=16)
    with Cluster.local(2, weights_roots=[str(root)]) as cluster:
        with cluster.deploy(model, stages=2) as pipe:
            tokens, logits = generate(pipe, prompts, N_NEW, bucket=16)
            memory = pipe.stage_memory()
    assert tokens == want_tokens
    np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), rtol=0, atol=1e-5)
    assert all(m["dequantized_types"] == [] for m in memory)


# ---------------------------------------------------------------------------------------------
# The portable branch (what GPU/TPU workers compile for packed experts), run on the CPU


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_portable_experts_on_cpu(qtype: str) -> None:
    """Packed experts dequantized in the graph, in both regimes: gathered (a decode step's few
    (token, expert) pairs) and looped over the experts (a prefill's many), with x per token and
    per (token, expert). The dequantization is gguf.quants' to the bit, so the products are
    float32-exact against float64 numpy on the decoded weights."""
    import jax  # noqa: PLC0415

    rng = np.random.default_rng(11)
    n_experts, n, k = 6, 32, 256
    w = rng.standard_normal((n_experts * n, k)).astype(np.float32)
    blocks = ggml_blocks.quantize(w, qtype)
    decoded = ggml_blocks.dequantize(blocks, qtype).astype(np.float64).reshape(n_experts, n, k)
    qt = ops.QTensor(jnp.asarray(blocks.reshape(n_experts, n, -1)), qtype)
    portable = jax.jit(lambda x, b, i: ops._experts_portable(x, dataclasses.replace(qt, blocks=b),
                                                              i))
    for t in (1, 9):  # 1 x 2 pairs <= 6 experts: gathered; 9 x 2 > 6: looped
        ids = rng.integers(0, n_experts, (t, 2)).astype(np.int32)
        ids[0] = [3, 3] if t > 1 else ids[0]  # a token choosing one expert twice
        for x in (rng.standard_normal((t, k)), rng.standard_normal((t, 2, k))):
            x = x.astype(np.float32)
            got = np.asarray(portable(x, qt.blocks, ids))
            xr = x if x.ndim == 3 else np.repeat(x[:, None], 2, axis=1)
            want = np.einsum("tsk,tsnk->tsn", xr.astype(np.float64), decoded[ids])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_export_keeps_both_expert_branches() -> None:
    """One artifact for cpu, cuda and tpu with a symbolic batch: it holds the MoE kernel's
    custom call and the portable gather and loop; run here, the CPU branch answers."""
    import jax  # noqa: PLC0415
    from jax import export  # noqa: PLC0415

    if not kernels.load().available:
        pytest.skip(f"CPU kernels unavailable: {kernels.load().reason}")
    rng = np.random.default_rng(12)
    blocks = ggml_blocks.quantize(rng.standard_normal((4 * 16, 256)).astype(np.float32), "Q8_0")
    stacked = blocks.reshape(4, 16, -1)
    (b,) = export.symbolic_shape("b")
    exp = export.export(
        jax.jit(lambda x, w, i: ops.expert_linear(x, ops.QTensor(w, "Q8_0"), i)),
        platforms=("cpu", "cuda", "tpu"),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t)
                         for t in sorted(kernels.OWN_TARGETS)])(
        jax.ShapeDtypeStruct((b, 256), jnp.float32), jax.ShapeDtypeStruct(stacked.shape, jnp.uint8),
        jax.ShapeDtypeStruct((b, 2), jnp.int32))
    text = exp.mlir_module()
    assert kernels.MOE_TARGET in text and "stablehlo.while" in text and "gather" in text
    x = rng.standard_normal((3, 256)).astype(np.float32)
    ids = np.array([[0, 3], [2, 2], [1, 0]], np.int32)
    got = np.asarray(exp.call(x, stacked, ids))
    want = np.asarray(_dense_kernel_experts(jnp.asarray(x), ops.QTensor(jnp.asarray(stacked),
                                                                        "Q8_0"), jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
