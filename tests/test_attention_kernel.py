"""The CPU attention kernel (``jaxdist_cache_attention_v1``) against independent references.

The expected values are a float64 numpy attention written here from the semantics in
``exporters/layers.py`` (query ``pos + i`` sees keys ``j <= pos + i``, ``j < pos + length``,
``j < max_seq``), and the exporter's own portable jnp form of the same read, under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxdist.core import kernels
from jaxdist.core.kernels import ops
from jaxdist.exporters import layers

INFO = kernels.load()
pytestmark = pytest.mark.skipif(not INFO.available,
                                reason=f"CPU kernels unavailable here: {INFO.reason}")


def _reference(q, kc, vc, slot, pos, length):
    """float64 attention of each query over the cache positions it sees; zeros if none."""
    b, s, h, d = q.shape
    slots, n_kv, t, _ = kc.shape
    out = np.zeros((b, s, h, d))
    for r in range(b):
        sl = min(max(int(slot[r]), 0), slots - 1)
        if length[r] <= 0:
            continue
        for i in range(s):
            seen = max(0, min(int(pos[r]) + i + 1, int(pos[r] + length[r]), t))
            for hh in range(h):
                kv = hh // (h // n_kv)
                keys = kc[sl, kv, :seen].astype(np.float64)
                sc = keys @ q[r, i, hh].astype(np.float64) / np.sqrt(d)
                p = np.exp(sc - sc.max())
                out[r, i, hh] = (p / p.sum()) @ vc[sl, kv, :seen]
    return out


def _run_kernel(*args):
    with ops.exporting_for_kernels():
        fn = jax.jit(lambda *a: ops.cache_attention(*a, scale=a[0].shape[3] ** -0.5,
                                                    portable=layers._attend))
        compiled = fn.lower(*args).compile()
    assert kernels.ATTENTION_TARGET in compiled.as_text()
    return np.asarray(compiled(*args))


def _case(rng, b, s, h, n_kv, d, t=40, slots=5):
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kc = rng.standard_normal((slots, n_kv, t, d)).astype(np.float32)
    vc = rng.standard_normal((slots, n_kv, t, d)).astype(np.float32)
    slot = rng.permutation(slots)[:b].astype(np.int32) if b <= slots else \
        (np.arange(b) % slots).astype(np.int32)
    pos = rng.integers(0, t - s, b).astype(np.int32)
    length = rng.integers(1, s + 1, b).astype(np.int32)
    return q, kc, vc, slot, pos, length


@pytest.mark.parametrize("b,s,h,n_kv,d", [(1, 1, 9, 3, 64), (4, 1, 9, 3, 64), (8, 1, 4, 4, 32),
                                          (2, 3, 6, 2, 20), (3, 8, 8, 1, 64), (1, 5, 2, 2, 7)])
def test_kernel_matches_references(b: int, s: int, h: int, n_kv: int, d: int) -> None:
    rng = np.random.default_rng(b * 100 + s * 10 + d)
    args = _case(rng, b, s, h, n_kv, d)
    got = _run_kernel(*args)
    np.testing.assert_allclose(got, _reference(*args), rtol=2e-5, atol=2e-6)
    portable = np.asarray(jax.jit(layers._attend)(*args))
    np.testing.assert_allclose(got, portable, rtol=2e-5, atol=2e-6)


def test_edges_idle_rows_cache_end_and_slot_clamp() -> None:
    """A row of length 0 gets zeros; a query past max_seq sees the whole cache; a slot out of
    range is clamped as XLA's gather clamps it (never read out of bounds)."""
    rng = np.random.default_rng(7)
    q, kc, vc, _, _, _ = _case(rng, 4, 2, 4, 2, 16, t=12, slots=3)
    slot = np.array([0, 2, 7, -3], np.int32)
    pos = np.array([12, 10, 3, 0], np.int32)
    length = np.array([0, 2, 2, 1], np.int32)
    got = _run_kernel(q, kc, vc, slot, pos, length)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got, _reference(q, kc, vc, slot, pos, length), rtol=2e-5,
                               atol=2e-6)
    portable = np.asarray(jax.jit(layers._attend)(q, kc, vc, slot, pos, length))
    np.testing.assert_allclose(got[1:], portable[1:], rtol=2e-5, atol=2e-6)


def test_large_scores_stay_finite() -> None:
    """Scores far apart (softmax saturates) and far below zero give the reference, not NaN."""
    rng = np.random.default_rng(8)
    q, kc, vc, slot, pos, length = _case(rng, 2, 1, 4, 2, 32, t=30)
    q *= 40.0
    got = _run_kernel(q, kc, vc, slot, pos, length)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(q, kc, vc, slot, pos, length), rtol=1e-4,
                               atol=1e-5)


def test_long_steps_keep_xla_and_only_kernel_stages_call_it() -> None:
    """Above ATTENTION_MAX_QUERIES tokens per row (prefill) the CPU compile keeps XLA's dots;
    outside exporting_for_kernels there is no custom call at all; the exported module keeps
    the portable read for GPU/TPU."""
    rng = np.random.default_rng(9)
    args = _case(rng, 1, ops.ATTENTION_MAX_QUERIES + 1, 4, 2, 16)

    def f(*a):
        return ops.cache_attention(*a, scale=0.25, portable=layers._attend)

    with ops.exporting_for_kernels():
        long = jax.jit(f).lower(*args).compile().as_text()
    assert kernels.ATTENTION_TARGET not in long
    plain = jax.jit(lambda *a: f(*a)).lower(*args).as_text()  # a new trace, outside
    assert kernels.ATTENTION_TARGET not in plain
    (b, s) = export.symbolic_shape("b, s")
    shapes = [jax.ShapeDtypeStruct((b, s, 4, 16), jnp.float32),
              *(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[1:3]),
              *(jax.ShapeDtypeStruct((b,), jnp.int32) for _ in range(3))]
    with ops.exporting_for_kernels():
        exp = export.export(jax.jit(f), platforms=("cpu", "cuda", "tpu"),
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(
                                kernels.ATTENTION_TARGET)])(*shapes)
    text = exp.mlir_module()
    assert kernels.ATTENTION_TARGET in text and "stablehlo.dot_general" in text
    short = _case(rng, 2, 1, 4, 2, 16)
    np.testing.assert_allclose(np.asarray(exp.call(*short)), _reference(*short), rtol=2e-5,
                               atol=2e-6)


def test_error_shapes_checked_by_the_kernel() -> None:
    q = np.zeros((1, 1, 5, 8), np.float32)  # 5 query heads over 2 key/value heads
    kc = np.zeros((2, 2, 4, 8), np.float32)
    ints = np.zeros((1,), np.int32)
    call = jax.ffi.ffi_call(kernels.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    with pytest.raises(Exception, match=r"jaxdist_cache_attention_v1: 5 query heads is not a "
                                        r"multiple of 2 key/value heads"):
        jax.jit(lambda *a: call(*a, scale=np.float32(1)))(q, kc, kc, ints, ints,
                                                          ints).block_until_ready()
    q4 = q[:, :, :4]
    call4 = jax.ffi.ffi_call(kernels.ATTENTION_TARGET,
                             jax.ShapeDtypeStruct(q4.shape, jnp.float32))
    with pytest.raises(Exception, match=r"head dim 8 of q, 4 of the cache"):
        jax.jit(lambda *a: call4(*a, scale=np.float32(1)))(
            q4, kc[..., :4], kc[..., :4], ints, ints, ints).block_until_ready()
