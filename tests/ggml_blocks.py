"""GGML blocks for the kernel tests: quantize float32 rows into any GGML type.

``gguf.quants`` quantizes only the simple types (Q4_0 ... Q8_0, F16, BF16); for the K-quants
the tests call ``ggml_quantize_chunk`` of the libggml-python wheel, which is the routine
llama.cpp's quantize tool runs. Only the blocks come from ggml: every expected value is
computed from them with ``gguf.quants.dequantize`` (an independent implementation) and numpy.
"""

from __future__ import annotations

import ctypes
import functools

import gguf
import numpy as np

from jaxdist.core.kernels.build import find_ggml

SIMPLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16")


@functools.cache
def _ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(find_ggml().lib / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    return lib


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``w`` (rows, cols) float32 -> uint8 (rows, row_bytes) GGML blocks of ``qtype``."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in SIMPLE:
        return np.ascontiguousarray(gguf.quants.quantize(w, t)).view(np.uint8)
    elems, nbytes = gguf.GGML_QUANT_SIZES[t]
    rows, cols = w.shape
    out = np.zeros((rows, cols // elems * nbytes), np.uint8)
    src = np.ascontiguousarray(w, np.float32)
    _ggml_base().ggml_quantize_chunk(t.value, src.ctypes.data, out.ctypes.data, 0, rows, cols,
                                     None)
    return out


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """The reference: ``gguf.quants`` dequantization to float32 (rows, cols)."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F16":
        return blocks.view(np.float16).astype(np.float32)
    return gguf.quants.dequantize(blocks, t).astype(np.float32)


# How the CPU kernels quantize activations (ggml's vec_dot_type of each weight type).
ACTIVATION = {"Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1",
              "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
              "F16": "F16", "BF16": "BF16"}


def activation_error(x: np.ndarray, qtype: str) -> np.ndarray:
    """An upper bound of |x - x as the kernel sees it|, elementwise, from how ggml quantizes
    activations for ``qtype``: 8-bit blocks (32 or 256 wide) with scale amax/127 (stored as
    f16 for Q8_0/Q8_1), or a rounding to f16/bf16."""
    act = ACTIVATION[qtype]
    if act == "F16":
        return np.abs(x) * 2.0**-11 + 6e-8
    if act == "BF16":
        return np.abs(x) * 2.0**-8
    width = 256 if act == "Q8_K" else 32
    m, k = x.shape
    amax = np.abs(x.reshape(m, k // width, width)).max(axis=-1, keepdims=True)
    # rounding to the nearest step (d/2), plus the f16 rounding of d times |q| <= 127
    step = amax / 127.0 * (0.5 + (127 * 2.0**-11 if act != "Q8_K" else 0.0))
    return np.broadcast_to(step, (m, k // width, width)).reshape(m, k) * 1.01


def write_llama_gguf(path, *, types: dict[str, str], seed: int = 0, layers: int = 2,
                     vocab: int = 256, hidden: int = 256, ffn: int = 512, heads: int = 4,
                     kv_heads: int = 2, tokenizer: str = "none", parts: int = 1) -> list[str]:
    """A small random Llama GGUF whose matrices are stored in the GGML types of ``types``
    (keys: ``embed``, ``attn``, ``ffn``, ``down``, ``output``; no ``output``: tied), with
    llama.cpp's metadata keys. ``parts > 1`` splits it as gguf-split does
    (``NAME-00001-of-0000N.gguf``, metadata in the first part). Returns the file names."""
    import pathlib

    path = pathlib.Path(path)
    rng = np.random.default_rng(seed)
    hd = hidden // heads

    def mat(rows: int, cols: int, kind: str, scale: float) -> tuple[np.ndarray, str]:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        qtype = types.get(kind, "F32")
        return (w, qtype) if qtype == "F32" else (quantize(w, qtype), qtype)

    tensors: list[tuple[str, np.ndarray, str, tuple[int, int] | None]] = []

    def add(name: str, rows: int, cols: int, kind: str, scale: float) -> None:
        data, qtype = mat(rows, cols, kind, scale)
        tensors.append((name, data, qtype, (rows, cols)))

    add("token_embd.weight", vocab, hidden, "embed", 1.0)
    tensors.append(("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(
        np.float32), "F32", None))
    if "output" in types:
        add("output.weight", vocab, hidden, "output", 20 * hidden ** -0.5)  # peaked logits
    for i in range(layers):
        for n in ("attn_norm", "ffn_norm"):
            tensors.append((f"blk.{i}.{n}.weight", (1 + 0.1 * rng.standard_normal(hidden)
                                                    ).astype(np.float32), "F32", None))
        add(f"blk.{i}.attn_q.weight", heads * hd, hidden, "attn", hidden ** -0.5)
        add(f"blk.{i}.attn_k.weight", kv_heads * hd, hidden, "attn", hidden ** -0.5)
        add(f"blk.{i}.attn_v.weight", kv_heads * hd, hidden, "attn", hidden ** -0.5)
        add(f"blk.{i}.attn_output.weight", hidden, heads * hd, "attn", hidden ** -0.5)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden, "ffn", hidden ** -0.5)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden, "ffn", hidden ** -0.5)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn, "down", ffn ** -0.5)

    names = ([path.name] if parts == 1 else
             [f"{path.stem}-{k:05d}-of-{parts:05d}.gguf" for k in range(1, parts + 1)])
    per_part = -(-len(tensors) // parts)
    for k, name in enumerate(names):
        w = gguf.GGUFWriter(str(path.parent / name), "llama")
        if k == 0:
            w.add_block_count(layers)
            w.add_context_length(2048)
            w.add_embedding_length(hidden)
            w.add_feed_forward_length(ffn)
            w.add_head_count(heads)
            w.add_head_count_kv(kv_heads)
            w.add_rope_dimension_count(hd)
            w.add_rope_freq_base(10000.0)
            w.add_layer_norm_rms_eps(1e-5)
            w.add_tokenizer_model(tokenizer)
        if parts > 1:
            w.add_uint16("split.no", k)
            w.add_uint16("split.count", parts)
            w.add_int32("split.tensors.count", len(tensors))
        for tname, data, qtype, shape in tensors[k * per_part:(k + 1) * per_part]:
            if qtype == "F32":
                w.add_tensor(tname, data)
            else:
                w.add_tensor(tname, data, raw_shape=data.shape,
                             raw_dtype=gguf.GGMLQuantizationType[qtype])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return names
