"""The mixture-of-experts kernel (``jaxdist_ggml_moe_matmul_v1``) against independent references.

y[t, s] = x_row @ W_e.T for e = ids[t, s], with x_row = x[t] (x has T rows: gate/up) or
x[t * S + s] (T * S rows: down), and zeros where e < 0. Two references:

- the dense kernel (``jaxdist_ggml_matmul_v2``) run per expert on the rows that chose it: the
  same activation quantization and dot products, so the two agree to float32 rounding of the
  sums' order (every type with a kernel);
- ``gguf.quants`` dequantization and a float64 numpy product, within the bound that the
  activations' quantization allows (:func:`ggml_blocks.activation_error`, as in
  tests/test_kernels.py).

Both with jaxdist's wide dot products and ggml's (``kernels.set_isa``), where the CPU has the
wide ones.
"""

from __future__ import annotations

import functools
import zlib

import ggml_blocks
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.core import kernels
from jaxdist.core.kernels import ops

INFO = kernels.load()
pytestmark = pytest.mark.skipif(not INFO.available,
                                reason=f"CPU kernels unavailable here: {INFO.reason}")

E, S = 8, 2  # experts, experts per token
SHAPES = ((256, 48), (512, 96))  # (K, N)


def _type(qtype: str) -> np.int32:
    return np.int32(gguf.GGMLQuantizationType[qtype].value)


@functools.partial(jax.jit, static_argnames="qtype")
def _moe(x: jax.Array, w: jax.Array, ids: jax.Array, qtype: str) -> jax.Array:
    t, s = ids.shape
    call = jax.ffi.ffi_call(kernels.MOE_TARGET,
                            jax.ShapeDtypeStruct((t, s, w.shape[1]), jnp.float32))
    return call(x, w, ids, ggml_type=_type(qtype))


@functools.partial(jax.jit, static_argnames="qtype")
def _dense(x: jax.Array, w: jax.Array, rows: jax.Array, qtype: str) -> jax.Array:
    call = jax.ffi.ffi_call(kernels.TARGET,
                            jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w, rows, ggml_type=_type(qtype))


@functools.cache
def _experts(qtype: str, k: int, n: int, e: int = E) -> tuple[np.ndarray, np.ndarray]:
    """Random experts quantized to ``qtype``: blocks (E, N, row_bytes) and their gguf.quants
    decoding (E, N, K)."""
    rng = np.random.default_rng(zlib.crc32(f"moe{qtype}{k}{n}{e}".encode()))
    w = rng.standard_normal((e * n, k)).astype(np.float32)
    blocks = ggml_blocks.quantize(w, qtype)
    return blocks.reshape(e, n, -1), ggml_blocks.dequantize(blocks, qtype).reshape(e, n, k)


def _cases(rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """(name, ids) for T = 1 (decode) and T = 37 (more than kMaxMulti rows per expert)."""
    top = np.argsort(rng.random((37, E)), axis=1)[:, :S].astype(np.int32)  # distinct per token
    top[3] = -1                       # a masked token
    top[rng.random((37, S)) < 0.1] = -1  # padding slots
    same = np.full((37, S), 5, np.int32)  # every (t, s) picks expert 5
    same[0, 1] = -1
    decode = np.argsort(rng.random(E))[None, :S].astype(np.int32)  # 1 token x 2 experts
    return [("decode", decode), ("batch", top), ("one expert", same)]


def _x_rows(ids: np.ndarray, down: bool) -> np.ndarray:
    """The row of x of each (t, s) pair, flattened."""
    t, s = ids.shape
    return np.arange(t * s) if down else np.repeat(np.arange(t), s)


def _per_expert_dense(x: np.ndarray, blocks: np.ndarray, ids: np.ndarray, qtype: str,
                      down: bool) -> np.ndarray:
    """The dense kernel on each chosen expert, its rows masked to those that chose it."""
    flat, rows = ids.reshape(-1), _x_rows(ids, down)
    out = np.zeros((flat.size, blocks.shape[1]), np.float32)
    for e in np.unique(flat[flat >= 0]):
        mask = np.zeros(x.shape[0], np.int32)
        mask[rows[flat == e]] = 1
        y_e = np.asarray(_dense(x, blocks[e], mask, qtype))
        out[flat == e] = y_e[rows[flat == e]]
    return out.reshape(*ids.shape, -1)


@pytest.fixture(params=["wide", "ggml"])
def isa(request: pytest.FixtureRequest):
    """Each test once with jaxdist's wide dot products, once with ggml's; restored after."""
    before = kernels.loaded().isa
    got = kernels.set_isa(request.param == "wide").isa
    if request.param == "wide" and got != "avx512vnni":
        kernels.set_isa(before == "avx512vnni")
        pytest.skip("jaxdist's wide dot products need a CPU with AVX-512 VNNI and VBMI")
    yield request.param
    kernels.set_isa(before == "avx512vnni")


def _run_cases(qtype: str, check) -> None:
    """check(name, x, blocks, wd, ids, down, y) for every case, shape and kind of x."""
    rng = np.random.default_rng(zlib.crc32(b"cases" + qtype.encode()))
    for k, n in SHAPES:
        blocks, wd = _experts(qtype, k, n)
        for name, ids in _cases(rng):
            for down in (False, True):
                x = rng.standard_normal((ids.size if down else ids.shape[0], k)).astype(np.float32)
                y = np.asarray(_moe(x, blocks, ids, qtype))
                assert y.shape == (*ids.shape, n) and y.dtype == np.float32
                np.testing.assert_array_equal(y[ids < 0], 0.0)
                where = f"{qtype} K={k} N={n} {name} T={ids.shape[0]} {'down' if down else 'up'}"
                check(where, x, blocks, wd, ids, down, y)


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES)
def test_moe_matches_the_dense_kernel_per_expert(isa: str, qtype: str) -> None:
    """Every case of _cases, both kinds of x, two shapes; with the wide ISA, the wide types'
    results must differ from ggml's somewhere (the wide path ran)."""
    differ = 0

    def check(where, x, blocks, wd, ids, down, y):
        nonlocal differ
        ref = _per_expert_dense(x, blocks, ids, qtype, down)
        xr = x[_x_rows(ids, down)]
        wsel = np.abs(wd[np.maximum(ids.reshape(-1), 0)])
        scale = np.einsum("pk,pnk->pn", np.abs(xr), wsel).reshape(y.shape)
        # the same quantized rows and products: float32 rounding of the sums' order only
        np.testing.assert_array_less(np.abs(y - ref), 2e-6 * scale + 1e-6, err_msg=where)
        if isa == "wide" and qtype in ops.WIDE_TYPES:
            kernels.set_isa(False)
            differ += not np.array_equal(y, np.asarray(_moe(x, blocks, ids, qtype)))
            kernels.set_isa(True)

    _run_cases(qtype, check)
    assert differ or isa != "wide" or qtype not in ops.WIDE_TYPES, "did the wide path run?"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_moe_matches_the_float64_reference(isa: str, qtype: str) -> None:
    def check(where, x, blocks, wd, ids, down, y):
        xr = x[_x_rows(ids, down)].astype(np.float64)
        flat = ids.reshape(-1)
        w_sel = wd[np.maximum(flat, 0)].astype(np.float64)
        ref = np.einsum("pk,pnk->pn", xr, w_sel)
        bound = np.einsum("pk,pnk->pn", ggml_blocks.activation_error(xr, qtype), np.abs(w_sel))
        bound += 1e-5 * np.einsum("pk,pnk->pn", np.abs(xr), np.abs(w_sel)) + 1e-6
        live = flat >= 0
        err = np.abs(y.reshape(flat.size, -1) - ref)[live]
        assert (err <= bound[live]).all(), (f"{where}: error {err.max():.3g} over the "
                                            f"activation-quantization bound")

    _run_cases(qtype, check)


def test_moe_decode_split_across_threads_changes_nothing() -> None:
    """One token and two chosen experts of 295 KB each: the (expert, chunk) items go to two
    threads; every result is computed whole by one thread, so the bits are those of one."""
    blocks, _ = _experts("Q4_K", 1024, 512, e=4)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    ids = np.array([[3, 1]], np.int32)
    try:
        kernels.load(threads=1)
        one = np.asarray(_moe(x, blocks, ids, "Q4_K"))
        kernels.load(threads=2)
        two = np.asarray(_moe(x, blocks, ids, "Q4_K"))
    finally:
        kernels.load(threads=0)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_less(np.abs(two - _per_expert_dense(x, blocks, ids, "Q4_K", False)),
                                 1e-5 * np.abs(two).max())


def test_error_moe_ids_and_shapes_checked_by_the_kernel() -> None:
    """An id past the experts, x rows that are neither T nor T * S, and wrong ranks or row
    sizes fail with a message naming the target, never by reading past a buffer."""
    blocks, _ = _experts("Q8_0", 256, 48)
    x = np.zeros((3, 256), np.float32)
    ids = np.array([[0, 1], [2, E], [4, 5]], np.int32)
    with pytest.raises(Exception, match=r"jaxdist_ggml_moe_matmul_v1: ids\[1, 1\] = 8 is not "
                                        r"an expert: w holds 8 \(E\)"):
        _moe(x, blocks, ids, "Q8_0").block_until_ready()
    with pytest.raises(Exception, match=r"jaxdist_ggml_moe_matmul_v1: x has 4 rows, expected "
                                        r"T = 3 \(one per token\) or T \* S = 6"):
        _moe(np.zeros((4, 256), np.float32), blocks, ids % E, "Q8_0").block_until_ready()
    with pytest.raises(Exception, match=r"jaxdist_ggml_moe_matmul_v1: expected x \(R, K\), "
                                        r"w \(E, N, row_bytes\), ids \(T, S\)"):
        _moe(x, blocks[0], ids % E, "Q8_0").block_until_ready()
    with pytest.raises(Exception, match=r"jaxdist_ggml_moe_matmul_v1: w rows hold 272 bytes, "
                                        r"expected 136 for K = 128 of q8_0"):
        _moe(x[:, :128], blocks, ids % E, "Q8_0").block_until_ready()
