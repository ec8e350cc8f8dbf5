"""Llama-family decoder exporter (Llama, Mistral, Mixtral, Qwen2/3, Qwen3-MoE, Phi-3, SmolLM2).

The exporter reads metadata only (the GGUF header, or ``config.json`` plus the safetensors
headers) and returns a :class:`jaxdist.Model` of units ``embed``, ``blk.0`` ... ``blk.{L-1}`` and
``head``. Every weight is a URI the worker binds from its own disk; matrices are stored
``(out, in)`` in both formats and bound with ``transpose=True``, so each projection is ``x @ W``.

Inputs of a step (``b`` rows of ``s`` tokens; see :mod:`jaxdist.exporters.layers` for the slot
cache): ``tokens (b, s) int32``, ``slot``, ``pos``, ``length`` (``(b,) int32``), and the sampling
parameters ``temperature (b,) float32``, ``top_k (b,) int32``, ``top_p (b,) float32``,
``seed (b,) uint32``. The head returns ``token (b,) int32`` (and ``logits (b, vocab) float32``
with ``return_logits=True``) for each row's last true token. The next step of a row starts at
``pos + length``. All inputs but ``tokens`` are step control (``Model.control``,
:data:`jaxdist.export.causal_lm.STEP_CONTROL`): they travel in each frame's header and every
stage reads them there, so a hop between stages carries the activation ``x`` alone.

RoPE layout, the one trap of this family:

* Hugging Face checkpoints rotate halves (``rotate_half``: pair ``(i, i + d/2)``, GPT-NeoX style).
* llama.cpp's converter *permutes* the rows of ``attn_q``/``attn_k`` when it writes GGUF arch
  ``llama``: within each head, HF row ``i`` goes to ``2i`` and row ``i + d/2`` to ``2i + 1``
  (``w.reshape(n_head, 2, d/2, -1).swapaxes(1, 2)``). Rotating adjacent pairs (GPT-J style,
  llama.cpp's "normal" RoPE) on the GGUF weights then equals ``rotate_half`` on the HF weights.
  So GGUF ``llama`` uses interleaved pairs.
* GGUF ``qwen2``, ``qwen3`` and ``phi3`` are written unpermuted and llama.cpp runs them in NeoX
  mode: halves.

Mistral checkpoints are Llama-architecture. Llama 3 RoPE scaling is supported (HF ``rope_type``
``llama3``, or GGUF's ``rope_freqs.weight`` factors, bound as a weight); so is ``linear``.

The other members differ from Llama by a few config fields (:class:`LlamaConfig`), not by code:

* Qwen3 (dense): ``head_dim`` set apart from ``hidden_size / heads``, and an RMSNorm over
  ``head_dim`` of every q and k head before RoPE (``q_norm``/``k_norm``; GGUF
  ``attn_q_norm``/``attn_k_norm``). Its sliding window (``use_sliding_window``) is refused.
* Mixtral and Qwen3-MoE: a Mixture-of-Experts SwiGLU in place of the MLP (``n_experts`` > 0;
  :func:`jaxdist.exporters.layers.moe_swiglu`): a router (GGUF ``ffn_gate_inp``), and each
  projection's experts stacked ``(E, out, in)`` in GGUF (``ffn_{gate,up,down}_exps``, bound
  packed where quantized) or one tensor per expert in a checkpoint. Mixtral is GGUF arch
  ``llama`` with ``expert_count``; Qwen3-MoE (``qwen3moe``) has Qwen3's attention.
* Phi-3 / Phi-3.5 / Phi-4-mini: one fused ``qkv_proj`` (rows q, then k, then v; GGUF
  ``attn_qkv``) and one fused ``gate_up_proj`` (gate rows, then up; GGUF ``ffn_up``), each one
  product whose output columns are split, packed quantized matrices included; RoPE on the first
  ``partial_rotary_factor`` of each head only (Phi-4-mini: 3/4); and ``longrope`` scaling
  (``su`` in older configs): the short factors divide the frequencies and
  ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` scales the rotated dims, as
  transformers and llama.cpp (``rope_factors_short.weight``, ``rope.scaling.attn_factor``) do
  below ``original_max_position_embeddings``. Past it both switch to the long factors
  (transformers for a whole forward pass once its last position is past it, so a cached prefix
  keeps its short-factor keys); that is refused: ``max_seq`` must stay within it. A
  ``sliding_window`` in the config is taken as transformers takes it, on every layer.

Example:
    >>> model = llama_model("SmolLM2-135M-Instruct.Q4_1.gguf", roots=[root])   # doctest: +SKIP
    >>> pipe = InProcessPipeline(model, weights_roots=[root], stages=2)       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import ops
from jaxdist.core.weights import WeightInfo
from jaxdist.export.buckets import prefill_rows, step_buckets
from jaxdist.export.causal_lm import STEP_CONTROL, CausalLM, step_signature
from jaxdist.export.model import Model, Param, Unit
from jaxdist.export.plugins import LoadedModel
from jaxdist.exporters import layers
from jaxdist.exporters.source import Headers, WeightTable, open_source
from jaxdist.exporters.tokenizer import gguf_tokenizer, load_tokenizer

__all__ = ["EXPORTER", "LlamaConfig", "llama_model"]

Roots = Sequence[str | os.PathLike[str]]

_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "MixtralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
             "Phi3ForCausalLM": "phi3"}
_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3")
# RoPE scaling types (HF rope_type) per architecture; "su" is Phi-3's first name for longrope.
_HF_ROPE_TYPES = {**dict.fromkeys(("llama", "qwen2", "qwen3", "qwen3moe"),
                                  ("default", "linear", "llama3")),
                  "phi3": ("default", "longrope", "su")}
_DTYPES = ("float32", "bfloat16", "float16")

# Logical weight name -> tensor name, per file format. ``{i}`` is the layer index.
_NAMES = {
    "gguf": {
        "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
        "rope_freqs": "rope_freqs.weight", "rope_short": "rope_factors_short.weight",
        "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
        "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
        "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight",
        "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias",
        "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
        "wqkv": "blk.{i}.attn_qkv.weight",
        "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
        "w_down": "blk.{i}.ffn_down.weight",
        "w_gate_up": "blk.{i}.ffn_up.weight",  # phi3: gate rows then up rows, in one tensor
        # Mixture-of-Experts: the router, and each projection's experts stacked (E, out, in)
        "router": "blk.{i}.ffn_gate_inp.weight", "x_gate": "blk.{i}.ffn_gate_exps.weight",
        "x_up": "blk.{i}.ffn_up_exps.weight", "x_down": "blk.{i}.ffn_down_exps.weight",
    },
    "safetensors": {
        "embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
        "output": "lm_head.weight",
        "attn_norm": "model.layers.{i}.input_layernorm.weight",
        "ffn_norm": "model.layers.{i}.post_attention_layernorm.weight",
        "wq": "model.layers.{i}.self_attn.q_proj.weight",
        "wk": "model.layers.{i}.self_attn.k_proj.weight",
        "wv": "model.layers.{i}.self_attn.v_proj.weight",
        "wo": "model.layers.{i}.self_attn.o_proj.weight",
        "bq": "model.layers.{i}.self_attn.q_proj.bias",
        "bk": "model.layers.{i}.self_attn.k_proj.bias",
        "bv": "model.layers.{i}.self_attn.v_proj.bias",
        "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
        "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
        "wqkv": "model.layers.{i}.self_attn.qkv_proj.weight",
        "w_gate_up": "model.layers.{i}.mlp.gate_up_proj.weight",
        "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
        "w_up": "model.layers.{i}.mlp.up_proj.weight",
        "w_down": "model.layers.{i}.mlp.down_proj.weight",
        # Mixture-of-Experts (Qwen3-MoE): the router, and expert {j}'s matrices, one tensor each
        "router": "model.layers.{i}.mlp.gate.weight",
        "x_gate": "model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
        "x_up": "model.layers.{i}.mlp.experts.{j}.up_proj.weight",
        "x_down": "model.layers.{i}.mlp.experts.{j}.down_proj.weight",
    },
}
# Mixtral's checkpoints name the same tensors after its own modules.
_MIXTRAL_NAMES = {**_NAMES["safetensors"],
                  "router": "model.layers.{i}.block_sparse_moe.gate.weight",
                  "x_gate": "model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
                  "x_up": "model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
                  "x_down": "model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight"}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder, as read from a file's metadata."""

    arch: str                      # "llama" (also Mistral, Mixtral, SmolLM), "qwen2", "qwen3",
                                   # "qwen3moe" or "phi3"
    vocab: int                     # rows of the token embedding
    d_model: int                   # residual width
    n_layers: int                  # decoder blocks
    n_heads: int                   # query heads
    n_kv_heads: int                # key/value heads (grouped-query attention when < n_heads)
    head_dim: int                  # width of one head
    ffn_dim: int                   # SwiGLU hidden width (of each expert, for a MoE)
    rope_theta: float              # RoPE base frequency
    rms_eps: float                 # RMSNorm epsilon
    tied: bool                     # the output projection is the token embedding
    qkv_bias: bool                 # q/k/v projections carry a bias (Qwen2)
    max_position: int              # context length the model was trained for
    rope_interleaved: bool         # rotate adjacent pairs (GGUF llama), else halves (see module)
    rope_type: str = "default"     # "default", "linear", "llama3", "longrope", or "freqs" (GGUF
                                   # llama3 factor tensor)
    rope_factor: float = 1.0       # linear / llama3 scaling factor
    rope_low_freq_factor: float = 1.0    # llama3 only
    rope_high_freq_factor: float = 4.0   # llama3 only
    rope_original_max_position: int = 8192  # llama3 and longrope
    rope_short_factor: tuple[float, ...] = ()  # longrope from HF: per-frequency divisors; empty
                                               # for GGUF, whose rope_factors_short is bound
    rope_attn_factor: float = 1.0  # longrope: scales cos and sin, so the rotated q/k dims
    rotary_dim: int | None = None  # leading dims of a head that RoPE rotates; None: all of them
    qk_norm: bool = False          # RMSNorm over head_dim of each q and k head before RoPE (Qwen3)
    fused_qkv: bool = False        # one q|k|v matrix, split after the product (Phi-3)
    fused_gate_up: bool = False    # one gate|up matrix, split after the product (Phi-3)
    sliding_window: int | None = None    # attention window (Mistral v0.1); None: full
    n_experts: int = 0             # Mixture-of-Experts: experts per layer; 0: a dense SwiGLU
    n_experts_used: int = 0        # experts each token is routed to (top-k)
    expert_norm_topk: bool = True  # the chosen experts' weights are renormalized to sum to 1
    bos_id: int | None = None      # beginning-of-sequence token, if known
    eos_ids: tuple[int, ...] = ()  # tokens that end generation, if known

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], roots: Roots) -> LlamaConfig:
        """Read the config from a GGUF header (arch ``llama`` or ``qwen2``) under ``roots``.

        Raises:
            SpecError: another architecture, or inconsistent metadata.
            WeightError: the file is outside the roots, missing, or not GGUF.
        """
        src = open_source(os.fspath(path), roots)
        return _gguf_config(src.metadata, src.infos, str(path))

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str]) -> LlamaConfig:
        """Read the config from a Hugging Face checkpoint directory's ``config.json``.

        Raises:
            SpecError: missing ``config.json``, an unsupported architecture or feature.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise SpecError(f"Hugging Face checkpoint '{path}': no config.json found; expected a "
                            f"directory saved with save_pretrained")
        return _hf_config(json.loads(file.read_text()), str(path))


def _gguf_config(meta: Mapping[str, Any], infos: Mapping[str, WeightInfo], where: str
                 ) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise SpecError(f"GGUF '{where}': architecture {arch!r} is not supported by the llama "
                        f"exporter; expected one of {list(_GGUF_ARCHS)}")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise SpecError(f"GGUF '{where}': metadata key '{arch}.{name}' is missing")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise SpecError(f"GGUF '{where}': '{arch}.{name}' varies per layer ({value}); "
                                f"per-layer shapes are not supported")
            value = value[0]
        return value

    if "token_embd.weight" not in infos:
        raise SpecError(f"GGUF '{where}': tensor 'token_embd.weight' is missing")
    d, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", d // n_heads))
    rotary = int(key("rope.dimension_count", head_dim))
    if rotary != head_dim and (arch != "phi3" or not 0 < rotary < head_dim or rotary % 2):
        raise SpecError(f"GGUF '{where}': partial RoPE (rope.dimension_count {rotary}, head_dim "
                        f"{head_dim}) is not supported for {arch}; expected {head_dim} (phi3: "
                        f"an even count below it)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    # llama.cpp's phi3 converter writes longrope as two factor tensors, no scaling type.
    longrope = arch == "phi3" and any(f"rope_factors_{k}.weight" in infos
                                      for k in ("short", "long"))
    if "rope_freqs.weight" in infos:
        rope_type = "freqs"
    elif longrope:
        if "rope_factors_short.weight" not in infos:
            raise SpecError(f"GGUF '{where}': tensor 'rope_factors_short.weight' is missing "
                            f"beside 'rope_factors_long.weight'; longrope needs both")
        rope_type = "longrope"
    elif scaling in ("none", "linear"):
        rope_type = "default" if scaling == "none" else "linear"
    else:
        raise SpecError(f"GGUF '{where}': RoPE scaling {scaling!r} is not supported; expected "
                        f"none, linear, llama3 factors (rope_freqs.weight) or, for phi3, longrope "
                        f"factors (rope_factors_short.weight)")
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0) if arch == "phi3" else 0
    n_experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if arch == "qwen3moe" and n_experts < 1:
        raise SpecError(f"GGUF '{where}': metadata key 'qwen3moe.expert_count' is missing")
    if n_experts and "blk.0.ffn_gate_exps.weight" not in infos:
        old = "blk.0.ffn_gate.0.weight" in infos
        raise SpecError(f"GGUF '{where}': {n_experts} experts ({arch}.expert_count), but no "
                        f"stacked expert tensor 'blk.0.ffn_gate_exps.weight'"
                        + ("; this file stores one tensor per expert (blk.N.ffn_gate.E.weight, "
                           "llama.cpp's layout before 2024): convert it again with a current "
                           "convert_hf_to_gguf.py" if old else ""))
    ffn_key = "expert_feed_forward_length" if arch == "qwen3moe" else "feed_forward_length"
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    return LlamaConfig(
        arch=arch, vocab=infos["token_embd.weight"].shape[0], d_model=d,
        n_layers=int(key("block_count")), n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        ffn_dim=int(key(ffn_key)), rope_theta=float(key("rope.freq_base", 1e4)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tied="output.weight" not in infos, qkv_bias="blk.0.attn_q.bias" in infos,
        max_position=int(key("context_length", 2048)), rope_interleaved=(arch == "llama"),
        rope_type=rope_type, rope_factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        rope_original_max_position=int(key("rope.scaling.original_context_length"))
        if longrope else 8192,
        rope_attn_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
        rotary_dim=None if rotary == head_dim else rotary,
        qk_norm=arch in ("qwen3", "qwen3moe"), fused_qkv="blk.0.attn_qkv.weight" in infos,
        fused_gate_up=(arch == "phi3"), sliding_window=window or None,
        # llama.cpp renormalizes the chosen experts' weights for both MoE archs, whatever the
        # HF config said (norm_topk_prob); the same file computes the same here.
        n_experts=n_experts,
        n_experts_used=int(key("expert_used_count")) if n_experts else 0,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos)))


def _hf_config(cfg: Mapping[str, Any], where: str) -> LlamaConfig:
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in _HF_ARCHS), None)
    if name is None:
        raise SpecError(f"Hugging Face checkpoint '{where}': architectures {archs} are not "
                        f"supported by the llama exporter; expected one of {list(_HF_ARCHS)}")
    arch = _HF_ARCHS[name]
    # Each refusal names the key, what was found and what is supported.
    refused = [f"{k}=true (supported: false)" for k in ("attention_bias", "mlp_bias")
               if arch in ("llama", "qwen3", "qwen3moe") and cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={cfg['hidden_act']!r} (supported: 'silu')")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if rope_type not in _HF_ROPE_TYPES[arch]:
        refused.append(f"RoPE scaling type {rope_type!r} (supported for {name}: "
                       f"{', '.join(_HF_ROPE_TYPES[arch])})")
    if arch == "qwen3moe" and (int(cfg.get("decoder_sparse_step", 1)) != 1
                               or cfg.get("mlp_only_layers")):
        refused.append(f"dense layers among the MoE layers (decoder_sparse_step="
                       f"{cfg.get('decoder_sparse_step')}, mlp_only_layers="
                       f"{cfg.get('mlp_only_layers')}; supported: 1 and [])")
    if arch in ("qwen3", "qwen3moe") and (cfg.get("use_sliding_window")
                            or "sliding_attention" in (cfg.get("layer_types") or ())):
        refused.append("use_sliding_window=true (sliding-window attention on the layers from "
                       "max_window_layers on; supported: false)")
    if refused:
        raise SpecError(f"Hugging Face checkpoint '{where}' ({name}): {'; '.join(refused)} "
                        f"not supported by the llama exporter")
    d, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or d // n_heads)
    max_position = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3moe") and not cfg.get("use_sliding_window", False):
        window = None
    rotary, attn_factor = head_dim, 1.0
    short: tuple[float, ...] = ()
    original = int(rope.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or 8192)
    if arch == "phi3":
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        rotary = int(head_dim * partial)
        if rotary < 2 or rotary % 2:
            raise SpecError(f"Hugging Face checkpoint '{where}': partial_rotary_factor {partial} "
                            f"of head_dim {head_dim} rotates {rotary} dims; expected an even "
                            f"count of at least 2")
    if rope_type in ("longrope", "su"):
        rope_type = "longrope"
        for k in ("short_factor", "long_factor"):
            v = rope.get(k)
            if not isinstance(v, list) or len(v) != rotary // 2:
                raise SpecError(f"Hugging Face checkpoint '{where}': rope_scaling.{k} must be "
                                f"a list of {rotary // 2} numbers (half the {rotary} rotated "
                                f"dims), found {v!r}")
        short = tuple(float(f) for f in rope["short_factor"])
        # As transformers' _compute_longrope_parameters: the factor defaults to the context
        # extension ratio, and the attention factor to sqrt(1 + ln(factor) / ln(original)).
        factor = float(rope.get("factor") or max_position / original)
        if rope.get("attention_factor") is not None:
            attn_factor = float(rope["attention_factor"])
        elif factor > 1.0:
            attn_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    eos = cfg.get("eos_token_id")
    n_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    ffn = cfg["moe_intermediate_size"] if arch == "qwen3moe" else cfg["intermediate_size"]
    return LlamaConfig(
        arch=arch, vocab=int(cfg["vocab_size"]), d_model=d,
        n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        ffn_dim=int(ffn),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=(arch == "qwen2"),
        max_position=max_position, rope_interleaved=False,
        rope_type=rope_type, rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=original, rope_short_factor=short,
        rope_attn_factor=float(attn_factor), rotary_dim=None if rotary == head_dim else rotary,
        qk_norm=arch in ("qwen3", "qwen3moe"), fused_qkv=(arch == "phi3"),
        fused_gate_up=(arch == "phi3"), sliding_window=int(window) if window else None,
        n_experts=n_experts, n_experts_used=int(cfg.get("num_experts_per_tok") or 0),
        # Mixtral always renormalizes; Qwen3-MoE where norm_topk_prob says so
        expert_norm_topk=bool(cfg.get("norm_topk_prob", True)), bos_id=cfg.get("bos_token_id"),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)))


# ---------------------------------------------------------------------------------------------
# Units


def _embed(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    out = {k: v for k, v in carry.items() if k != "tokens"}
    out["x"] = ops.take_rows(params["embedding"], carry["tokens"])
    return out, {}


def _block(cfg: LlamaConfig, inv_freq: np.ndarray, params: dict[str, Any],
           state: dict[str, Any], carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    x, slot, pos, length = carry["x"], carry["slot"], carry["pos"], carry["length"]
    b, s = x.shape[0], x.shape[1]
    h = layers.rms_norm(x, params["attn_norm"], cfg.rms_eps)
    # The tokens that are not padding: the CPU kernels skip the others' rows.
    live = (lax.broadcasted_iota(jnp.int32, (b, s), 1) < length[:, None]).astype(jnp.int32)
    if cfg.fused_qkv:
        # One product with the fused matrix (packed or not), then its output columns split.
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = jnp.split(ops.linear(h, params["wqkv"], live), [q_dim, q_dim + kv_dim],
                            axis=-1)
    else:
        q, k, v = (ops.linear(h, params[n], live) for n in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q, k, v = q + params["bq"], k + params["bk"], v + params["bv"]
    q = q.reshape(b, s, cfg.n_heads, cfg.head_dim)
    k = k.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = layers.rms_norm(q, params["q_norm"], cfg.rms_eps)
        k = layers.rms_norm(k, params["k_norm"], cfg.rms_eps)
    inv = jnp.asarray(inv_freq)
    if "rope_freqs" in params:
        inv = inv / params["rope_freqs"].astype(jnp.float32)
    cos, sin = layers.rope_angles(layers.step_positions(pos, x), inv)
    if cfg.rope_attn_factor != 1.0:
        cos, sin = cos * cfg.rope_attn_factor, sin * cfg.rope_attn_factor
    q = layers.apply_partial_rope(q, cos, sin, interleaved=cfg.rope_interleaved)
    k = layers.apply_partial_rope(k, cos, sin, interleaved=cfg.rope_interleaved)
    att, k_cache, v_cache = layers.cache_attention(q, k, v, state["k"], state["v"], slot, pos,
                                                   length, window=cfg.sliding_window or 0)
    att = att.reshape(b, s, cfg.n_heads * cfg.head_dim)
    x = x + ops.linear(att, params["wo"], live).astype(x.dtype)
    h = layers.rms_norm(x, params["ffn_norm"], cfg.rms_eps)
    if cfg.n_experts:
        experts = {n: params[n] if n in params else
                   [params[f"{n}.{j}"] for j in range(cfg.n_experts)]
                   for n in ("x_gate", "x_up", "x_down")}
        moe = layers.moe_swiglu(h, params["router"], experts["x_gate"], experts["x_up"],
                                experts["x_down"], n_used=cfg.n_experts_used,
                                norm_topk=cfg.expert_norm_topk, live=live)
        return dict(carry, x=x + moe.astype(x.dtype)), {"k": k_cache, "v": v_cache}
    if cfg.fused_gate_up:
        gate, up = jnp.split(ops.linear(h, params["w_gate_up"], live), 2, axis=-1)
    else:
        gate, up = ops.linear(h, params["w_gate"], live), ops.linear(h, params["w_up"], live)
    gated = jax.nn.silu(gate) * up
    x = x + ops.linear(gated, params["w_down"], live).astype(x.dtype)
    return dict(carry, x=x), {"k": k_cache, "v": v_cache}


def _head(cfg: LlamaConfig, return_logits: bool, params: dict[str, Any], state: dict[str, Any],
          carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    h = layers.rms_norm(layers.last_valid(carry["x"], carry["length"]), params["norm"],
                        cfg.rms_eps)
    logits = ops.linear(h, params["output"], carry["length"] > 0).astype(jnp.float32)
    token = layers.sample_tokens(logits, carry["temperature"], carry["top_k"], carry["top_p"],
                                 carry["seed"], carry["pos"] + carry["length"])
    out = {"token": token}
    if return_logits:
        out["logits"] = logits
    return out, {}


# ---------------------------------------------------------------------------------------------
# The model


def _load_source(path: str, roots: Roots, dtype: str, quantized: bool,
                 headers: Headers | None = None) -> tuple[LlamaConfig, WeightTable, str]:
    src = open_source(path, roots, headers)
    if src.scheme == "gguf":
        cfg = _gguf_config(src.metadata, src.infos, path)
    else:
        cfg = LlamaConfig.from_hf(src.hf_directory)
    kind = "gguf" if src.scheme == "gguf" else "hf"
    names = (_MIXTRAL_NAMES if src.scheme == "safetensors" and cfg.n_experts
                 and cfg.arch == "llama" else _NAMES[src.scheme])
    table = WeightTable(src, names, dtype, family="llama-family", quantized=quantized)
    return cfg, table, kind


def _expert_params(w: WeightTable, cfg: LlamaConfig, i: int) -> dict[str, Param]:
    """Layer ``i``'s router and experts: GGUF's stacked ``(E, out, in)`` tensors (packed as
    stored where quantized), or a checkpoint's one tensor per expert, as ``x_gate.{j}``."""
    d, f, e = cfg.d_model, cfg.ffn_dim, cfg.n_experts
    p = {"router": w.param("router", (d, e), i, transpose=True)}
    shapes = {"x_gate": (f, d), "x_up": (f, d), "x_down": (d, f)}
    for name, shape in shapes.items():
        if w.scheme == "gguf":
            p[name] = w.param(name, (e, *shape), i)
        else:
            p |= {f"{name}.{j}": w.param(name, shape, i, j=j) for j in range(e)}
    return p


def llama_model(path: str | os.PathLike[str], *, roots: Roots, max_slots: int = 4,
                max_seq: int = 512, dtype: str = "float32", return_logits: bool = False,
                prefill_buckets: Sequence[int] = (16, 64, 128, 256), quantized: bool = True,
                headers: Headers | None = None) -> Model:
    """Describe a Llama-family model (GGUF file or HF directory) as jaxdist units.

    Args:
        path: a ``.gguf`` file or a Hugging Face checkpoint directory, relative to a weights root
            or absolute under one; the URIs use it as given.
        roots: weight roots to read the headers from (the workers must hold the same files).
        max_slots: sequences the KV cache of each block holds at once.
        max_seq: positions per slot; tokens at positions ``>= max_seq`` are not cached.
        dtype: weight, activation and KV-cache dtype (``float32``, ``bfloat16``, ``float16``);
            norms, RoPE, attention scores and logits are computed in float32.
        return_logits: the head also returns the last position's ``logits (b, vocab)``.
        prefill_buckets: prompt lengths compiled ahead of time, besides decode: one prompt
            per step at each, and several at the smallest (see
            :func:`jaxdist.export.buckets.step_buckets`).
        quantized: keep a GGUF file's quantized (and F16/BF16) matrices as stored, packed,
            multiplied by the CPU kernels or dequantized in the graph on GPU/TPU
            (:mod:`jaxdist.core.kernels.ops`); ``False`` dequantizes every weight to ``dtype`` when
            bound (6 to 7 times the memory of a 4-bit file).
        headers: read a GGUF file's headers there instead of under ``roots`` (a worker's,
            through ``DescribeWeights``; see :func:`jaxdist.exporters.source.open_source`).

    Returns:
        The :class:`~jaxdist.export.model.Model`; ``meta`` holds ``config``, ``eos_ids``, ``bos_id``,
        ``max_slots``, ``max_seq``, ``prefill_buckets`` and ``tokenizer``.

    Raises:
        SpecError: bad options, an unsupported architecture, or a file disagreeing with its config.
        WeightError: the path is outside the roots or unreadable.
    """
    if dtype not in _DTYPES:
        raise SpecError(f"llama_model: dtype {dtype!r} is not supported; expected one of "
                        f"{list(_DTYPES)}")
    if max_slots < 1 or max_seq < 1:
        raise SpecError(f"llama_model: max_slots and max_seq must be >= 1, found {max_slots} "
                        f"and {max_seq}")
    path = os.fspath(path)
    cfg, w, kind = _load_source(path, roots, dtype, quantized, headers)
    if cfg.n_experts and not 1 <= cfg.n_experts_used <= cfg.n_experts:
        raise SpecError(f"'{path}': {cfg.n_experts} experts, of which each token uses "
                        f"{cfg.n_experts_used}; expected between 1 and {cfg.n_experts}")
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise SpecError(f"'{path}': n_heads {cfg.n_heads} must be a multiple of n_kv_heads "
                        f"{cfg.n_kv_heads}, and head_dim {cfg.head_dim} even")
    # Qwen2's window covers only the layers from max_window_layers on: not done (exact while
    # max_seq <= window). Other windows (Mistral v0.1) cover every layer and are applied.
    if cfg.arch == "qwen2" and cfg.sliding_window is not None and max_seq > cfg.sliding_window:
        raise SpecError(f"'{path}': Qwen2's sliding-window attention (use_sliding_window, "
                        f"window {cfg.sliding_window} on the layers from max_window_layers on) "
                        f"is not supported; pass max_seq <= {cfg.sliding_window} to stay exact")
    if cfg.rope_type == "longrope" and max_seq > cfg.rope_original_max_position:
        raise SpecError(f"'{path}': longrope RoPE past original_max_position_embeddings "
                        f"({cfg.rope_original_max_position}) switches to its long factors, which "
                        f"is not supported (only the short factors are); pass max_seq <= "
                        f"{cfg.rope_original_max_position}")
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    rot = cfg.rotary_dim or hd
    embed = w.param("embed", (cfg.vocab, d))
    units = [Unit("embed", _embed, {"embedding": embed})]
    # "freqs" and GGUF longrope: the file's per-frequency factors are bound as a weight and
    # divide the frequencies in-graph; HF longrope's short factors divide them here.
    inv_freq = layers.rope_inv_freq(
        rot, cfg.rope_theta,
        rope_type="default" if cfg.rope_type in ("freqs", "longrope") else cfg.rope_type,
        factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position=cfg.rope_original_max_position)
    if cfg.rope_short_factor:
        inv_freq = (inv_freq / np.asarray(cfg.rope_short_factor, np.float32)).astype(np.float32)
    factor_tensor = (None if cfg.rope_short_factor
                     else {"freqs": "rope_freqs", "longrope": "rope_short"}.get(cfg.rope_type))
    block_fn = functools.partial(_block, cfg, inv_freq)
    cache_shape = (layers.cache_shape(max_slots, max_seq, cfg.n_kv_heads, hd), dtype)
    for i in range(cfg.n_layers):
        p = {"attn_norm": w.param("attn_norm", (d,), i)}
        if cfg.fused_qkv:
            p["wqkv"] = w.param("wqkv", (d, q_dim + 2 * kv_dim), i, transpose=True)
        else:
            p |= {"wq": w.param("wq", (d, q_dim), i, transpose=True),
                  "wk": w.param("wk", (d, kv_dim), i, transpose=True),
                  "wv": w.param("wv", (d, kv_dim), i, transpose=True)}
        p |= {"wo": w.param("wo", (q_dim, d), i, transpose=True),
              "ffn_norm": w.param("ffn_norm", (d,), i)}
        if cfg.n_experts:
            p |= _expert_params(w, cfg, i)
        elif cfg.fused_gate_up:
            p |= {"w_gate_up": w.param("w_gate_up", (d, 2 * f), i, transpose=True),
                  "w_down": w.param("w_down", (f, d), i, transpose=True)}
        else:
            p |= {"w_gate": w.param("w_gate", (d, f), i, transpose=True),
                  "w_up": w.param("w_up", (d, f), i, transpose=True),
                  "w_down": w.param("w_down", (f, d), i, transpose=True)}
        if cfg.qkv_bias:
            p |= {"bq": w.param("bq", (q_dim,), i), "bk": w.param("bk", (kv_dim,), i),
                  "bv": w.param("bv", (kv_dim,), i)}
        if cfg.qk_norm:
            p |= {"q_norm": w.param("q_norm", (hd,), i), "k_norm": w.param("k_norm", (hd,), i)}
        if factor_tensor is not None:
            p["rope_freqs"] = dataclasses.replace(w.param(factor_tensor, (rot // 2,)),
                                                  dtype="float32")
        units.append(Unit(f"blk.{i}", block_fn, p, {"k": cache_shape, "v": cache_shape}))
    if cfg.tied or not w.has("output"):
        if not cfg.tied:
            raise SpecError(f"'{path}': the config says the embeddings are not tied, but the "
                            f"output projection '{_NAMES[w.scheme]['output']}' is missing")
        output = dataclasses.replace(embed, shape=(d, cfg.vocab), transpose=True)
    else:
        output = w.param("output", (d, cfg.vocab), transpose=True)
    units.append(Unit("head", functools.partial(_head, cfg, return_logits),
                      {"norm": w.param("norm", (d,)), "output": output}))
    prefill = tuple(int(n) for n in prefill_buckets if 1 <= int(n) <= max_seq)
    buckets = step_buckets(max_slots, prefill)
    inputs = step_signature()
    meta = {"family": "llama", "config": cfg, "eos_ids": cfg.eos_ids, "bos_id": cfg.bos_id,
            "max_slots": max_slots, "max_seq": max_seq, "prefill_buckets": prefill,
            "prefill_rows": prefill_rows(max_slots, prefill),
            "tokenizer": {kind: path}, "return_logits": return_logits}
    return Model(Path(path).name or path, units, inputs, buckets=buckets, meta=meta,
                 control=STEP_CONTROL)


class _LlamaExporter:
    """The ``jaxdist.exporters`` entry point for Llama-family models (see jaxdist.export.plugins)."""

    name = "llama"
    kind = "causal-lm"
    architectures = frozenset({*_GGUF_ARCHS, *_HF_ARCHS})

    def load(self, path: str, *, roots: Roots, headers: Headers | None = None, **options: Any
             ) -> LoadedModel:
        model = llama_model(path, roots=roots, headers=headers, **options)
        meta = model.meta
        if headers is not None:
            tokenizer = gguf_tokenizer(headers.metadata(path), path)
        else:
            root_path = next((Path(r) / path for r in roots if (Path(r) / path).exists()),
                             Path(path))
            tokenizer = load_tokenizer(root_path)
        # The tokenizer may know more end-of-generation ids than the config (e.g. <|endoftext|>
        # beside <|im_end|>), as llama.cpp does.
        extra = tokenizer.eos_ids if tokenizer is not None else ()
        lm = CausalLM(max_slots=meta["max_slots"], max_seq=meta["max_seq"],
                      prefill_buckets=meta["prefill_buckets"],
                      prefill_rows=meta["prefill_rows"],
                      input_dtypes={k: dtype for k, (_, dtype) in model.inputs.items()},
                      eos_ids=tuple(dict.fromkeys([*meta["eos_ids"], *sorted(extra)])),
                      # informational (nothing reads it), recorded since the first manifests
                      extra={"bos_id": meta["bos_id"]})
        return LoadedModel(model, "causal-lm", tokenizer, meta["config"].arch, causal_lm=lm)


EXPORTER = _LlamaExporter()
