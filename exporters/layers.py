"""Transformer building blocks shared by the exporters: norms, RoPE, slot-cache attention, sampling.

Every function is pure ``jax.numpy`` with no host callbacks, so it traces under ``jax.export``
with symbolic batch (``b``) and sequence (``s``) dims. Weights are passed in already laid out by
the worker at bind time (matrices as ``(in, out)``), so every projection is a plain ``x @ W``:
XLA:CPU's dot runs ``(b, in) @ (in, out)`` faster than the same product against the stored
``(out, in)`` matrix, 1.08x at one row and 1.3x to 1.7x at 2 to 16 (bench/NOTES.md, "Decode
profile").

Slot cache layout: one resident array per layer, ``(max_slots, n_kv_heads, max_seq, head_dim)``
(:func:`cache_shape`), so a slot's keys of one head are one contiguous ``(max_seq, head_dim)``
block that the attention dots read without a transposing copy. A step of ``b`` rows carries, per
row, its cache ``slot``, the position ``pos`` of its first token and its true ``length`` (``s``
minus padding). New keys/values go to ``cache[slot, :, pos + i]``; query ``pos + i`` reads keys
``j <= pos + i`` and ``j < pos + length`` (and ``j > pos + i - window`` with a sliding window).
Padded entries beyond ``pos + length`` are written but never read: the row's next step starts at
``pos + length`` and overwrites them. Two rows of one step must not share a slot (their scatters
would race).

An idle row (a batch slot with nothing to do) can be given ``pos = max_seq`` and ``length = 0``:
its writes fall outside the cache and are dropped, and its outputs are garbage the caller ignores.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdist.core.kernels import ops

__all__ = [
    "apply_partial_rope",
    "apply_rope",
    "cache_attention",
    "cache_shape",
    "last_valid",
    "layer_norm",
    "rms_norm",
    "rms_norm_offset",
    "rope_angles",
    "rope_inv_freq",
    "sample_tokens",
    "step_positions",
]

Array = Any

# A large negative instead of -inf, so a row with no visible key (length 0) gives garbage, not NaN.
_MASKED = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm over the last axis, computed in float32 and returned in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf.astype(x.dtype) * weight.astype(x.dtype)).astype(x.dtype)


def rms_norm_offset(x: Array, weight: Array, eps: float, offset: float) -> Array:
    """Gemma's RMSNorm: ``x / rms(x) * (offset + weight)``, all in float32, then ``x``'s dtype.

    Hugging Face Gemma checkpoints store ``weight - 1`` (``offset`` 1.0); llama.cpp's converter
    adds the 1 to the GGUF's norm weights (``offset`` 0.0). Unlike :func:`rms_norm`, the
    product is taken before the cast to ``x``'s dtype, as transformers' ``Gemma3RMSNorm`` does.
    """
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    """LayerNorm with bias over the last axis (GPT-2, BERT), in float32; returns ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    xf = (xf - mean) * lax.rsqrt(var + eps)
    return (xf * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def step_positions(pos: Array, tokens: Array) -> Array:
    """Absolute positions ``pos[r] + i`` of the ``(b, s)`` tokens of a step."""
    return pos[:, None] + lax.broadcasted_iota(jnp.int32, tokens.shape[:2], 1)


def rope_inv_freq(head_dim: int, theta: float, *, rope_type: str = "default",
                  factor: float = 1.0, low_freq_factor: float = 1.0,
                  high_freq_factor: float = 4.0, original_max_position: int = 8192) -> np.ndarray:
    """RoPE inverse frequencies ``theta ** (-2i / head_dim)``, ``(head_dim // 2,)`` float32.

    Args:
        rope_type: ``"default"``; ``"linear"`` (divide by ``factor``); or ``"llama3"``: low
            frequencies divided by ``factor``, high ones kept, a smooth ramp between (as
            transformers' ``_compute_llama3_parameters``).

    Raises:
        ValueError: an unknown ``rope_type`` (exporters check it first and raise SpecError).
    """
    exps = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.float32(theta) ** exps).astype(np.float32)
    if rope_type == "default":
        return inv
    if rope_type == "linear":
        return (inv / np.float32(factor)).astype(np.float32)
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r}: expected default, linear or llama3")
    low_wl = original_max_position / low_freq_factor
    high_wl = original_max_position / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor
                                                                    - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
    """``cos`` and ``sin`` of ``positions * inv_freq``: each ``(b, s, head_dim // 2)`` float32."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: Array, cos: Array, sin: Array, *, interleaved: bool) -> Array:
    """Rotate ``x`` of shape ``(b, s, heads, head_dim)`` by the angles of :func:`rope_angles`.

    Args:
        interleaved: rotate adjacent pairs ``(x[2i], x[2i+1])`` by frequency ``i`` (GPT-J /
            llama.cpp "normal" mode, what GGUF ``llama`` weights expect); otherwise rotate the
            halves ``(x[i], x[i + d/2])`` (GPT-NeoX / Hugging Face ``rotate_half``).
    """
    c, s_ = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        pairs = xf.reshape(*xf.shape[:-1], xf.shape[-1] // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * c - b * s_, a * s_ + b * c], axis=-1).reshape(xf.shape)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([a * c - b * s_, b * c + a * s_], axis=-1)
    return out.astype(x.dtype)


def cache_shape(max_slots: int, max_seq: int, n_kv_heads: int, head_dim: int
                ) -> tuple[int, int, int, int]:
    """The shape of one layer's key (or value) slot cache, as :func:`cache_attention` reads it."""
    return (max_slots, n_kv_heads, max_seq, head_dim)


def cache_attention(q: Array, k: Array, v: Array, k_cache: Array, v_cache: Array, slot: Array,
                    pos: Array, length: Array, *, scale: float | None = None, window: int = 0
                    ) -> tuple[Array, Array, Array]:
    """Write this step's keys/values into the slot cache, then attend causally over it.

    Args:
        q: ``(b, s, n_heads, head_dim)``, RoPE applied.
        k, v: ``(b, s, n_kv_heads, head_dim)``, RoPE applied to ``k``.
        k_cache, v_cache: ``(max_slots, n_kv_heads, max_seq, head_dim)`` (:func:`cache_shape`).
        slot, pos, length: ``(b,)`` int32, see the module docstring.
        scale: multiplies the scores; default ``head_dim ** -0.5`` (Gemma's is
            ``query_pre_attn_scalar ** -0.5``).
        window: sliding-window attention when above 0: the query at position ``p`` also needs
            ``j > p - window``, so it sees at most the last ``window`` positions, itself included
            (Mistral v0.1, Gemma's local layers; transformers' and llama.cpp's convention). The
            cache stays ``max_seq`` long: older positions are kept, just not read.

    Returns:
        ``(out, k_cache, v_cache)``: ``out`` is ``(b, s, n_heads, head_dim)`` in ``q``'s dtype;
        the caches are updated (in place once the stage donates them).
    """
    b, s = q.shape[0], q.shape[1]
    n_kv = k.shape[2]
    qpos = step_positions(pos, q)                                         # (b, s)
    rows = jnp.broadcast_to(slot[:, None, None], (b, s, n_kv))
    heads = lax.broadcasted_iota(jnp.int32, (b, s, n_kv), 2)
    cols = jnp.broadcast_to(qpos[:, :, None], (b, s, n_kv))
    # Positions >= max_seq fall outside the cache and are dropped instead of clamped.
    k_cache = k_cache.at[rows, heads, cols].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, heads, cols].set(v.astype(v_cache.dtype), mode="drop")
    # On a CPU worker with the kernels, a decode step reads only the positions in use.
    scale = q.shape[3] ** -0.5 if scale is None else float(scale)
    out = ops.cache_attention(q, k_cache, v_cache, slot, pos, length, scale=scale, window=window,
                              portable=functools.partial(_attend, scale=scale, window=window))
    return out, k_cache, v_cache


def _attend(q: Array, k_cache: Array, v_cache: Array, slot: Array, pos: Array, length: Array,
            *, scale: float | None = None, window: int = 0) -> Array:
    """The portable read of :func:`cache_attention`: each row's whole slot, masked."""
    b, s, n_heads, hd = q.shape
    scale = hd ** -0.5 if scale is None else scale
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    qpos = step_positions(pos, q)                                         # (b, s)
    keys = k_cache[slot].astype(jnp.float32)                              # (b, kv, T, hd)
    vals = v_cache[slot].astype(jnp.float32)
    # Queries grouped by their key/value head: (b, kv, group * s, hd), head = kv * group + g.
    qg = q.astype(jnp.float32).reshape(b, s, n_kv, group, hd).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(b, n_kv, group * s, hd) * scale
    scores = jnp.einsum("bkqd,bktd->bkqt", qg, keys).reshape(b, n_kv, group, s, -1)
    kpos = lax.broadcasted_iota(jnp.int32, (1, 1, k_cache.shape[2]), 2)  # (1, 1, T)
    visible = (kpos <= qpos[:, :, None]) & (kpos < (pos + length)[:, None, None])
    if window > 0:
        visible &= kpos > qpos[:, :, None] - window
    scores = jnp.where(visible[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, n_kv, group * s, -1)
    out = jnp.einsum("bkqt,bktd->bkqd", probs, vals).reshape(b, n_kv, group, s, hd)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, n_heads, hd)
    return out.astype(q.dtype)


def last_valid(x: Array, length: Array) -> Array:
    """The activation of each row's last true token: ``x[r, length[r] - 1]`` -> ``(b, d)``."""
    idx = jnp.clip(length - 1, 0, x.shape[1] - 1).astype(jnp.int32)
    return jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]


def _filtered_logits(z: Array, top_k: Array, top_p: Array) -> Array:
    """Mask (to -inf) the logits outside each row's top-k and nucleus (top-p) sets."""
    vocab = z.shape[-1]
    srt = -jnp.sort(-z, axis=-1)                                          # descending
    rank = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None]
    srt = jnp.where(rank < k, srt, -jnp.inf)
    p = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p            # probability mass ranked above each token
    keep = (rank < k) & ((before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(srt, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(z >= threshold, z, -jnp.inf)


def _argmax(z: Array) -> Array:
    """``jnp.argmax(z, axis=-1)`` as int32 (first maximum; first NaN if any), for ``(b, n)``.

    Written as a max, then the smallest index holding it: two plain reductions that XLA:CPU
    vectorizes, where ``jnp.argmax``'s variadic (value, index) reduction is not. Over SmolLM2's
    49152 logits that is 86 against 250 us for one row, 0.38 against 1.7 ms for eight.
    """
    m = jnp.max(z, axis=-1, keepdims=True)                     # NaN if any element is NaN
    hit = (z == m) | (jnp.isnan(z) & jnp.isnan(m))
    idx = lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
    return jnp.min(jnp.where(hit, idx, z.shape[-1]), axis=-1).astype(jnp.int32)


def sample_tokens(logits: Array, temperature: Array, top_k: Array, top_p: Array, seed: Array,
                  counter: Array) -> Array:
    """Pick one token per row in-graph: greedy, or seeded temperature / top-k / top-p sampling.

    Args:
        logits: ``(b, vocab)``.
        temperature: ``(b,)``; ``<= 0`` means greedy (argmax) for that row.
        top_k: ``(b,)`` int; ``<= 0`` turns it off.
        top_p: ``(b,)``; ``>= 1.0`` turns it off. Keeps the smallest high-probability set whose
            mass reaches ``top_p`` (always at least one token), after top-k, like Hugging Face.
        seed: ``(b,)`` integer seed of the row.
        counter: ``(b,)`` int, mixed into the key (``fold_in``) so each step draws afresh while a
            seeded run stays reproducible; the LLM exporters pass the row's next position.

    Returns:
        ``(b,)`` int32 token ids.
    """
    logits = logits.astype(jnp.float32)
    greedy = _argmax(logits)

    def draw(_: None) -> Array:
        t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
        z = _filtered_logits(logits / t[:, None], top_k, top_p.astype(jnp.float32))

        def one(sd: Array, c: Array, zr: Array) -> Array:
            key = jax.random.fold_in(jax.random.PRNGKey(sd.astype(jnp.uint32)), c)
            return jax.random.categorical(key, zr)

        sampled = jax.vmap(one)(seed, counter.astype(jnp.int32), z).astype(jnp.int32)
        return jnp.where(temperature > 0, sampled, greedy)

    # The full-vocabulary sort is skipped when no row samples (the common greedy case).
    return lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)


def apply_partial_rope(x: Array, cos: Array, sin: Array, *, interleaved: bool) -> Array:
    """:func:`apply_rope` on the first ``2 * cos.shape[-1]`` dims of each head, the rest as is.

    Partial rotary embeddings (Phi-4-mini's ``partial_rotary_factor``, GGUF
    ``rope.dimension_count`` below the head width), as transformers' ``apply_rotary_pos_emb``
    and llama.cpp's ``ggml_rope_ext`` with ``n_dims < head_dim`` compute them. When the angles
    cover the whole head it is :func:`apply_rope`.
    """
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin, interleaved=interleaved)
    rotated = apply_rope(x[..., :rot], cos, sin, interleaved=interleaved)
    return jnp.concatenate([rotated, x[..., rot:]], axis=-1)


def moe_swiglu(h: Array, router: Any, gate: Any, up: Any, down: Any, *, n_used: int,
               norm_topk: bool, live: Array) -> Array:
    """A Mixture-of-Experts SwiGLU block (Mixtral, Qwen3-MoE): ``(b, s, d) -> (b, s, d)`` float32.

    Each token is routed on its own: the softmax of ``h @ router`` over the experts (in
    float32), its ``n_used`` largest entries chosen (ties to the lower index), their weights
    renormalized to sum to 1 when ``norm_topk``; the output is the weighted sum of the chosen
    experts' ``down(silu(gate(h)) * up(h))``. As transformers' Mixtral and Qwen3-MoE blocks,
    and llama.cpp's ``build_moe_ffn`` with softmax gating.

    Args:
        router: ``(d, E)``, a plain array or a transposed :class:`~jaxdist.core.kernels.ops.QTensor`.
        gate, up, down: the experts, as :func:`jaxdist.core.kernels.ops.expert_linear` takes
            them: stacked ``(E, f, d)`` / ``(E, d, f)`` as stored, or a list of E matrices.
        live: ``(b, s)``, the tokens that are not padding (the CPU kernel skips the others).
    """
    b, s, d = h.shape
    h2 = h.reshape((b * s, d))
    rows = live.reshape((b * s,))
    probs = jax.nn.softmax(ops.linear(h2, router, rows).astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, n_used)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    g = ops.expert_linear(h2, gate, ids, rows)
    u = ops.expert_linear(h2, up, ids, rows)
    y = ops.expert_linear(jax.nn.silu(g) * u, down, ids, rows)
    return jnp.einsum("ts,tsd->td", weights, y).reshape((b, s, d))
