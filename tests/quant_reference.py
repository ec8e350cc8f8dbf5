"""A numpy reference of a quantized Llama GGUF forward pass, with llama.cpp's arithmetic.

It is independent of jaxdist: the file is read with ``gguf.GGUFReader``, weights are decoded
with ``gguf.quants``, and every matmul quantizes its activations the way ggml's CPU backend
does before its dot products (Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_1 with its f16 block sum for
Q4_1/Q5_1, Q8_K for the K-quants, f16/bf16 for F16/BF16), written here from the block formats,
not from ggml's code. Attention, norms and RoPE are float64. One difference from llama.cpp
itself remains on purpose: llama.cpp keeps its KV cache in f16, jaxdist (and this reference) in
float32.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np

_T = gguf.GGMLQuantizationType


def _round_away(v: np.ndarray) -> np.ndarray:
    return np.trunc(v + np.copysign(0.5, v))


def _q8(x: np.ndarray, width: int, f16_scale: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8-bit blocks of ``width``: (dequantized x, f32 scale per block, sum of q per block)."""
    m, k = x.shape
    b = x.reshape(m, k // width, width).astype(np.float32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(_round_away(b * inv), -127, 127)
    ds = d.astype(np.float16).astype(np.float32) if f16_scale else d
    return (q * ds).reshape(m, k), d[..., 0], q.sum(axis=-1)


def dequantize(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """GGML blocks (N, row_bytes) as float64 rows, decoded by ``gguf.quants``."""
    if qtype == "F32":
        return blocks.view(np.float32).astype(np.float64)
    return gguf.quants.dequantize(blocks, _T[qtype]).astype(np.float64)


def matmul(x: np.ndarray, blocks: np.ndarray, qtype: str,
           w: np.ndarray | None = None) -> np.ndarray:
    """``x @ W.T`` as ggml's CPU kernels compute it, for ``W`` GGML blocks (N, row_bytes);
    ``w``: ``dequantize(blocks, qtype)`` when the caller has it already."""
    w = dequantize(blocks, qtype) if w is None else w
    if qtype == "F32":
        return x.astype(np.float64) @ w.T
    if qtype == "F16":
        return x.astype(np.float16).astype(np.float64) @ w.T
    if qtype == "BF16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float64) @ w.T
    if qtype.endswith("_K"):
        xq, _, _ = _q8(x, 256, f16_scale=False)
        return xq.astype(np.float64) @ w.T
    xq, d, qsum = _q8(x, 32, f16_scale=True)
    y = xq.astype(np.float64) @ w.T
    if qtype in ("Q4_1", "Q5_1"):
        # The min term uses the Q8_1 block sum s = fp16(d * sum(q)) instead of the exact sum.
        mins = blocks.reshape(blocks.shape[0], -1, 20 if qtype == "Q4_1" else 24)[:, :, 2:4]
        m_w = np.ascontiguousarray(mins).view(np.float16)[..., 0].astype(np.float64)
        d16 = d.astype(np.float16).astype(np.float64)
        s = (d * qsum).astype(np.float16).astype(np.float64)
        y += (s - d16 * qsum) @ m_w.T
    return y


class QuantLlama:
    """A Llama-architecture GGUF (as llama.cpp's converter writes it), run in numpy."""

    def __init__(self, path: str) -> None:
        r = gguf.GGUFReader(path)
        self.meta = {f.name: f for f in r.fields.values()}
        self.tensors = {t.name: t for t in r.tensors}
        self.n_layers = self._int("llama.block_count")
        self.n_heads = self._int("llama.attention.head_count")
        self.n_kv = self._int("llama.attention.head_count_kv")
        self.d = self._int("llama.embedding_length")
        self.hd = self.d // self.n_heads
        self.theta = self._float("llama.rope.freq_base")
        self.eps = self._float("llama.attention.layer_norm_rms_epsilon")
        self._weights: dict[str, np.ndarray] = {}

    def _int(self, key: str) -> int:
        f = self.meta[key]
        return int(f.parts[f.data[0]][0])

    def _float(self, key: str) -> float:
        f = self.meta[key]
        return float(f.parts[f.data[0]][0])

    def _blocks(self, name: str) -> tuple[np.ndarray, str]:
        t = self.tensors[name]
        qtype = _T(t.tensor_type).name
        rows = int(t.shape[1]) if len(t.shape) > 1 else 1
        return np.asarray(t.data).view(np.uint8).reshape(rows, -1), qtype

    def _vector(self, name: str) -> np.ndarray:
        b, qtype = self._blocks(name)
        return gguf.quants.dequantize(b, _T[qtype]).astype(np.float64).reshape(-1)

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        blocks, qtype = self._blocks(name)
        if name not in self._weights:  # decoded once: a greedy run reads every matrix per step
            self._weights[name] = dequantize(blocks, qtype)
        return matmul(x, blocks, qtype, self._weights[name])

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self._vector(name)

    def _forward(self, tokens: list[int], start: int,
                 cache: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """The logits of the last of ``tokens``, which stand at positions ``start`` on.

        ``cache`` holds each layer's keys (after RoPE) and values of the positions before
        ``start``, and gets those of ``tokens`` appended. Every row is quantized and multiplied
        on its own, so a step over one new token computes what a pass over the whole sequence
        computes for that token.
        """
        emb, et = self._blocks("token_embd.weight")
        x = gguf.quants.dequantize(emb[tokens], _T[et]).astype(np.float64)
        n = len(tokens)
        inv = 1.0 / self.theta ** (np.arange(0, self.hd, 2) / self.hd)
        ang = np.arange(start, start + n)[:, None] * inv[None]
        cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

        def rope(v: np.ndarray) -> np.ndarray:  # GGUF llama: adjacent pairs
            a, b = v[..., 0::2], v[..., 1::2]
            out = np.empty_like(v)
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out

        causal = np.tril(np.ones((n, start + n), bool), k=start)
        group = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            h = self._norm(x, f"blk.{i}.attn_norm.weight")
            q = rope(self._linear(h, f"blk.{i}.attn_q.weight").reshape(n, self.n_heads, self.hd))
            k = rope(self._linear(h, f"blk.{i}.attn_k.weight").reshape(n, self.n_kv, self.hd))
            v = self._linear(h, f"blk.{i}.attn_v.weight").reshape(n, self.n_kv, self.hd)
            if len(cache) <= i:
                cache.append((k[:0], v[:0]))
            k, v = np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v])
            cache[i] = (k, v)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.hd)
            s = np.where(causal[None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", p, v).reshape(n, self.d)
            x = x + self._linear(att, f"blk.{i}.attn_output.weight")
            h = self._norm(x, f"blk.{i}.ffn_norm.weight")
            g = self._linear(h, f"blk.{i}.ffn_gate.weight")
            u = self._linear(h, f"blk.{i}.ffn_up.weight")
            x = x + self._linear(g / (1 + np.exp(-g)) * u, f"blk.{i}.ffn_down.weight")
        h = self._norm(x[-1:], "output_norm.weight")
        head = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        return self._linear(h, head)[0]

    def logits(self, tokens: list[int]) -> np.ndarray:
        """The logits of the last position after ``tokens`` (a causal forward pass)."""
        return self._forward(tokens, 0, [])

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """``n`` greedy tokens, and the margin (top-1 minus top-2 logit) of each pick."""
        tokens, margins = list(prompt), []
        cache: list[tuple[np.ndarray, np.ndarray]] = []
        z = self._forward(tokens, 0, cache)
        for _ in range(n):
            if len(tokens) > len(prompt):  # the previous pick, at the next position
                z = self._forward(tokens[-1:], len(tokens) - 1, cache)
            top2 = np.partition(z, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(z)))
        return tokens[len(prompt):], margins
