"""Gemma 3 (text) decoder exporter, from GGUF (arch ``gemma3``) or Hugging Face files.

Like :mod:`jaxdist.exporters.llama`, it reads metadata only and returns a :class:`jaxdist.Model`
of units ``embed``, ``blk.0`` ... ``blk.{L-1}`` and ``head`` with the same step inputs and slot
KV cache (:mod:`jaxdist.exporters.layers`). What sets Gemma 3 apart, all of it config
(:class:`Gemma3Config`):

* Local and global layers, interleaved: the local ones attend over a sliding window
  (``sliding_window`` positions) and rotate with their own RoPE base (HF ``rope_local_base_freq``
  or ``rope_parameters["sliding_attention"]``, GGUF ``rope.freq_base_swa``, default 10000); the
  global ones attend over everything with ``rope_theta`` and its scaling (``linear``, factor 8
  in the 4B to 27B models). Which layer is which: HF ``layer_types``, else
  ``sliding_window_pattern`` (every n-th layer global, default 6); GGUF
  ``attention.sliding_window_pattern`` (an int or one bool per layer), else 6, as llama.cpp.
  The KV cache stays ``max_seq`` long on every layer: a local layer reads only its window.
* Four RMSNorms per block (before and after attention, before and after the MLP) and one over
  each q and k head (QK-norm). HF checkpoints store ``weight - 1`` (``Gemma3RMSNorm``
  multiplies by ``1 + weight``); llama.cpp's converter adds the 1 when it writes the GGUF.
* GeGLU with the tanh-approximated GELU; the embeddings scaled by ``sqrt(hidden)`` in their own
  dtype (as transformers does); the LM head tied to them.
* ``head_dim`` set apart from ``hidden / heads``, and scores scaled by
  ``query_pre_attn_scalar ** -0.5``. A GGUF stores no scalar; llama.cpp uses ``head_dim ** -0.5``,
  and ``(hidden / heads) ** -0.5`` for the 62-layer 27B, which this exporter follows.
* ``final_logit_softcapping`` (``tanh(z / c) * c``) when a config sets it (none of Google's).

RoPE rotates halves (NeoX); llama.cpp's gemma3 converter writes q and k unpermuted.

Refused, by name: attention logit softcapping (Gemma 2's ``attn_logit_softcapping``),
bidirectional attention, attention biases, another activation, RoPE scaling other than linear.
A ``Gemma3ForConditionalGeneration`` checkpoint exports its text model only: its vision tower
and projector are left out (a warning says so) and images cannot be given.

Example:
    >>> model = gemma3_model("gemma-3-270m-q4_k_m.gguf", roots=[root])        # doctest: +SKIP
    >>> pipe = InProcessPipeline(model, weights_roots=[root], stages=2)       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
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
from jaxdist.export.model import Model, Unit
from jaxdist.export.plugins import LoadedModel
from jaxdist.exporters import layers
from jaxdist.exporters.source import Headers, WeightTable, open_source
from jaxdist.exporters.tokenizer import Tokenizer, gguf_tokenizer, load_tokenizer

__all__ = ["CHAT_TEMPLATE", "EXPORTER", "Gemma3Config", "gemma3_model"]

log = logging.getLogger(__name__)

Roots = Sequence[str | os.PathLike[str]]

_CAUSAL, _CONDITIONAL = "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"
_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "linear")
_LOCAL, _GLOBAL = "sliding_attention", "full_attention"

# Logical weight name -> tensor name. HF names take a prefix: "model." (Gemma3ForCausalLM), or
# the text model's inside Gemma3ForConditionalGeneration ({p}; {h} for its LM head).
_NAMES = {
    "gguf": {
        "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
        "attn_norm": "blk.{i}.attn_norm.weight",
        "post_attn_norm": "blk.{i}.post_attention_norm.weight",
        "ffn_norm": "blk.{i}.ffn_norm.weight", "post_ffn_norm": "blk.{i}.post_ffw_norm.weight",
        "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
        "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
        "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight",
        "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
        "w_down": "blk.{i}.ffn_down.weight",
    },
    "safetensors": {
        "embed": "{p}embed_tokens.weight", "norm": "{p}norm.weight", "output": "{h}lm_head.weight",
        "attn_norm": "{p}layers.{i}.input_layernorm.weight",
        "post_attn_norm": "{p}layers.{i}.post_attention_layernorm.weight",
        "ffn_norm": "{p}layers.{i}.pre_feedforward_layernorm.weight",
        "post_ffn_norm": "{p}layers.{i}.post_feedforward_layernorm.weight",
        "q_norm": "{p}layers.{i}.self_attn.q_norm.weight",
        "k_norm": "{p}layers.{i}.self_attn.k_norm.weight",
        "wq": "{p}layers.{i}.self_attn.q_proj.weight",
        "wk": "{p}layers.{i}.self_attn.k_proj.weight",
        "wv": "{p}layers.{i}.self_attn.v_proj.weight",
        "wo": "{p}layers.{i}.self_attn.o_proj.weight",
        "w_gate": "{p}layers.{i}.mlp.gate_proj.weight", "w_up": "{p}layers.{i}.mlp.up_proj.weight",
        "w_down": "{p}layers.{i}.mlp.down_proj.weight",
    },
}
# transformers' Gemma3TextConfig defaults: a config.json may leave any of them out (the
# text_config of gemma-3-4b-it names neither vocab_size nor the head counts).
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 131_072,
    "sliding_window": 4096}
# Where the text model's tensors are: (body prefix, LM head prefix), by checkpoint layout.
_HF_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."),
                ("model.language_model.", ""))

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set turns = messages[1:] %}"
    "{% if system is not string %}{% set system = system[0]['text'] %}{% endif %}"
    "{% else %}{% set system = none %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma 3 chats alternate user and assistant turns (after an optional "
    "system message)') }}{% endif %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if loop.first and system is not none %}{{ system }}\n\n{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] != 'text' %}{{ raise_exception('Gemma 3 content of type ' "
    "~ part['type'] ~ ': only text is supported (the vision tower is not exported)') }}"
    "{% endif %}{{ part['text'] | trim }}{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
"""Gemma 3's chat format (turns ``<start_of_turn>user`` / ``model`` ... ``<end_of_turn>``, a
system message prefixed to the first user turn, BOS first), used when a file carries no
template of its own (llama.cpp's GGUFs often do not). Text only: an image part is refused."""


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Hyperparameters of a Gemma 3 text decoder, as read from a file's metadata."""

    vocab: int                      # rows of the token embedding
    d_model: int                    # residual width
    n_layers: int                   # decoder blocks
    n_heads: int                    # query heads
    n_kv_heads: int                 # key/value heads (grouped-query attention)
    head_dim: int                   # width of one head (not d_model / n_heads)
    ffn_dim: int                    # GeGLU hidden width
    rms_eps: float                  # RMSNorm epsilon
    norm_offset: float              # added to every norm weight: 1.0 for HF, 0.0 for GGUF
    attn_scale: float               # score scale: query_pre_attn_scalar ** -0.5
    rope_theta: float               # RoPE base of the global layers
    rope_local_theta: float         # RoPE base of the local (sliding-window) layers
    local_layers: tuple[bool, ...]  # per layer: local (sliding window), else global
    sliding_window: int | None      # positions a local layer sees, itself included
    tied: bool                      # the LM head is the token embedding
    max_position: int               # context length the model was trained for
    rope_type: str = "default"      # global layers' scaling: "default" or "linear"
    rope_factor: float = 1.0        # global layers' linear factor
    rope_local_type: str = "default"  # local layers' scaling: "default" or "linear"
    rope_local_factor: float = 1.0  # local layers' linear factor
    final_softcap: float | None = None  # logits -> tanh(logits / c) * c
    bos_id: int | None = None       # beginning-of-sequence token, if known
    eos_ids: tuple[int, ...] = ()   # tokens that end generation, if known


def _gguf_config(meta: Mapping[str, Any], infos: Mapping[str, WeightInfo], where: str
                 ) -> Gemma3Config:
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise SpecError(f"GGUF '{where}': architecture {arch!r} is not supported by the gemma3 "
                        f"exporter; expected 'gemma3'")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"gemma3.{name}", default)
        if value is None:
            raise SpecError(f"GGUF '{where}': metadata key 'gemma3.{name}' is missing")
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise SpecError(f"GGUF '{where}': 'gemma3.{name}' varies per layer ({value}); "
                                f"per-layer shapes are not supported")
            value = value[0]
        return value

    if "token_embd.weight" not in infos:
        raise SpecError(f"GGUF '{where}': tensor 'token_embd.weight' is missing")
    d, n_heads, n_layers = (int(key("embedding_length")), int(key("attention.head_count")),
                            int(key("block_count")))
    head_dim = int(key("attention.key_length", d // n_heads))
    for name, found in (("attention.value_length", key("attention.value_length", head_dim)),
                        ("rope.dimension_count", key("rope.dimension_count", head_dim))):
        if int(found) != head_dim:
            raise SpecError(f"GGUF '{where}': 'gemma3.{name}' is {found}, expected the key "
                            f"length {head_dim}; not supported")
    softcap = meta.get("gemma3.attn_logit_softcapping")
    if softcap:
        raise SpecError(f"GGUF '{where}': 'gemma3.attn_logit_softcapping' = {softcap} "
                        f"(attention logit softcapping, Gemma 2's) is not supported")
    scaling = meta.get("gemma3.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise SpecError(f"GGUF '{where}': 'gemma3.rope.scaling.type' = {scaling!r} is not "
                        f"supported; expected none or linear")
    window = int(meta.get("gemma3.attention.sliding_window", 0) or 0)
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if window <= 0:
        local = (False,) * n_layers   # llama.cpp: no window, every layer global
    elif isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise SpecError(f"GGUF '{where}': 'gemma3.attention.sliding_window_pattern' has "
                            f"{len(pattern)} entries, expected one per layer ({n_layers})")
        local = tuple(bool(v) for v in pattern)
    else:  # every n-th layer global (n = 0: all local), llama.cpp's default n = 6
        n = int(pattern) if pattern is not None else 6
        local = tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    final = meta.get("gemma3.final_logit_softcapping")
    return Gemma3Config(
        vocab=infos["token_embd.weight"].shape[0], d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), norm_offset=0.0,
        attn_scale=(d / n_heads if n_layers == 62 else head_dim) ** -0.5,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_local_theta=float(key("rope.freq_base_swa", 10000.0)), local_layers=local,
        sliding_window=window or None, tied="output.weight" not in infos,
        max_position=int(key("context_length", 131072)),
        rope_type="default" if scaling == "none" else "linear",
        rope_factor=float(meta.get("gemma3.rope.scaling.factor", 1.0)),
        final_softcap=float(final) if final else None,
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos)))


def _hf_rope(text: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE parameters, from either spelling transformers has written."""
    params = dict(text.get("rope_parameters") or {})
    if _GLOBAL in params or _LOCAL in params:
        glob, loc = dict(params.get(_GLOBAL) or {}), dict(params.get(_LOCAL) or {})
    else:  # rope_theta, rope_local_base_freq, rope_scaling (the global layers' only)
        glob = dict(text.get("rope_scaling") or params)
        glob.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
        loc = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
    glob.setdefault("rope_theta", 1_000_000.0)
    loc.setdefault("rope_theta", 10_000.0)
    return glob, loc


def _hf_config(cfg: Mapping[str, Any], where: str) -> Gemma3Config:
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in (_CAUSAL, _CONDITIONAL)), None)
    if name is None:
        raise SpecError(f"Hugging Face checkpoint '{where}': architectures {archs} are not "
                        f"supported by the gemma3 exporter; expected {_CAUSAL} or {_CONDITIONAL}")
    text = cfg.get("text_config") if name == _CONDITIONAL else cfg
    if not isinstance(text, Mapping):
        raise SpecError(f"Hugging Face checkpoint '{where}' ({name}): 'text_config' is missing")
    text = {**_HF_DEFAULTS, **text}
    if name == _CONDITIONAL:
        vision = (cfg.get("vision_config") or {}).get("model_type", "a vision tower")
        log.warning("'%s' (%s): exporting the text model only; its vision tower (%s) and "
                    "multi-modal projector are not exported, so images cannot be given",
                    where, name, vision)
    refused = []
    if text.get("attn_logit_softcapping") is not None:
        refused.append(f"attn_logit_softcapping={text['attn_logit_softcapping']} (attention "
                       f"logit softcapping, Gemma 2's; supported: null)")
    for flag in ("use_bidirectional_attention", "attention_bias"):
        if text.get(flag):
            refused.append(f"{flag}=true (supported: false)")
    act = text.get("hidden_activation") or text.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        refused.append(f"hidden_activation={act!r} (supported: 'gelu_pytorch_tanh')")
    glob, loc = _hf_rope(text)
    for which, rope in ((_GLOBAL, glob), (_LOCAL, loc)):
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        if kind not in _ROPE_TYPES:
            refused.append(f"RoPE scaling type {kind!r} on the {which} layers (supported: "
                           f"{', '.join(_ROPE_TYPES)})")
    n_layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        n = int(text.get("sliding_window_pattern", text.get("_sliding_window_pattern", 6)))
        types = [_LOCAL if (i + 1) % n else _GLOBAL for i in range(n_layers)]
    unknown = sorted(set(types) - {_LOCAL, _GLOBAL})
    if unknown:
        refused.append(f"layer_types {unknown} (supported: {_LOCAL}, {_GLOBAL})")
    if refused:
        raise SpecError(f"Hugging Face checkpoint '{where}' ({name}): {'; '.join(refused)} "
                        f"not supported by the gemma3 exporter")
    if len(types) != n_layers:
        raise SpecError(f"Hugging Face checkpoint '{where}': layer_types has {len(types)} "
                        f"entries, expected one per layer ({n_layers})")
    local = tuple(t == _LOCAL for t in types)
    window = text.get("sliding_window")
    if any(local) and not window:
        raise SpecError(f"Hugging Face checkpoint '{where}': sliding_window is {window!r}, but "
                        f"layers {[i for i, x in enumerate(local) if x]} are sliding_attention")
    d, n_heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    final = text.get("final_logit_softcapping")
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    return Gemma3Config(
        vocab=int(text["vocab_size"]), d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(text.get("num_key_value_heads") or n_heads),
        head_dim=int(text.get("head_dim") or 256), ffn_dim=int(text["intermediate_size"]),
        rms_eps=float(text.get("rms_norm_eps", 1e-6)), norm_offset=1.0,
        attn_scale=float(text.get("query_pre_attn_scalar", 256)) ** -0.5,
        rope_theta=float(glob["rope_theta"]), rope_local_theta=float(loc["rope_theta"]),
        local_layers=local, sliding_window=int(window) if window and any(local) else None,
        tied=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
        max_position=int(text.get("max_position_embeddings", 131072)),
        rope_type=str(glob.get("rope_type", glob.get("type", "default"))),
        rope_factor=float(glob.get("factor", 1.0)),
        rope_local_type=str(loc.get("rope_type", loc.get("type", "default"))),
        rope_local_factor=float(loc.get("factor", 1.0)),
        final_softcap=float(final) if final else None, bos_id=text.get("bos_token_id"),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)))


# ---------------------------------------------------------------------------------------------
# Units


def _embed(cfg: Gemma3Config, params: dict[str, Any], state: dict[str, Any],
           carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    out = {k: v for k, v in carry.items() if k != "tokens"}
    x = ops.take_rows(params["embedding"], carry["tokens"])
    # sqrt(hidden) rounded to the embedding's dtype first, as transformers scales it.
    out["x"] = x * jnp.asarray(np.float32(math.sqrt(cfg.d_model))).astype(x.dtype)
    return out, {}


def _block(cfg: Gemma3Config, inv_freq: np.ndarray, window: int, params: dict[str, Any],
           state: dict[str, Any], carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    x, slot, pos, length = carry["x"], carry["slot"], carry["pos"], carry["length"]
    b, s = x.shape[0], x.shape[1]

    def norm(v: Any, name: str) -> Any:
        return layers.rms_norm_offset(v, params[name], cfg.rms_eps, cfg.norm_offset)

    h = norm(x, "attn_norm")
    # The tokens that are not padding: the CPU kernels skip the others' rows.
    live = (lax.broadcasted_iota(jnp.int32, (b, s), 1) < length[:, None]).astype(jnp.int32)
    q, k, v = (ops.linear(h, params[n], live) for n in ("wq", "wk", "wv"))
    q = norm(q.reshape(b, s, cfg.n_heads, cfg.head_dim), "q_norm")
    k = norm(k.reshape(b, s, cfg.n_kv_heads, cfg.head_dim), "k_norm")
    v = v.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    cos, sin = layers.rope_angles(layers.step_positions(pos, x), jnp.asarray(inv_freq))
    q = layers.apply_rope(q, cos, sin, interleaved=False)
    k = layers.apply_rope(k, cos, sin, interleaved=False)
    att, k_cache, v_cache = layers.cache_attention(q, k, v, state["k"], state["v"], slot, pos,
                                                   length, scale=cfg.attn_scale, window=window)
    att = att.reshape(b, s, cfg.n_heads * cfg.head_dim)
    x = x + norm(ops.linear(att, params["wo"], live).astype(x.dtype), "post_attn_norm")
    h = norm(x, "ffn_norm")
    gated = (jax.nn.gelu(ops.linear(h, params["w_gate"], live), approximate=True)
             * ops.linear(h, params["w_up"], live))
    x = x + norm(ops.linear(gated, params["w_down"], live).astype(x.dtype), "post_ffn_norm")
    return dict(carry, x=x), {"k": k_cache, "v": v_cache}


def _head(cfg: Gemma3Config, return_logits: bool, params: dict[str, Any], state: dict[str, Any],
          carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    h = layers.rms_norm_offset(layers.last_valid(carry["x"], carry["length"]), params["norm"],
                               cfg.rms_eps, cfg.norm_offset)
    logits = ops.linear(h, params["output"], carry["length"] > 0).astype(jnp.float32)
    if cfg.final_softcap:
        logits = jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    token = layers.sample_tokens(logits, carry["temperature"], carry["top_k"], carry["top_p"],
                                 carry["seed"], carry["pos"] + carry["length"])
    out = {"token": token}
    if return_logits:
        out["logits"] = logits
    return out, {}


# ---------------------------------------------------------------------------------------------
# The model


def _load_source(path: str, roots: Roots, dtype: str, quantized: bool,
                 headers: Headers | None) -> tuple[Gemma3Config, WeightTable, str]:
    src = open_source(path, roots, headers)
    if src.scheme == "gguf":
        cfg = _gguf_config(src.metadata, src.infos, path)
        return cfg, WeightTable(src, _NAMES["gguf"], dtype, family="Gemma 3",
                                quantized=quantized), "gguf"
    file = src.hf_directory / "config.json"
    cfg = _hf_config(json.loads(file.read_text()), path)
    prefix = next((p for p in _HF_PREFIXES if f"{p[0]}embed_tokens.weight" in src.infos), None)
    if prefix is None:
        raise SpecError(f"Hugging Face checkpoint '{path}': no text model's "
                        f"'embed_tokens.weight' under {[p for p, _ in _HF_PREFIXES]}; not a "
                        f"Gemma 3 checkpoint, or one laid out otherwise")
    return cfg, WeightTable(src, _NAMES["safetensors"], dtype, family="Gemma 3",
                            fields={"p": prefix[0], "h": prefix[1]}, quantized=quantized), "hf"


def _inv_freq(cfg: Gemma3Config, local: bool) -> np.ndarray:
    theta, kind, factor = ((cfg.rope_local_theta, cfg.rope_local_type, cfg.rope_local_factor)
                           if local else (cfg.rope_theta, cfg.rope_type, cfg.rope_factor))
    return layers.rope_inv_freq(cfg.head_dim, theta, rope_type=kind, factor=factor)


def gemma3_model(path: str | os.PathLike[str], *, roots: Roots, max_slots: int = 4,
                 max_seq: int = 512, dtype: str = "float32", return_logits: bool = False,
                 prefill_buckets: Sequence[int] = (16, 64, 128, 256), quantized: bool = True,
                 headers: Headers | None = None) -> Model:
    """Describe a Gemma 3 text model (GGUF file or HF directory) as jaxdist units.

    The arguments are those of :func:`jaxdist.exporters.llama.llama_model`: ``max_slots``
    sequences of up to ``max_seq`` positions in the KV cache, ``dtype`` for weights,
    activations and the cache, ``quantized`` to keep a GGUF's matrices packed, ``headers`` to
    read a GGUF's headers on a worker.

    Returns:
        The :class:`~jaxdist.export.model.Model`; ``meta`` holds ``config``, ``eos_ids``,
        ``bos_id``, ``max_slots``, ``max_seq``, ``prefill_buckets`` and ``tokenizer``.

    Raises:
        SpecError: bad options, another architecture, a refused feature (named), or a file
            disagreeing with its config.
        WeightError: the path is outside the roots or unreadable.
    """
    if dtype not in _DTYPES:
        raise SpecError(f"gemma3_model: dtype {dtype!r} is not supported; expected one of "
                        f"{list(_DTYPES)}")
    if max_slots < 1 or max_seq < 1:
        raise SpecError(f"gemma3_model: max_slots and max_seq must be >= 1, found {max_slots} "
                        f"and {max_seq}")
    path = os.fspath(path)
    cfg, w, kind = _load_source(path, roots, dtype, quantized, headers)
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise SpecError(f"'{path}': n_heads {cfg.n_heads} must be a multiple of n_kv_heads "
                        f"{cfg.n_kv_heads}, and head_dim {cfg.head_dim} even")
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    embed = w.param("embed", (cfg.vocab, d))
    units = [Unit("embed", functools.partial(_embed, cfg), {"embedding": embed})]
    blocks = {local: functools.partial(_block, cfg, _inv_freq(cfg, local),
                                       (cfg.sliding_window or 0) if local else 0)
              for local in (False, True)}
    cache_shape = (layers.cache_shape(max_slots, max_seq, cfg.n_kv_heads, hd), dtype)
    for i, local in enumerate(cfg.local_layers):
        p = {name: w.param(name, (n,), i) for name, n in (
            ("attn_norm", d), ("post_attn_norm", d), ("ffn_norm", d), ("post_ffn_norm", d),
            ("q_norm", hd), ("k_norm", hd))}
        p |= {name: w.param(name, shape, i, transpose=True) for name, shape in (
            ("wq", (d, q_dim)), ("wk", (d, kv_dim)), ("wv", (d, kv_dim)), ("wo", (q_dim, d)),
            ("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d)))}
        units.append(Unit(f"blk.{i}", blocks[local], p, {"k": cache_shape, "v": cache_shape}))
    if cfg.tied or not w.has("output"):
        if not cfg.tied:
            raise SpecError(f"'{path}': the config says the embeddings are not tied, but the "
                            f"output projection '{w.name('output')}' is missing")
        output = dataclasses.replace(embed, shape=(d, cfg.vocab), transpose=True)
    else:
        output = w.param("output", (d, cfg.vocab), transpose=True)
    units.append(Unit("head", functools.partial(_head, cfg, return_logits),
                      {"norm": w.param("norm", (d,)), "output": output}))
    prefill = tuple(int(n) for n in prefill_buckets if 1 <= int(n) <= max_seq)
    meta = {"family": "gemma3", "config": cfg, "eos_ids": cfg.eos_ids, "bos_id": cfg.bos_id,
            "max_slots": max_slots, "max_seq": max_seq, "prefill_buckets": prefill,
            "prefill_rows": prefill_rows(max_slots, prefill),
            "tokenizer": {kind: path}, "return_logits": return_logits}
    return Model(Path(path).name or path, units, step_signature(),
                 buckets=step_buckets(max_slots, prefill), meta=meta, control=STEP_CONTROL)


def _with_template(tokenizer: Tokenizer | None, where: str) -> Tokenizer | None:
    """The tokenizer, given :data:`CHAT_TEMPLATE` when its file carries none."""
    if tokenizer is None or tokenizer.chat_template is not None:
        return tokenizer
    log.info("'%s' carries no chat template; using Gemma 3's (gemma3.CHAT_TEMPLATE)", where)
    return tokenizer.with_chat_template(CHAT_TEMPLATE)


class _Gemma3Exporter:
    """The ``jaxdist.exporters`` entry point for Gemma 3 text models (jaxdist.export.plugins)."""

    name = "gemma3"
    kind = "causal-lm"
    architectures = frozenset({"gemma3", _CAUSAL, _CONDITIONAL})

    def load(self, path: str, *, roots: Roots, headers: Headers | None = None, **options: Any
             ) -> LoadedModel:
        model = gemma3_model(path, roots=roots, headers=headers, **options)
        meta = model.meta
        if headers is not None:
            tokenizer = gguf_tokenizer(headers.metadata(path), path)
        else:
            root_path = next((Path(r) / path for r in roots if (Path(r) / path).exists()),
                             Path(path))
            tokenizer = load_tokenizer(root_path)
        tokenizer = _with_template(tokenizer, path)
        # <end_of_turn> ends a chat turn: the tokenizer knows it as an end-of-generation token.
        extra = tokenizer.eos_ids if tokenizer is not None else ()
        lm = CausalLM(max_slots=meta["max_slots"], max_seq=meta["max_seq"],
                      prefill_buckets=meta["prefill_buckets"],
                      prefill_rows=meta["prefill_rows"],
                      input_dtypes={k: dtype for k, (_, dtype) in model.inputs.items()},
                      eos_ids=tuple(dict.fromkeys([*meta["eos_ids"], *sorted(extra)])),
                      extra={"bos_id": meta["bos_id"]})
        return LoadedModel(model, "causal-lm", tokenizer, "gemma3", causal_lm=lm)


EXPORTER = _Gemma3Exporter()
