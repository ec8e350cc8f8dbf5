"""Quantized weights inside a stage's graph: the ops an exporter's units call.

A GGUF tensor bound as stored reaches a unit as a :class:`QTensor`: the raw uint8 blocks, their
GGML type, and the logical matrix the unit means. Units multiply with :func:`linear` and look up
rows with :func:`take_rows`; both also take plain arrays, so one unit serves float and
quantized weights alike.

:func:`quant_matmul` is where portability is decided. It lowers to
``lax.platform_dependent(cpu=<the kernel>, default=<dequantize + dot>)``: the serialized stage
holds both branches, XLA:CPU keeps only the custom call (:data:`jaxdist.core.kernels.TARGET`), and
XLA:GPU/TPU fuse the dequantization into their dot. On the CPU, products of many rows (a
prefill) are faster as dequantize-then-dot; :func:`max_rows` is that crossover per type, as
measured in bench/NOTES.md ("CPU kernels", "Decode on a ~1B model"), and the choice is a
``lax.cond`` on the static row count that each compiled shape bucket folds away.

:func:`cache_attention` does the same for a decode step's attention over the slot KV cache: the
CPU branch calls :data:`jaxdist.core.kernels.ATTENTION_TARGET` (``ATTENTION_V2_TARGET`` for a
sliding window), which reads only the cache positions in use, and the default branch is the
exporter's own jnp form. It runs only while a stage is
exported for the kernels (:func:`exporting_for_kernels`, which the coordinator enters for a
stage with packed weights), so a stage without quantized weights carries no custom call and
runs on any worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from jax import lax

from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import (ATTENTION_TARGET, ATTENTION_V2_TARGET, DEQUANTIZE_TARGET,
                                   KERNEL_TYPES, MOE_TARGET, TARGET)
from jaxdist.core.quant import block_layout, dequantize_rows

__all__ = ["KERNEL_MAX_ROWS", "KERNEL_MAX_ROWS_WIDE", "QTensor",
           "WIDE_TYPES", "max_rows", "cache_attention", "expert_linear",
           "exporting_for_kernels", "linear", "quant_matmul", "take_rows"]

Array = Any

KERNEL_MAX_ROWS = 64
"""On the CPU, products with more rows than this dequantize (ggml) and then run XLA's dot."""

WIDE_TYPES: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
"""Types with jaxdist's own multi-row dot products (docs/kernels.md), which stay faster than
dequantize-then-dot up to :data:`KERNEL_MAX_ROWS_WIDE` rows."""

KERNEL_MAX_ROWS_WIDE = 512
"""The crossover for :data:`WIDE_TYPES`: a 5632x2048 Q4_0 product of 128 rows took 19 ms in
the kernel against 61 ms dequantized, of 512 rows 46 against 73 ms (Q4_K: 42 against 76 ms;
bench/NOTES.md, "Decode on a ~1B model"). On a CPU without AVX-512 VNNI these types run ggml's
dot products up to here too, slower there than dequantizing from about 64 rows on."""


def max_rows(qtype: str) -> int:
    """The most rows of a product of ``qtype`` weights that the CPU kernel computes; more
    rows dequantize and run XLA's dot."""
    return KERNEL_MAX_ROWS_WIDE if qtype in WIDE_TYPES else KERNEL_MAX_ROWS

_for_kernels: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_for_kernels",
                                                                    default=False)


@contextlib.contextmanager
def exporting_for_kernels(enabled: bool = True) -> Iterator[None]:
    """While tracing inside this, :func:`cache_attention` lowers to the CPU kernel.

    The choice is made when a function is traced: a ``jax.jit`` function traced before (and
    cached by jax) keeps the lowering it was traced with.
    """
    token = _for_kernels.set(enabled)
    try:
        yield
    finally:
        _for_kernels.reset(token)


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A matrix (or a stack of them) held as GGML blocks, as a unit sees it.

    Attributes:
        blocks: uint8 ``(rows, row_bytes)``, the stored rows (GGUF's ``ne1`` rows of ``ne0``);
            or ``(E, rows, row_bytes)``, the stacked matrices of a Mixture-of-Experts layer
            (GGUF's ``ffn_*_exps``), multiplied by :func:`expert_linear` and never transposed.
        qtype: the GGML type name, e.g. ``"Q4_K"``.
        transposed: the unit means the transpose of the stored matrix: a projection weight
            stored ``(out, in)`` and used as ``x @ W`` with ``W`` ``(in, out)``.
    """

    blocks: Array
    qtype: str
    transposed: bool = False

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The stored element shape ``(rows, cols)`` (``(E, rows, cols)`` for a stack)."""
        elems, nbytes = block_layout(self.qtype)
        *lead, row_bytes = self.blocks.shape
        return (*(int(d) for d in lead), int(row_bytes) // nbytes * elems)

    @property
    def shape(self) -> tuple[int, ...]:
        stored = self.stored_shape
        return stored[::-1] if self.transposed else stored

    @property
    def T(self) -> QTensor:  # noqa: N802 - mirrors ndarray.T
        return dataclasses.replace(self, transposed=not self.transposed)

    def dequantize(self) -> Array:
        """The logical matrix in float32 (in-graph; materializes it)."""
        w = dequantize_rows(self.blocks, self.qtype, xp=jnp)
        return w.T if self.transposed else w


def _kernel(x2: Array, blocks: Array, qtype: str, rows: Array) -> Array:
    """The kernel; ``rows`` (M,) int32, zero for a row of x to skip (its result is zeros)."""
    n = blocks.shape[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, blocks, rows, ggml_type=np.int32(GGMLQuantizationType[qtype].value))


def _dot_t(x2: Array, w: Array) -> Array:
    """``x2 @ w.T`` for ``w`` (N, K)."""
    return lax.dot_general(x2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dequantize_dot(x2: Array, blocks: Array, qtype: str) -> Array:
    """The portable branch: dequantize in the graph (XLA:GPU/TPU fuse it into the dot)."""
    return _dot_t(x2, dequantize_rows(blocks, qtype, xp=jnp))


def _kernel_dequantize_dot(x2: Array, blocks: Array, qtype: str) -> Array:
    """The CPU's many-rows branch: ggml dequantizes (SIMD), XLA's f32 dot multiplies."""
    n, k = blocks.shape[0], x2.shape[1]
    # Dequantizing depends only on the weights, so XLA would schedule every layer's at the
    # start of the stage and hold them all in float32 at once (213 MB for a SmolLM2 prefill of
    # 128 tokens; an optimization_barrier does not survive XLA:CPU). x as an operand makes each
    # wait for its own input, so the float32 matrices' buffers are reused: one at a time.
    call = jax.ffi.ffi_call(DEQUANTIZE_TARGET, jax.ShapeDtypeStruct((n, k), jnp.float32))
    return _dot_t(x2, call(x2, blocks, ggml_type=np.int32(GGMLQuantizationType[qtype].value)))


def quant_matmul(x: Array, blocks: Array, qtype: str, rows: Array | None = None) -> Array:
    """``x @ W.T`` for ``W`` stored as GGML blocks ``(N, row_bytes)``: ``(..., K) -> (..., N)``.

    float32 in and out. The CPU lowering calls the kernel; every other platform dequantizes
    in the graph. ``rows`` (``x.shape[:-1]``, bool or int) may mark the rows of ``x`` that
    matter: the kernel skips the others (padding of a prefill chunk, idle batch slots), whose
    results are then zeros on the CPU and computed as usual elsewhere, so a caller must
    ignore them.

    Raises:
        SpecError: ``qtype`` has no kernel, or ``x``'s last dim is not the stored row length.
    """
    if qtype not in KERNEL_TYPES:
        raise SpecError(f"quant_matmul: GGML type {qtype!r} has no kernel; expected one of "
                        f"{', '.join(KERNEL_TYPES)} (bind other types dequantized)")
    elems, nbytes = block_layout(qtype)
    k = int(blocks.shape[1]) // nbytes * elems
    if int(x.shape[-1]) != k:
        raise SpecError(f"quant_matmul: x has {x.shape[-1]} features, the {qtype} weight rows "
                        f"hold {k}")
    lead = x.shape[:-1]
    x2 = x.astype(jnp.float32).reshape((-1, k))
    r = (jnp.ones((x2.shape[0],), jnp.int32) if rows is None
         else jnp.asarray(rows).astype(jnp.int32).reshape((-1,)))

    def cpu(x2: Array, blocks: Array, r: Array) -> Array:
        many = jnp.asarray(x2.shape[0]) > max_rows(qtype)  # a constant once a bucket compiles
        return lax.cond(many, lambda a, b, _: _kernel_dequantize_dot(a, b, qtype),
                        lambda a, b, m: _kernel(a, b, qtype, m), x2, blocks, r)

    y = lax.platform_dependent(x2, blocks, r, cpu=cpu,
                               default=lambda a, b, _: _dequantize_dot(a, b, qtype))
    return y.reshape((*lead, blocks.shape[0]))


def linear(x: Array, w: Array | QTensor, rows: Array | None = None) -> Array:
    """``x @ w`` for a plain array or a :class:`QTensor` (float32 result for a QTensor).

    ``rows`` (``x.shape[:-1]``): the rows that matter; the CPU kernel skips the others (see
    :func:`quant_matmul`). Ignored for plain arrays.
    """
    if not isinstance(w, QTensor):
        return x @ w
    if w.transposed:
        return quant_matmul(x, w.blocks, w.qtype, rows)
    # Stored (in, out): no kernel layout, so dequantize (rare: exporters bind (out, in)).
    return x.astype(jnp.float32) @ w.dequantize()


def take_rows(table: Array | QTensor, idx: Array, dtype: Any = jnp.float32) -> Array:
    """``table[idx]`` (an embedding lookup); a QTensor's gathered rows are dequantized."""
    if not isinstance(table, QTensor):
        return table[idx]
    if table.transposed:
        raise SpecError("take_rows: a transposed QTensor has no stored rows to gather")
    return dequantize_rows(table.blocks[idx], table.qtype, xp=jnp).astype(dtype)


def cache_attention(q: Array, k_cache: Array, v_cache: Array, slot: Array, pos: Array,
                    length: Array, *, scale: float,
                    portable: Callable[[Array, Array, Array, Array, Array, Array], Array],
                    window: int = 0) -> Array:
    """Attention of a step's queries over the slot caches (this step's entries written).

    Shapes and semantics are those of ``exporters.layers.cache_attention``; ``portable`` is its
    jnp form ``(q, k_cache, v_cache, slot, pos, length) -> out``, computing the same ``scale``
    and ``window``. ``window`` > 0 is sliding-window attention: a query at position ``p`` sees
    the keys in ``(p - window, p]``; 0 is full causal attention. Outside
    :func:`exporting_for_kernels`, or for caches that are not float32, this is ``portable``.
    Otherwise it lowers to ``platform_dependent(cpu=<kernel>, default=portable)``, for steps of
    any length: a query's bits then do not depend on the step that carries it (decode, a
    16-token chunk of a batched prefill or a 256-token one alone), so a greedy answer does
    not depend on the load it was served under. The kernel reads only the positions each query
    sees, and gives zeros for a row of length 0 (garbage in the portable form; callers ignore
    such rows). Full attention calls
    :data:`~jaxdist.core.kernels.ATTENTION_TARGET` (v1); a window calls
    :data:`~jaxdist.core.kernels.ATTENTION_V2_TARGET`.

    Raises:
        SpecError: a negative ``window``.
    """
    if window < 0:
        raise SpecError(f"cache_attention: window {window} is negative; expected 0 (full "
                        f"attention) or the number of positions a query sees")
    args = (q, k_cache, v_cache, slot, pos, length)
    if not _for_kernels.get() or any(a.dtype != jnp.float32 for a in args[:3]):
        return portable(*args)

    def kernel(*a: Array) -> Array:
        if window == 0:
            call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
            return call(*a, scale=np.float32(scale))
        call = jax.ffi.ffi_call(ATTENTION_V2_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return call(*a, scale=np.float32(scale), window=np.int32(window))

    return lax.platform_dependent(*args, cpu=kernel, default=portable)


def _expert_rows(x: Array, slots: int) -> Array:
    """``x`` (T, K) or (T, S, K) as one row per (token, slot): (T, S, K)."""
    return x if x.ndim == 3 else jnp.broadcast_to(x[:, None, :], (x.shape[0], slots, x.shape[1]))


def _experts_gathered(x: Array, w: Array | QTensor, ids: Array) -> Array:
    """Each (token, slot)'s own expert matrix gathered, then multiplied: reads only the chosen
    experts' bytes (a decode step's few rows)."""
    t, s = ids.shape
    safe = jnp.clip(ids, 0, None)  # -1 (skipped) reads expert 0; the caller ignores the row
    if isinstance(w, QTensor):
        chosen = dequantize_rows(w.blocks[safe], w.qtype, xp=jnp)  # (T, S, N, K) float32
    else:
        chosen = w[safe]
    xr = _expert_rows(x, s).astype(chosen.dtype)
    return jnp.einsum("tsk,tsnk->tsn", xr, chosen, preferred_element_type=jnp.float32)


def _experts_looped(x: Array, w: Array | QTensor, ids: Array) -> Array:
    """Expert by expert (a scan), each multiplying every row and kept where it was chosen; an
    expert no row chose is skipped (its bytes are not read). For many rows (a prefill), where
    gathering a matrix per row would copy more than the whole stack."""
    t, s = ids.shape
    n_experts = int(w.blocks.shape[0] if isinstance(w, QTensor) else w.shape[0])
    xr = _expert_rows(x, s)

    def one(acc: Array, e: Array) -> tuple[Array, None]:
        def product(acc: Array) -> Array:
            if isinstance(w, QTensor):
                we = dequantize_rows(lax.dynamic_index_in_dim(w.blocks, e, keepdims=False),
                                     w.qtype, xp=jnp)
            else:
                we = lax.dynamic_index_in_dim(w, e, keepdims=False)
            y = jnp.einsum("tsk,nk->tsn", xr.astype(we.dtype), we,
                           preferred_element_type=jnp.float32)
            return jnp.where((ids == e)[..., None], y, acc)

        return lax.cond(jnp.any(ids == e), product, lambda a: a, acc), None

    n = int(w.blocks.shape[1] if isinstance(w, QTensor) else w.shape[1])
    acc, _ = lax.scan(one, jnp.zeros((t, s, n), jnp.float32), jnp.arange(n_experts))
    return acc


def _experts_listed(x: Array, ws: Sequence[Array], ids: Array) -> Array:
    """Experts bound one array each (a Hugging Face checkpoint's ``experts.{j}`` tensors):
    each multiplies every row where some row chose it, and is skipped (not read) otherwise."""
    t, s = ids.shape
    xr = _expert_rows(x, s)
    acc = jnp.zeros((t, s, int(ws[0].shape[0])), jnp.float32)
    for e, we in enumerate(ws):
        def product(acc: Array, we: Array = we, e: int = e) -> Array:
            y = jnp.einsum("tsk,nk->tsn", xr.astype(we.dtype), we,
                           preferred_element_type=jnp.float32)
            return jnp.where((ids == e)[..., None], y, acc)

        acc = lax.cond(jnp.any(ids == e), product, lambda a: a, acc)
    return acc


def _experts_portable(x: Array, w: Array | QTensor, ids: Array) -> Array:
    n_experts = int(w.blocks.shape[0] if isinstance(w, QTensor) else w.shape[0])
    # Gathering copies one matrix per (token, slot): cheaper than the loop while they number
    # no more than the experts (a constant once a bucket compiles: the batch may be symbolic).
    few = jnp.asarray(ids.shape[0] * ids.shape[1]) <= n_experts
    return lax.cond(few, lambda: _experts_gathered(x, w, ids),
                    lambda: _experts_looped(x, w, ids))


def expert_linear(x: Array, w: Array | QTensor | Sequence[Array], ids: Array,
                  rows: Array | None = None) -> Array:
    """The products of a Mixture-of-Experts layer: ``y[t, s] = x[t] @ W[ids[t, s]].T``.

    Args:
        x: ``(T, K)``, each token's row multiplied by each of its experts (gate, up), or
            ``(T, S, K)``, one row per chosen expert (down).
        w: the stacked expert matrices as stored, ``(E, N, K)`` (each ``(out, in)``): a float
            array, or a :class:`QTensor` of blocks ``(E, N, row_bytes)`` (GGUF ``ffn_*_exps``);
            or a sequence of E float ``(N, K)`` arrays, one per expert.
        ids: ``(T, S)`` int32, the experts each token chose, in ``[0, E)``.
        rows: ``(T,)`` bool or int, the tokens that matter (as for :func:`quant_matmul`); the
            others' results are zeros on the CPU kernel and computed as usual elsewhere, so a
            caller must ignore them.

    Returns:
        ``(T, S, N)`` float32.

    Packed blocks lower to ``platform_dependent(cpu=<MOE_TARGET>, default=<portable>)``: the CPU
    kernel reads only the chosen experts' blocks, each once for all the rows that chose it
    (ggml's ``mul_mat_id``). The portable form (float weights on every platform, packed ones
    off the CPU) gathers each row's expert matrices for a few rows and otherwise loops over
    the experts, skipping those no row chose; both read no unchosen expert.

    Raises:
        SpecError: shapes that disagree, or a GGML type without a kernel.
    """
    t, s = ids.shape  # t may be symbolic (a stage's batch)
    if isinstance(w, Sequence):  # one array per expert (arrays are no Sequence)
        shapes = {tuple(int(d) for d in we.shape) for we in w}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise SpecError(f"expert_linear: expected E matrices (N, K) of one shape, found "
                            f"{sorted(shapes)}")
        (_, k), = shapes
        if int(x.shape[-1]) != k:
            raise SpecError(f"expert_linear: x has {x.shape[-1]} features, the experts {k}")
        return _experts_listed(x, w, ids.astype(jnp.int32))
    stored = w.stored_shape if isinstance(w, QTensor) else tuple(int(d) for d in w.shape)
    if len(stored) != 3 or (isinstance(w, QTensor) and w.transposed):
        raise SpecError(f"expert_linear: expected stacked expert matrices (E, N, K) as stored, "
                        f"found shape {stored}")
    k = stored[2]
    if int(x.shape[-1]) != k or x.ndim not in (2, 3) or (x.ndim == 3 and int(x.shape[1]) != s):
        raise SpecError(f"expert_linear: x has shape {tuple(x.shape)}, expected (T, {k}) or "
                        f"(T, {s}, {k}) for ids (T, {s}) and experts of {k} inputs")
    ids = ids.astype(jnp.int32)
    if not isinstance(w, QTensor):
        return _experts_portable(x, w, ids)
    if w.qtype not in KERNEL_TYPES:
        raise SpecError(f"expert_linear: GGML type {w.qtype!r} has no kernel; expected one of "
                        f"{', '.join(KERNEL_TYPES)} (bind other types dequantized)")
    x2 = x.astype(jnp.float32).reshape((-1, k))
    kernel_ids = ids if rows is None else jnp.where(
        jnp.asarray(rows).reshape((-1, 1)) != 0, ids, -1)

    def cpu(x2: Array, blocks: Array, i: Array) -> Array:
        call = jax.ffi.ffi_call(MOE_TARGET, jax.ShapeDtypeStruct((t, s, stored[1]), jnp.float32))
        return call(x2, blocks, i, ggml_type=np.int32(GGMLQuantizationType[w.qtype].value))

    def default(x2: Array, blocks: Array, i: Array) -> Array:
        return _experts_portable(x2.reshape(x.shape), dataclasses.replace(w, blocks=blocks), ids)

    return lax.platform_dependent(x2, w.blocks, kernel_ids, cpu=cpu, default=default)
