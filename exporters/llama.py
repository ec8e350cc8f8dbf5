"""Llama-family decoder exporter (Llama, Mistral, Qwen2, SmolLM2) from GGUF or Hugging Face files.

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
* GGUF ``qwen2`` is written unpermuted and llama.cpp runs it in NeoX mode: halves.

Mistral checkpoints are Llama-architecture. Llama 3 RoPE scaling is supported (HF ``rope_type``
``llama3``, or GGUF's ``rope_freqs.weight`` factors, bound as a weight); so is ``linear``.

Example:
    >>> model = llama_model("SmolLM2-135M-Instruct.Q4_1.gguf", roots=[root])   # doctest: +SKIP
    >>> pipe = InProcessPipeline(model, weights_roots=[root], stages=2)       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
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
from jaxdist.exporters.tokenizer import gguf_tokenizer, load_tokenizer

__all__ = ["EXPORTER", "LlamaConfig", "llama_model"]

Roots = Sequence[str | os.PathLike[str]]

_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2"}
_GGUF_ARCHS = ("llama", "qwen2")
_DTYPES = ("float32", "bfloat16", "float16")

# Logical weight name -> tensor name, per file format. ``{i}`` is the layer index.
_NAMES = {
    "gguf": {
        "embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight",
        "rope_freqs": "rope_freqs.weight",
        "attn_norm": "blk.{i}.attn_norm.weight", "ffn_norm": "blk.{i}.ffn_norm.weight",
        "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight",
        "wv": "blk.{i}.attn_v.weight", "wo": "blk.{i}.attn_output.weight",
        "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias",
        "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
        "w_down": "blk.{i}.ffn_down.weight",
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
        "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
        "w_up": "model.layers.{i}.mlp.up_proj.weight",
        "w_down": "model.layers.{i}.mlp.down_proj.weight",
    },
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-family decoder, as read from a file's metadata."""

    arch: str                      # "llama" (also Mistral, SmolLM) or "qwen2"
    vocab: int                     # rows of the token embedding
    d_model: int                   # residual width
    n_layers: int                  # decoder blocks
    n_heads: int                   # query heads
    n_kv_heads: int                # key/value heads (grouped-query attention when < n_heads)
    head_dim: int                  # width of one head
    ffn_dim: int                   # SwiGLU hidden width
    rope_theta: float              # RoPE base frequency
    rms_eps: float                 # RMSNorm epsilon
    tied: bool                     # the output projection is the token embedding
    qkv_bias: bool                 # q/k/v projections carry a bias (Qwen2)
    max_position: int              # context length the model was trained for
    rope_interleaved: bool         # rotate adjacent pairs (GGUF llama), else halves (see module)
    rope_type: str = "default"     # "default", "linear", "llama3", or "freqs" (GGUF factor tensor)
    rope_factor: float = 1.0       # linear / llama3 scaling factor
    rope_low_freq_factor: float = 1.0    # llama3 only
    rope_high_freq_factor: float = 4.0   # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    sliding_window: int | None = None    # attention window (Mistral v0.1); None: full
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
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise SpecError(f"GGUF '{where}': partial RoPE (rope.dimension_count "
                        f"{key('rope.dimension_count')} != head_dim {head_dim}) is not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in infos:
        rope_type = "freqs"
    elif scaling in ("none", "linear"):
        rope_type = "default" if scaling == "none" else "linear"
    else:
        raise SpecError(f"GGUF '{where}': RoPE scaling {scaling!r} is not supported; expected "
                        f"none, linear, or llama3 factors (rope_freqs.weight)")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    return LlamaConfig(
        arch=arch, vocab=infos["token_embd.weight"].shape[0], d_model=d,
        n_layers=int(key("block_count")), n_heads=n_heads,
        n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=head_dim,
        ffn_dim=int(key("feed_forward_length")), rope_theta=float(key("rope.freq_base", 1e4)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tied="output.weight" not in infos, qkv_bias="blk.0.attn_q.bias" in infos,
        max_position=int(key("context_length", 2048)), rope_interleaved=(arch == "llama"),
        rope_type=rope_type, rope_factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos)))


def _hf_config(cfg: Mapping[str, Any], where: str) -> LlamaConfig:
    archs = cfg.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise SpecError(f"Hugging Face checkpoint '{where}': architectures {archs} are not "
                        f"supported by the llama exporter; expected one of {list(_HF_ARCHS)}")
    unsupported = [k for k in ("attention_bias", "mlp_bias") if arch == "llama" and cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']}")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if rope_type not in ("default", "linear", "llama3"):
        unsupported.append(f"rope_type={rope_type}")
    if unsupported:
        raise SpecError(f"Hugging Face checkpoint '{where}': {unsupported} not supported by the "
                        f"llama exporter")
    d, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    window = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    eos = cfg.get("eos_token_id")
    return LlamaConfig(
        arch=arch, vocab=int(cfg["vocab_size"]), d_model=d,
        n_layers=int(cfg["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or d // n_heads),
        ffn_dim=int(cfg["intermediate_size"]),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=(arch == "qwen2"),
        max_position=int(cfg.get("max_position_embeddings", 2048)), rope_interleaved=False,
        rope_type=rope_type, rope_factor=float(rope.get("factor", 1.0)),
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
        sliding_window=int(window) if window else None, bos_id=cfg.get("bos_token_id"),
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
    q, k, v = (ops.linear(h, params[n], live) for n in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q, k, v = q + params["bq"], k + params["bk"], v + params["bv"]
    q = q.reshape(b, s, cfg.n_heads, cfg.head_dim)
    k = k.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    inv = jnp.asarray(inv_freq)
    if "rope_freqs" in params:
        inv = inv / params["rope_freqs"].astype(jnp.float32)
    cos, sin = layers.rope_angles(layers.step_positions(pos, x), inv)
    q = layers.apply_rope(q, cos, sin, interleaved=cfg.rope_interleaved)
    k = layers.apply_rope(k, cos, sin, interleaved=cfg.rope_interleaved)
    att, k_cache, v_cache = layers.cache_attention(q, k, v, state["k"], state["v"], slot, pos,
                                                   length)
    att = att.reshape(b, s, cfg.n_heads * cfg.head_dim)
    x = x + ops.linear(att, params["wo"], live).astype(x.dtype)
    h = layers.rms_norm(x, params["ffn_norm"], cfg.rms_eps)
    gated = (jax.nn.silu(ops.linear(h, params["w_gate"], live))
             * ops.linear(h, params["w_up"], live))
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
    table = WeightTable(src, _NAMES[src.scheme], dtype, family="llama-family",
                        quantized=quantized)
    return cfg, table, kind


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
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 2:
        raise SpecError(f"'{path}': n_heads {cfg.n_heads} must be a multiple of n_kv_heads "
                        f"{cfg.n_kv_heads}, and head_dim {cfg.head_dim} even")
    if cfg.sliding_window is not None and max_seq > cfg.sliding_window:
        raise SpecError(f"'{path}': sliding-window attention ({cfg.sliding_window}) is not "
                        f"implemented; pass max_seq <= {cfg.sliding_window} to stay exact")
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.n_kv_heads * hd
    embed = w.param("embed", (cfg.vocab, d))
    units = [Unit("embed", _embed, {"embedding": embed})]
    # "freqs": the GGUF's per-frequency factors are bound as a weight and divided in-graph.
    inv_freq = layers.rope_inv_freq(
        hd, cfg.rope_theta, rope_type="default" if cfg.rope_type == "freqs" else cfg.rope_type,
        factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_position=cfg.rope_original_max_position)
    block_fn = functools.partial(_block, cfg, inv_freq)
    cache_shape = (layers.cache_shape(max_slots, max_seq, cfg.n_kv_heads, hd), dtype)
    for i in range(cfg.n_layers):
        p = {"attn_norm": w.param("attn_norm", (d,), i),
             "wq": w.param("wq", (d, q_dim), i, transpose=True),
             "wk": w.param("wk", (d, kv_dim), i, transpose=True),
             "wv": w.param("wv", (d, kv_dim), i, transpose=True),
             "wo": w.param("wo", (q_dim, d), i, transpose=True),
             "ffn_norm": w.param("ffn_norm", (d,), i),
             "w_gate": w.param("w_gate", (d, f), i, transpose=True),
             "w_up": w.param("w_up", (d, f), i, transpose=True),
             "w_down": w.param("w_down", (f, d), i, transpose=True)}
        if cfg.qkv_bias:
            p |= {"bq": w.param("bq", (q_dim,), i), "bk": w.param("bk", (kv_dim,), i),
                  "bv": w.param("bv", (kv_dim,), i)}
        if cfg.rope_type == "freqs":
            p["rope_freqs"] = dataclasses.replace(w.param("rope_freqs", (hd // 2,)),
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
    architectures = frozenset({"llama", "qwen2", *_HF_ARCHS})

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
