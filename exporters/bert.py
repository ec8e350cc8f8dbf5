"""BERT sentence-encoder exporter (all-MiniLM-L6-v2 and kin) from a Hugging Face directory.

Units: ``embed`` (word + position + token-type embeddings, LayerNorm), ``layer.0`` ...
``layer.{L-1}`` (post-LayerNorm BERT layers, exact erf GELU), and ``pool`` (mean over the
attention mask, or the ``[CLS]`` vector, then optionally L2-normalised), as sentence-transformers
runs the model. There is no per-session state: each call is one independent batch.

Inputs: ``input_ids (b, s) int32`` and ``attention_mask (b, s) int32`` (1 for tokens, 0 for
right padding), with ``s <= max_position``: a symbolic constraint of the export, so a longer
input fails the stage's shape check instead of reading clipped positions; callers truncate to
``meta["max_length"]``. Token types are all 0 (single-segment sentences), so the ``token_type``
table's first row is added in-graph rather than shipped as an input. Output:
``embedding (b, d) float32``.

Pooling follows the directory's sentence-transformers files when they exist: ``modules.json``
names the modules (a Pooling module's ``config.json`` gives the mode, a Normalize module turns on
L2 normalisation) and ``sentence_bert_config.json`` gives ``max_seq_length``, which becomes the
``max_length`` callers truncate to. Without them the default is mean pooling plus normalisation.
Modules this exporter cannot reproduce (Dense, max pooling, ...) are refused, never skipped.

HF ``nn.Linear`` weights are stored ``(out, in)`` and are bound with ``transpose=True``.

Example:
    >>> model = bert_model("all-MiniLM-L6-v2", roots=[root])               # doctest: +SKIP
    >>> pipe = InProcessPipeline(model, weights_roots=[root], stages=2)   # doctest: +SKIP
    >>> pipe.call(input_ids=ids, attention_mask=mask)["embedding"]       # doctest: +SKIP
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
from jax import lax

from jaxdist.core.errors import SpecError
from jaxdist.core.weights import WeightCache, WeightInfo
from jaxdist.core.weights.uri import resolve_path
from jaxdist.export.model import Model, Param, Unit
from jaxdist.export.plugins import LoadedModel
from jaxdist.exporters import layers
from jaxdist.exporters.tokenizer import load_tokenizer

__all__ = ["EXPORTER", "BertConfig", "bert_model"]

Roots = Sequence[str | os.PathLike[str]]

_ARCHS = ("BertModel", "BertForMaskedLM")
_DTYPES = ("float32", "bfloat16", "float16")
_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}
_POOLINGS = ("mean", "cls")
_MASKED = float(jnp.finfo(jnp.float32).min)

# Logical weight name -> tensor name; ``{p}`` is ``bert.`` for task models, ``{i}`` the layer.
_NAMES = {
    "word": "{p}embeddings.word_embeddings.weight",
    "position": "{p}embeddings.position_embeddings.weight",
    "token_type": "{p}embeddings.token_type_embeddings.weight",
    "emb_ln_w": "{p}embeddings.LayerNorm.weight", "emb_ln_b": "{p}embeddings.LayerNorm.bias",
    "wq": "{p}encoder.layer.{i}.attention.self.query.weight",
    "bq": "{p}encoder.layer.{i}.attention.self.query.bias",
    "wk": "{p}encoder.layer.{i}.attention.self.key.weight",
    "bk": "{p}encoder.layer.{i}.attention.self.key.bias",
    "wv": "{p}encoder.layer.{i}.attention.self.value.weight",
    "bv": "{p}encoder.layer.{i}.attention.self.value.bias",
    "wo": "{p}encoder.layer.{i}.attention.output.dense.weight",
    "bo": "{p}encoder.layer.{i}.attention.output.dense.bias",
    "ln1_w": "{p}encoder.layer.{i}.attention.output.LayerNorm.weight",
    "ln1_b": "{p}encoder.layer.{i}.attention.output.LayerNorm.bias",
    "w_up": "{p}encoder.layer.{i}.intermediate.dense.weight",
    "b_up": "{p}encoder.layer.{i}.intermediate.dense.bias",
    "w_down": "{p}encoder.layer.{i}.output.dense.weight",
    "b_down": "{p}encoder.layer.{i}.output.dense.bias",
    "ln2_w": "{p}encoder.layer.{i}.output.LayerNorm.weight",
    "ln2_b": "{p}encoder.layer.{i}.output.LayerNorm.bias",
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Hyperparameters of a BERT encoder and of the sentence pooling on top of it."""

    vocab: int                 # rows of the word embedding
    d_model: int               # hidden width
    n_layers: int              # encoder layers
    n_heads: int               # attention heads
    ffn_dim: int               # intermediate (GELU) width
    max_position: int          # rows of the position embedding
    type_vocab: int            # rows of the token-type embedding
    ln_eps: float              # LayerNorm epsilon
    gelu_tanh: bool = False    # hidden_act gelu_new (tanh approximation); BERT uses exact erf
    pooling: str = "mean"      # "mean" over the attention mask, or "cls" (the first token)
    normalize: bool = True     # L2-normalise the pooled vector
    max_length: int = 512      # tokens per input callers should truncate to

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_hf(cls, path: str | os.PathLike[str]) -> BertConfig:
        """Read ``config.json`` and the sentence-transformers files of a checkpoint directory.

        Raises:
            SpecError: no ``config.json``, another architecture, or an unsupported option or
                sentence-transformers module.
        """
        d = Path(path)
        if not (d / "config.json").is_file():
            raise SpecError(f"Hugging Face checkpoint '{d}': no config.json found; expected a "
                            f"directory saved with save_pretrained")
        cfg = _read_json(d / "config.json")
        archs = cfg.get("architectures") or []
        if not (any(a in _ARCHS for a in archs) or (not archs and cfg.get("model_type") == "bert")):
            raise SpecError(f"Hugging Face checkpoint '{d}': architectures {archs} are not "
                            f"supported by the bert exporter; expected one of {list(_ARCHS)}")
        act = cfg.get("hidden_act", "gelu")
        unsupported = [] if act in _ACTIVATIONS else [f"hidden_act={act}"]
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            unsupported.append(f"position_embedding_type={cfg['position_embedding_type']}")
        if unsupported:
            raise SpecError(f"Hugging Face checkpoint '{d}': {unsupported} not supported by the "
                            f"bert exporter")
        max_position = int(cfg.get("max_position_embeddings", 512))
        pooling, normalize = _sentence_pooling(d)
        st_max = _read_json(d / "sentence_bert_config.json").get("max_seq_length")
        return cls(
            vocab=int(cfg["vocab_size"]), d_model=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]), n_heads=int(cfg["num_attention_heads"]),
            ffn_dim=int(cfg["intermediate_size"]), max_position=max_position,
            type_vocab=int(cfg.get("type_vocab_size", 2)),
            ln_eps=float(cfg.get("layer_norm_eps", 1e-12)), gelu_tanh=_ACTIVATIONS[act],
            pooling=pooling, normalize=normalize,
            max_length=min(int(st_max), max_position) if st_max else max_position)


def _read_json(file: Path) -> Any:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise SpecError(f"'{file}' is not valid JSON: {exc}") from None


def _sentence_pooling(d: Path) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' ``modules.json``; default mean + L2."""
    modules = _read_json(d / "modules.json")
    if not modules:
        return "mean", True
    pooling, normalize = "mean", False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer" and m.get("path", "") in ("", "."):
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            conf = _read_json(d / m.get("path", "") / "config.json")
            modes = [k.removeprefix("pooling_mode_") for k, v in conf.items()
                     if k.startswith("pooling_mode_") and v]
            found = {"mean_tokens": "mean", "cls_token": "cls"}
            if len(modes) != 1 or modes[0] not in found:
                raise SpecError(f"sentence-transformers '{d}': pooling modes {modes} are not "
                                f"supported; expected exactly one of {list(found)}")
            pooling = found[modes[0]]
        else:
            raise SpecError(f"sentence-transformers '{d}': module {m.get('type')!r} "
                            f"(path {m.get('path')!r}) is not supported by the bert exporter; "
                            f"expected Transformer, Pooling and Normalize")
    return pooling, normalize


# ---------------------------------------------------------------------------------------------
# Units


def _embed(cfg: BertConfig, params: dict[str, Any], state: dict[str, Any],
           carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    ids = carry["input_ids"]
    positions = lax.broadcasted_iota(jnp.int32, ids.shape, 1)
    x = (params["word"][ids] + jnp.take(params["position"], positions, axis=0, mode="clip")
         + params["token_type"][0])
    x = layers.layer_norm(x, params["ln_w"], params["ln_b"], cfg.ln_eps)
    return {"x": x, "attention_mask": carry["attention_mask"]}, {}


def _layer(cfg: BertConfig, params: dict[str, Any], state: dict[str, Any],
           carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    x, mask = carry["x"], carry["attention_mask"]
    b, s = x.shape[0], x.shape[1]
    heads = (b, s, cfg.n_heads, cfg.head_dim)
    q = (x @ params["wq"] + params["bq"]).reshape(heads).astype(jnp.float32)
    k = (x @ params["wk"] + params["bk"]).reshape(heads).astype(jnp.float32)
    v = (x @ params["wv"] + params["bv"]).reshape(heads).astype(jnp.float32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * cfg.head_dim ** -0.5, k)
    scores = jnp.where(mask[:, None, None, :] > 0, scores, _MASKED)
    ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    ctx = ctx.reshape(b, s, cfg.d_model).astype(x.dtype)
    x = layers.layer_norm(x + ctx @ params["wo"] + params["bo"], params["ln1_w"],
                          params["ln1_b"], cfg.ln_eps)
    h = jax.nn.gelu(x @ params["w_up"] + params["b_up"], approximate=cfg.gelu_tanh)
    x = layers.layer_norm(x + h @ params["w_down"] + params["b_down"], params["ln2_w"],
                          params["ln2_b"], cfg.ln_eps)
    return dict(carry, x=x), {}


def _pool(cfg: BertConfig, params: dict[str, Any], state: dict[str, Any],
          carry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    x = carry["x"].astype(jnp.float32)
    if cfg.pooling == "cls":
        emb = x[:, 0]
    else:  # sentence-transformers: sum of unmasked vectors / max(count, 1e-9)
        m = carry["attention_mask"].astype(jnp.float32)[..., None]
        emb = jnp.sum(x * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    if cfg.normalize:  # torch.nn.functional.normalize: x / max(||x||, 1e-12)
        emb = emb / jnp.maximum(jnp.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
    return {"embedding": emb}, {}


# ---------------------------------------------------------------------------------------------
# The model


def _find_dir(path: str, roots: Roots) -> Path:
    directory = resolve_path(path, roots)  # refuses anything outside the roots
    if not (directory / "config.json").is_file():
        raise SpecError(f"'{path}': expected a Hugging Face directory with config.json under "
                        f"the weight roots {[os.fspath(r) for r in roots]}")
    return directory


def bert_model(path: str | os.PathLike[str], *, roots: Roots, dtype: str = "float32",
               buckets: Sequence[int] = (16, 32, 64, 128), pooling: str | None = None,
               normalize: bool | None = None) -> Model:
    """Describe a BERT sentence encoder (HF directory) as jaxdist units.

    Args:
        path: a Hugging Face checkpoint directory (``BertModel`` or ``BertForMaskedLM``
            safetensors), relative to a weights root or absolute under one.
        roots: weight roots to read the headers from (the workers must hold the same files).
        dtype: weight and activation dtype (``float32``, ``bfloat16``, ``float16``); LayerNorm,
            attention and pooling are computed in float32.
        buckets: sequence lengths compiled ahead of time (``b = 1``); longer than ``max_length``
            are dropped.
        pooling: ``"mean"`` or ``"cls"``; default: the sentence-transformers config.
        normalize: L2-normalise the embedding; default: the sentence-transformers config.

    Returns:
        The :class:`~jaxdist.export.model.Model`; ``meta`` holds ``config``, ``max_length``,
        ``buckets`` and ``tokenizer``.

    Raises:
        SpecError: bad options, an unsupported architecture, or a file disagreeing with its config.
        WeightError: the path is outside the roots or unreadable.
    """
    if dtype not in _DTYPES:
        raise SpecError(f"bert_model: dtype {dtype!r} is not supported; expected one of "
                        f"{list(_DTYPES)}")
    if pooling is not None and pooling not in _POOLINGS:
        raise SpecError(f"bert_model: pooling {pooling!r} is not supported; expected one of "
                        f"{list(_POOLINGS)}")
    path = os.fspath(path)
    directory = _find_dir(path, roots)
    cfg = BertConfig.from_hf(directory)
    cfg = dataclasses.replace(cfg, pooling=pooling or cfg.pooling,
                              normalize=cfg.normalize if normalize is None else normalize)
    if cfg.d_model % cfg.n_heads:
        raise SpecError(f"'{path}': hidden_size {cfg.d_model} is not a multiple of "
                        f"num_attention_heads {cfg.n_heads}")
    with WeightCache(roots) as cache:
        infos = cache.describe(str(directory))
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in infos else ""

    def param(logical: str, shape: tuple[int, ...], i: int = 0) -> Param:
        return _param(infos, path, _NAMES[logical].format(p=prefix, i=i), shape, dtype)

    d, f = cfg.d_model, cfg.ffn_dim
    units = [Unit("embed", functools.partial(_embed, cfg), {
        "word": param("word", (cfg.vocab, d)), "position": param("position", (cfg.max_position, d)),
        "token_type": param("token_type", (cfg.type_vocab, d)),
        "ln_w": param("emb_ln_w", (d,)), "ln_b": param("emb_ln_b", (d,))})]
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_up": (d, f),
              "w_down": (f, d), "bq": (d,), "bk": (d,), "bv": (d,), "bo": (d,), "b_up": (f,),
              "b_down": (d,), "ln1_w": (d,), "ln1_b": (d,), "ln2_w": (d,), "ln2_b": (d,)}
    layer_fn = functools.partial(_layer, cfg)
    for i in range(cfg.n_layers):
        units.append(Unit(f"layer.{i}", layer_fn,
                          {k: param(k, shape, i) for k, shape in shapes.items()}))
    units.append(Unit("pool", functools.partial(_pool, cfg)))
    lengths = tuple(int(n) for n in buckets if 1 <= int(n) <= cfg.max_length)
    meta = {"family": "bert", "config": cfg, "max_length": cfg.max_length, "buckets": lengths,
            "tokenizer": {"hf": path}}
    return Model(Path(path).name or path, units,
                 {"input_ids": ("b, s", "int32"), "attention_mask": ("b, s", "int32")},
                 # Positions past the table would be clipped, silently wrong: refuse them.
                 constraints=(f"s <= {cfg.max_position}",),
                 buckets=[{"b": 1, "s": n} for n in lengths], meta=meta,
                 # The front ends (jaxdist embed, /v1/embeddings) send every text of a request
                 # in one step, and a text longer than every bucket at its own length: shapes
                 # beyond the buckets, compiled on first use under the workers' bound.
                 any_shape=True)


def _param(infos: Mapping[str, WeightInfo], path: str, name: str, shape: tuple[int, ...],
           dtype: str) -> Param:
    info = infos.get(name)
    if info is None:
        raise SpecError(f"safetensors '{path}': tensor '{name}' is missing; the file does not "
                        f"match its config (or is not a BERT model)")
    # nn.Linear stores (out, in); embeddings and vectors are bound as stored.
    transpose = len(shape) == 2 and "embeddings" not in name
    found = tuple(info.shape[::-1] if transpose else info.shape)
    if found != tuple(shape):
        raise SpecError(f"safetensors '{path}': tensor '{name}' has shape {tuple(info.shape)}, "
                        f"expected {shape[::-1] if transpose else shape} from the config")
    return Param(f"safetensors://{path}#{name}", shape, dtype, transpose=transpose,
                 quant=info.storage_type)


@dataclasses.dataclass(frozen=True)
class _BertExporter:
    """The ``jaxdist.exporters`` plugin for BERT encoders (see :mod:`jaxdist.export.plugins`)."""

    name: str = "bert"
    kind: str = "encoder"
    architectures: frozenset[str] = frozenset({"bert", *_ARCHS})

    def load(self, path: str, *, roots: Sequence[str], **options: Any) -> LoadedModel:
        """Describe ``path`` (see :func:`bert_model` for ``options``) and load its tokenizer."""
        model = bert_model(path, roots=roots, **options)
        directory = _find_dir(path, roots)
        archs = _read_json(directory / "config.json").get("architectures") or ["bert"]
        return LoadedModel(model, kind="encoder", tokenizer=load_tokenizer(directory),
                           architecture=str(archs[0]),
                           options={"max_length": model.meta["max_length"],
                                    "buckets": model.meta["buckets"]})


EXPORTER = _BertExporter()
