"""GPT-2 decoder exporter, from a Hugging Face ``GPT2LMHeadModel`` directory or a ``gpt2`` GGUF.

Same step contract and unit names as :mod:`jaxdist.exporters.llama` (``embed``, ``blk.0`` ...
``blk.{L-1}``, ``head``; inputs ``tokens``, ``slot``, ``pos``, ``length``, ``temperature``,
``top_k``, ``top_p``, ``seed``; output ``token`` and optionally ``logits``), so
:class:`jaxdist.coordinator.generation.Generator` drives it unchanged. What differs from Llama:

* Learned absolute position embeddings (``wpe``), gathered in ``embed`` at ``pos + i``; so
  ``max_seq`` may not exceed the model's ``n_positions``.
* Pre-LayerNorm with bias, biased projections, a GELU MLP (``gelu_new``: the tanh approximation),
  one fused ``c_attn`` (``(d, 3d)``, split into q | k | v after the matmul), no RoPE, and a head
  tied to the token embedding.
* Layout: Hugging Face's ``Conv1D`` stores its weights ``(in, out)`` already, so they are bound as
  is. llama.cpp's converter transposes them when it writes GGUF (``(out, in)`` in NumPy order),
  so GGUF matrices are bound with ``transpose=True``. Either way each projection is ``x @ W``.

Example:
    >>> model = gpt2_model("gpt2", roots=[root], max_seq=256)               # doctest: +SKIP
    >>> pipe = InProcessPipeline(model, weights_roots=[root], stages=2)    # doctest: +SKIP
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

from jaxdist.core.errors import SpecError
from jaxdist.core.weights import WeightInfo
from jaxdist.core.weights.gguf import metadata as gguf_metadata
from jaxdist.core.weights.uri import resolve_path
from jaxdist.export.buckets import prefill_rows, step_buckets
from jaxdist.export.causal_lm import STEP_CONTROL, CausalLM, step_signature
from jaxdist.export.model import Model, Param, Unit
from jaxdist.export.plugins import LoadedModel
from jaxdist.exporters import layers
from jaxdist.exporters.source import Headers, Source, WeightTable, open_source
from jaxdist.exporters.tokenizer import gguf_tokenizer, load_tokenizer

__all__ = ["EXPORTER", "GPT2Config", "gpt2_model"]

Roots = Sequence[str | os.PathLike[str]]

_DTYPES = ("float32", "bfloat16", "float16")
# Hugging Face activation_function -> use the tanh approximation of GELU?
_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}

# Logical weight name -> tensor name. ``{i}`` is the layer index; ``{p}`` the HF prefix
# (``transformer.`` for GPT2LMHeadModel checkpoints, empty for the original ``gpt2`` upload).
_NAMES = {
    "gguf": {
        "wte": "token_embd.weight", "wpe": "position_embd.weight", "output": "output.weight",
        "ln_f_w": "output_norm.weight", "ln_f_b": "output_norm.bias",
        "ln1_w": "blk.{i}.attn_norm.weight", "ln1_b": "blk.{i}.attn_norm.bias",
        "w_qkv": "blk.{i}.attn_qkv.weight", "b_qkv": "blk.{i}.attn_qkv.bias",
        "w_o": "blk.{i}.attn_output.weight", "b_o": "blk.{i}.attn_output.bias",
        "ln2_w": "blk.{i}.ffn_norm.weight", "ln2_b": "blk.{i}.ffn_norm.bias",
        "w_up": "blk.{i}.ffn_up.weight", "b_up": "blk.{i}.ffn_up.bias",
        "w_down": "blk.{i}.ffn_down.weight", "b_down": "blk.{i}.ffn_down.bias",
    },
    "safetensors": {
        "wte": "{p}wte.weight", "wpe": "{p}wpe.weight", "output": "lm_head.weight",
        "ln_f_w": "{p}ln_f.weight", "ln_f_b": "{p}ln_f.bias",
        "ln1_w": "{p}h.{i}.ln_1.weight", "ln1_b": "{p}h.{i}.ln_1.bias",
        "w_qkv": "{p}h.{i}.attn.c_attn.weight", "b_qkv": "{p}h.{i}.attn.c_attn.bias",
        "w_o": "{p}h.{i}.attn.c_proj.weight", "b_o": "{p}h.{i}.attn.c_proj.bias",
        "ln2_w": "{p}h.{i}.ln_2.weight", "ln2_b": "{p}h.{i}.ln_2.bias",
        "w_up": "{p}h.{i}.mlp.c_fc.weight", "b_up": "{p}h.{i}.mlp.c_fc.bias",
        "w_down": "{p}h.{i}.mlp.c_proj.weight", "b_down": "{p}h.{i}.mlp.c_proj.bias",
    },
}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Hyperparameters of a GPT-2 decoder, as read from a file's metadata."""

    vocab: int                     # rows of the token embedding
    d_model: int                   # residual width (n_embd)
    n_layers: int                  # decoder blocks (n_layer)
    n_heads: int                   # attention heads (n_head); keys/values have as many
    ffn_dim: int                   # MLP hidden width (n_inner, default 4 * d_model)
    max_position: int              # rows of the position embedding (n_positions)
    ln_eps: float                  # LayerNorm epsilon
    gelu_tanh: bool = True         # gelu_new (tanh approximation), else exact erf GELU
    bos_id: int | None = None      # beginning-of-sequence token, if known
    eos_ids: tuple[int, ...] = ()  # tokens that end generation, if known

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str]) -> GPT2Config:
        """Read the config from a Hugging Face checkpoint directory's ``config.json``.

        Raises:
            SpecError: no ``config.json``, another architecture, or an unsupported option.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise SpecError(f"Hugging Face checkpoint '{path}': no config.json found; expected a "
                            f"directory saved with save_pretrained")
        return _hf_config(json.loads(file.read_text()), str(path))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], roots: Roots) -> GPT2Config:
        """Read the config from a GGUF header (arch ``gpt2``) under ``roots``.

        Raises:
            SpecError: another architecture, or a missing key.
            WeightError: the file is outside the roots, missing, or not GGUF.
        """
        src = open_source(os.fspath(path), roots)
        return _gguf_config(src.metadata, src.infos, str(path))


def _hf_config(cfg: Mapping[str, Any], where: str) -> GPT2Config:
    archs = cfg.get("architectures") or []
    if not ("GPT2LMHeadModel" in archs or (not archs and cfg.get("model_type") == "gpt2")):
        raise SpecError(f"Hugging Face checkpoint '{where}': architectures {archs} are not "
                        f"supported by the gpt2 exporter; expected ['GPT2LMHeadModel']")
    act = cfg.get("activation_function", "gelu_new")
    unsupported = [] if act in _ACTIVATIONS else [f"activation_function={act}"]
    if not cfg.get("scale_attn_weights", True):
        unsupported.append("scale_attn_weights=False")
    if cfg.get("scale_attn_by_inverse_layer_idx", False):
        unsupported.append("scale_attn_by_inverse_layer_idx=True")
    if not cfg.get("tie_word_embeddings", True):
        unsupported.append("tie_word_embeddings=False")
    if unsupported:
        raise SpecError(f"Hugging Face checkpoint '{where}': {unsupported} not supported by the "
                        f"gpt2 exporter")
    d = int(cfg["n_embd"])
    eos = cfg.get("eos_token_id")
    return GPT2Config(
        vocab=int(cfg["vocab_size"]), d_model=d, n_layers=int(cfg["n_layer"]),
        n_heads=int(cfg["n_head"]), ffn_dim=int(cfg.get("n_inner") or 4 * d),
        max_position=int(cfg.get("n_positions", 1024)),
        ln_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), gelu_tanh=_ACTIVATIONS[act],
        bos_id=cfg.get("bos_token_id"),
        eos_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)))


def _gguf_config(meta: Mapping[str, Any], infos: Mapping[str, WeightInfo], where: str
                 ) -> GPT2Config:
    arch = meta.get("general.architecture")
    if arch != "gpt2":
        raise SpecError(f"GGUF '{where}': architecture {arch!r} is not supported by the gpt2 "
                        f"exporter; expected 'gpt2'")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"gpt2.{name}", default)
        if value is None:
            raise SpecError(f"GGUF '{where}': metadata key 'gpt2.{name}' is missing")
        return value

    if "token_embd.weight" not in infos:
        raise SpecError(f"GGUF '{where}': tensor 'token_embd.weight' is missing")
    d = int(key("embedding_length"))
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if k in meta]
    return GPT2Config(
        vocab=infos["token_embd.weight"].shape[0], d_model=d, n_layers=int(key("block_count")),
        n_heads=int(key("attention.head_count")),
        ffn_dim=int(key("feed_forward_length", 4 * d)),
        max_position=int(key("context_length")),
        ln_eps=float(key("attention.layer_norm_epsilon", 1e-5)),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_ids=tuple(dict.fromkeys(int(e) for e in eos)))


# ---------------------------------------------------------------------------------------------
# Units


def _embed(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    tokens = carry["tokens"]
    out = {k: v for k, v in carry.items() if k != "tokens"}
    positions = layers.step_positions(carry["pos"], tokens)
    # Idle rows (pos = max_seq) may point past the table: clip instead of reading garbage/NaN.
    out["x"] = params["wte"][tokens] + jnp.take(params["wpe"], positions, axis=0, mode="clip")
    return out, {}


def _block(cfg: GPT2Config, params: dict[str, Any], state: dict[str, Any],
           carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    x = carry["x"]
    b, s = x.shape[0], x.shape[1]
    heads = (b, s, cfg.n_heads, cfg.head_dim)
    h = layers.layer_norm(x, params["ln1_w"], params["ln1_b"], cfg.ln_eps)
    q, k, v = jnp.split(h @ params["w_qkv"] + params["b_qkv"], 3, axis=-1)
    att, k_cache, v_cache = layers.cache_attention(
        q.reshape(heads), k.reshape(heads), v.reshape(heads), state["k"], state["v"],
        carry["slot"], carry["pos"], carry["length"])
    x = x + att.reshape(b, s, cfg.d_model) @ params["w_o"] + params["b_o"]
    h = layers.layer_norm(x, params["ln2_w"], params["ln2_b"], cfg.ln_eps)
    h = jax.nn.gelu(h @ params["w_up"] + params["b_up"], approximate=cfg.gelu_tanh)
    x = x + h @ params["w_down"] + params["b_down"]
    return dict(carry, x=x), {"k": k_cache, "v": v_cache}


def _head(cfg: GPT2Config, return_logits: bool, params: dict[str, Any], state: dict[str, Any],
          carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    h = layers.layer_norm(layers.last_valid(carry["x"], carry["length"]), params["ln_f_w"],
                          params["ln_f_b"], cfg.ln_eps)
    logits = (h @ params["output"]).astype(jnp.float32)
    token = layers.sample_tokens(logits, carry["temperature"], carry["top_k"], carry["top_p"],
                                 carry["seed"], carry["pos"] + carry["length"])
    out = {"token": token}
    if return_logits:
        out["logits"] = logits
    return out, {}


# ---------------------------------------------------------------------------------------------
# The model


class _Weights(WeightTable):
    """GPT-2's weight table: GGUF matrices are (out, in) in NumPy order and bound transposed;
    HF Conv1D weights are (in, out) already. Checkpoints may prefix names with ``transformer.``."""

    def __init__(self, source: Source, dtype: str) -> None:
        prefix = "transformer." if "transformer.wte.weight" in source.infos else ""
        super().__init__(source, _NAMES[source.scheme], dtype, family="GPT-2",
                         fields={"p": prefix})

    def param(self, logical: str, shape: tuple[int, ...], i: int = 0, *,
              transpose: bool | None = None, j: int = 0) -> Param:
        if transpose is None:
            transpose = self.scheme == "gguf" and len(shape) == 2 and logical.startswith("w_")
        return super().param(logical, shape, i, transpose=transpose, j=j)


def _load_source(path: str, roots: Roots, dtype: str, headers: Headers | None = None
                 ) -> tuple[GPT2Config, _Weights, str]:
    src = open_source(path, roots, headers)
    if src.scheme == "gguf":
        cfg = _gguf_config(src.metadata, src.infos, path)
    else:
        cfg = GPT2Config.from_hf(src.hf_directory)
    return cfg, _Weights(src, dtype), "gguf" if src.scheme == "gguf" else "hf"


def gpt2_model(path: str | os.PathLike[str], *, roots: Roots, max_slots: int = 4,
               max_seq: int = 512, dtype: str = "float32", return_logits: bool = False,
               prefill_buckets: Sequence[int] = (16, 64, 128, 256), quantized: bool = False,
               headers: Headers | None = None) -> Model:
    """Describe a GPT-2 model (GGUF file or HF directory) as jaxdist units.

    GGUF weights are dequantized when bound: ``quantized=True`` (the packed path of the llama
    exporter) is not implemented for GPT-2 and is refused.

    Args:
        path: a ``.gguf`` file or a Hugging Face checkpoint directory, relative to a weights root
            or absolute under one; the URIs use it as given.
        roots: weight roots to read the headers from (the workers must hold the same files).
        max_slots: sequences the KV cache of each block holds at once.
        max_seq: positions per slot; at most the model's ``n_positions``.
        dtype: weight, activation and KV-cache dtype (``float32``, ``bfloat16``, ``float16``);
            LayerNorm, attention scores and logits are computed in float32.
        return_logits: the head also returns the last position's ``logits (b, vocab)``.
        prefill_buckets: prompt lengths compiled ahead of time, besides decode: one prompt
            per step at each, and several at the smallest (see
            :func:`jaxdist.export.buckets.step_buckets`).
        headers: read a GGUF file's headers there instead of under ``roots`` (see
            :func:`jaxdist.exporters.source.open_source`).

    Returns:
        The :class:`~jaxdist.export.model.Model`; ``meta`` holds ``config``, ``eos_ids``, ``bos_id``,
        ``max_slots``, ``max_seq``, ``prefill_buckets`` and ``tokenizer``.

    Raises:
        SpecError: bad options, an unsupported architecture, or a file disagreeing with its config.
        WeightError: the path is outside the roots or unreadable.
    """
    if dtype not in _DTYPES:
        raise SpecError(f"gpt2_model: dtype {dtype!r} is not supported; expected one of "
                        f"{list(_DTYPES)}")
    if quantized:
        raise SpecError("gpt2_model: quantized=True (GGUF blocks bound as stored) is not "
                        "implemented for GPT-2; its weights are dequantized when bound")
    if max_slots < 1 or max_seq < 1:
        raise SpecError(f"gpt2_model: max_slots and max_seq must be >= 1, found {max_slots} "
                        f"and {max_seq}")
    path = os.fspath(path)
    cfg, w, kind = _load_source(path, roots, dtype, headers)
    if cfg.d_model % cfg.n_heads:
        raise SpecError(f"'{path}': n_embd {cfg.d_model} is not a multiple of n_head "
                        f"{cfg.n_heads}")
    if max_seq > cfg.max_position:
        raise SpecError(f"gpt2_model: max_seq {max_seq} exceeds the {cfg.max_position} learned "
                        f"positions of '{path}'; pass max_seq <= {cfg.max_position}")
    d, f = cfg.d_model, cfg.ffn_dim
    wte = w.param("wte", (cfg.vocab, d))
    units = [Unit("embed", _embed, {"wte": wte, "wpe": w.param("wpe", (cfg.max_position, d))})]
    block_fn = functools.partial(_block, cfg)
    cache_shape = (layers.cache_shape(max_slots, max_seq, cfg.n_heads, cfg.head_dim), dtype)
    for i in range(cfg.n_layers):
        p = {"ln1_w": w.param("ln1_w", (d,), i), "ln1_b": w.param("ln1_b", (d,), i),
             "w_qkv": w.param("w_qkv", (d, 3 * d), i), "b_qkv": w.param("b_qkv", (3 * d,), i),
             "w_o": w.param("w_o", (d, d), i), "b_o": w.param("b_o", (d,), i),
             "ln2_w": w.param("ln2_w", (d,), i), "ln2_b": w.param("ln2_b", (d,), i),
             "w_up": w.param("w_up", (d, f), i), "b_up": w.param("b_up", (f,), i),
             "w_down": w.param("w_down", (f, d), i), "b_down": w.param("b_down", (d,), i)}
        units.append(Unit(f"blk.{i}", block_fn, p, {"k": cache_shape, "v": cache_shape}))
    # llama.cpp's converter may write a copy of the embedding as output.weight; both are tied.
    if w.has("output"):
        output = dataclasses.replace(w.param("output", (cfg.vocab, d)), shape=(d, cfg.vocab),
                                     transpose=True)
    else:
        output = dataclasses.replace(wte, shape=(d, cfg.vocab), transpose=True)
    units.append(Unit("head", functools.partial(_head, cfg, return_logits),
                      {"ln_f_w": w.param("ln_f_w", (d,)), "ln_f_b": w.param("ln_f_b", (d,)),
                       "output": output}))
    prefill = tuple(int(n) for n in prefill_buckets if 1 <= int(n) <= max_seq)
    buckets = step_buckets(max_slots, prefill)
    inputs = step_signature()
    meta = {"family": "gpt2", "config": cfg, "eos_ids": cfg.eos_ids, "bos_id": cfg.bos_id,
            "max_slots": max_slots, "max_seq": max_seq, "prefill_buckets": prefill,
            "prefill_rows": prefill_rows(max_slots, prefill),
            "tokenizer": {kind: path}, "return_logits": return_logits}
    return Model(Path(path).name or path, units, inputs, buckets=buckets, meta=meta,
                 control=STEP_CONTROL)


@dataclasses.dataclass(frozen=True)
class _GPT2Exporter:
    """The ``jaxdist.exporters`` plugin for GPT-2 (see :mod:`jaxdist.export.plugins`)."""

    name: str = "gpt2"
    kind: str = "causal-lm"
    architectures: frozenset[str] = frozenset({"gpt2", "GPT2LMHeadModel"})

    def load(self, path: str, *, roots: Sequence[str], headers: Headers | None = None,
             **options: Any) -> LoadedModel:
        """Describe ``path`` (see :func:`gpt2_model` for ``options``) and load its tokenizer."""
        model = gpt2_model(path, roots=roots, headers=headers, **options)
        tokenizer: Any = None
        # A GGUF written without tokenizer metadata (tests, custom converters) has no tokenizer.
        if headers is not None:
            meta = headers.metadata(path)
            if "tokenizer.ggml.model" in meta:
                tokenizer = gguf_tokenizer(meta, path)
        else:
            real = resolve_path(path, roots)
            if real.suffix != ".gguf" or "tokenizer.ggml.model" in gguf_metadata(real):
                tokenizer = load_tokenizer(real)
        eos = dict.fromkeys(model.meta["eos_ids"])
        if tokenizer is not None:
            eos.update(dict.fromkeys(sorted(tokenizer.eos_ids)))
        arch = "gpt2" if Path(path).suffix == ".gguf" else "GPT2LMHeadModel"
        meta = model.meta
        lm = CausalLM(max_slots=meta["max_slots"], max_seq=meta["max_seq"],
                      prefill_buckets=meta["prefill_buckets"],
                      prefill_rows=meta["prefill_rows"],
                      input_dtypes={k: dtype for k, (_, dtype) in model.inputs.items()},
                      eos_ids=tuple(eos))
        return LoadedModel(model, kind="causal-lm", tokenizer=tokenizer, architecture=arch,
                           causal_lm=lm)


EXPORTER = _GPT2Exporter()
