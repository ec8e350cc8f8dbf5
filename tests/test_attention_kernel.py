"""The CPU attention kernel (``jaxdist_cache_attention_v1``, and ``_v2`` with a sliding window)
against independent references.

The expected values are a float64 numpy attention written here from the semantics in
``exporters/layers.py`` (query ``pos + i`` sees keys ``j <= pos + i``, ``j < pos + length``,
``j < max_seq``, and ``j > pos + i - window`` with a window), and the exporter's own portable jnp
form of the same read, under ``jax.jit``.

The kernel runs a call's (row, query, key/value head) units on the library's helper threads and
picks AVX-512F or AVX2 code at run time (``kernels.set_isa``); callers rely on a query's result
being the same bits whatever the thread count, the number of queries in the step and the other
rows, which the tests below check bit for bit.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxdist.core import kernels
from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import ops
from jaxdist.exporters import layers

INFO = kernels.load()
pytestmark = pytest.mark.skipif(not INFO.available,
                                reason=f"CPU kernels unavailable here: {INFO.reason}")


def _reference(q, kc, vc, slot, pos, length, window=0):
    """float64 attention of each query over the cache positions it sees; zeros if none. With a
    window, query p sees only the keys j > p - window."""
    b, s, h, d = q.shape
    slots, n_kv, t, _ = kc.shape
    out = np.zeros((b, s, h, d))
    for r in range(b):
        sl = min(max(int(slot[r]), 0), slots - 1)
        if length[r] <= 0:
            continue
        for i in range(s):
            seen = max(0, min(int(pos[r]) + i + 1, int(pos[r] + length[r]), t))
            first = max(0, int(pos[r]) + i + 1 - window) if window else 0
            if first >= seen:
                continue
            for hh in range(h):
                kv = hh // (h // n_kv)
                keys = kc[sl, kv, first:seen].astype(np.float64)
                sc = keys @ q[r, i, hh].astype(np.float64) / np.sqrt(d)
                p = np.exp(sc - sc.max())
                out[r, i, hh] = (p / p.sum()) @ vc[sl, kv, first:seen]
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


def test_every_step_length_calls_the_kernel_and_only_kernel_stages_call_it() -> None:
    """On the CPU every step calls the kernel, a 65-query prefill chunk as a decode step;
    outside exporting_for_kernels there is no custom call at all; the exported module keeps
    the portable read for GPU/TPU."""
    rng = np.random.default_rng(9)
    args = _case(rng, 1, 65, 4, 2, 16, t=80)

    def f(*a):
        return ops.cache_attention(*a, scale=0.25, portable=layers._attend)

    got = _run_kernel(*args)  # asserts the kernel is in the compiled module
    np.testing.assert_allclose(got, _reference(*args), rtol=2e-5, atol=2e-6)
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
    short = _case(rng, 2, 1, 4, 2, 16, t=80)
    np.testing.assert_allclose(np.asarray(exp.call(*short)), _reference(*short), rtol=2e-5,
                               atol=2e-6)


def test_a_querys_bits_do_not_depend_on_the_chunk_that_carries_it() -> None:
    """A prompt's queries attended in one 64-query step, in 16-query chunks, and one by one
    (as decode), all through ops.cache_attention on the CPU: the same bits. The engine chunks a
    prompt differently when other prompts wait, so its greedy answer must not see it."""
    rng = np.random.default_rng(10)
    q, kc, vc, _, _, _ = _case(rng, 1, 64, 9, 3, 64, t=96, slots=2)
    slot = np.array([1], np.int32)

    def attend(p0: int, n: int) -> np.ndarray:
        return _run_kernel(q[:, p0:p0 + n], kc, vc, slot, np.array([p0], np.int32),
                           np.array([n], np.int32))

    whole = attend(0, 64)
    chunks = np.concatenate([attend(p0, 16) for p0 in range(0, 64, 16)], axis=1)
    single = np.concatenate([attend(p0, 1) for p0 in (0, 17, 40, 63)], axis=1)
    np.testing.assert_array_equal(chunks, whole)
    np.testing.assert_array_equal(single, whole[:, [0, 17, 40, 63]])
    np.testing.assert_allclose(whole, _reference(q, kc, vc, slot, np.array([0], np.int32),
                                                 np.array([64], np.int32)),
                               rtol=2e-5, atol=2e-6)


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


# ---- the kernel called directly --------------------------------------------------------------

def _direct(q, kc, vc, slot, pos, length) -> np.ndarray:
    call = jax.ffi.ffi_call(kernels.ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    scale = np.float32(q.shape[3] ** -0.5)
    return np.asarray(jax.jit(lambda *a: call(*a, scale=scale))(q, kc, vc, slot, pos, length))


def _has_avx512f() -> bool:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


@pytest.fixture(params=["wide", "avx2"])
def isa(request):
    """Runs the test with attention's AVX-512F path (where the CPU has it), then its AVX2 one."""
    if request.param == "wide" and not _has_avx512f():
        pytest.skip("this CPU has no AVX-512F")
    kernels.set_isa(request.param == "wide")
    yield request.param
    kernels.set_isa(True)


def _batch(rng, b, s, h, n_kv, d, t, *, idle=(), near_end=()):
    """Rows of a step of s queries: random positions, some rows idle (length 0), some placed so
    that their queries run past the cache end (they see every position)."""
    q = rng.standard_normal((b, s, h, d)).astype(np.float32)
    slots = b + 1
    kc = rng.standard_normal((slots, n_kv, t, d)).astype(np.float32)
    vc = rng.standard_normal((slots, n_kv, t, d)).astype(np.float32)
    slot = rng.permutation(slots)[:b].astype(np.int32)
    pos = rng.integers(0, max(1, t - s), b).astype(np.int32)
    length = rng.integers(1, s + 1, b).astype(np.int32)
    for r in idle:
        length[r] = 0
    for r in near_end:
        pos[r], length[r] = t - 1 - s // 2, s
    return q, kc, vc, slot, pos, length


@pytest.mark.parametrize("b", [1, 3, 16])
@pytest.mark.parametrize("s", [1, 5, 16, 40])
def test_kernel_any_step_matches_portable(isa: str, b: int, s: int) -> None:
    """B rows of S queries, grouped-query heads (12 over 4, head dim 64; 6 over 2, head dim 20),
    idle rows and rows at the cache end, against the exporter's jnp attention."""
    for h, n_kv, d in ((12, 4, 64), (6, 2, 20)):
        rng = np.random.default_rng(1000 * b + 10 * s + d)
        t = s + 50
        idle = (b - 1,) if b > 1 else ()
        near_end = (0,) if b > 2 else ()
        args = _batch(rng, b, s, h, n_kv, d, t, idle=idle, near_end=near_end)
        got = _direct(*args)
        live = args[5] > 0
        np.testing.assert_array_equal(got[~live], 0.0)
        portable = np.asarray(jax.jit(layers._attend)(*args))
        np.testing.assert_allclose(got[live], portable[live], rtol=2e-5, atol=2e-6,
                                   err_msg=f"{isa} B={b} S={s} H={h}/{n_kv} D={d}")
        np.testing.assert_allclose(got, _reference(*args), rtol=2e-5, atol=2e-6)


def test_head_dims_of_every_code_path(isa: str) -> None:
    """Head dims with their own code (64, 128), others with a partial last vector (8, 24, 72,
    100), key counts with and without a partial last block (1, 7, 8, 15, 16, 17, 33 and more),
    and many query heads per key/value head (32 over 1)."""
    rng = np.random.default_rng(21)
    for h, n_kv, d in ((8, 2, 64), (4, 2, 128), (6, 3, 8), (4, 4, 24), (6, 2, 72), (3, 1, 100),
                       (32, 1, 16)):
        q, kc, vc, slot, _, _ = _batch(rng, 8, 1, h, n_kv, d, 70)
        pos = np.array([0, 6, 7, 14, 15, 16, 32, 69], np.int32)
        length = np.ones(8, np.int32)
        got = _direct(q, kc, vc, slot, pos, length)
        np.testing.assert_allclose(got, _reference(q, kc, vc, slot, pos, length), rtol=2e-5,
                                   atol=2e-6, err_msg=f"{isa} H={h}/{n_kv} D={d}")


def test_a_query_gives_the_same_bits_in_any_step(isa: str) -> None:
    """A query at position p: alone (S=1, B=1), inside a 16-query prefill chunk, and inside a
    batch of other rows (B=3, the row in the middle), bit for bit."""
    rng = np.random.default_rng(31)
    h, n_kv, d, t, s = 9, 3, 64, 256, 16
    q, kc, vc, _, _, _ = _batch(rng, 3, s, h, n_kv, d, t)
    slot = np.array([2, 0, 1], np.int32)
    pos = np.array([5, 180, 40], np.int32)
    length = np.array([16, 16, 9], np.int32)
    batch = _direct(q, kc, vc, slot, pos, length)
    row = _direct(q[1:2], kc, vc, slot[1:2], pos[1:2], length[1:2])
    np.testing.assert_array_equal(batch[1], row[0])
    for i in range(s):
        one = _direct(q[1:2, i:i + 1], kc, vc, slot[1:2], pos[1:2] + i, np.ones(1, np.int32))
        np.testing.assert_array_equal(one[0, 0], row[0, i], err_msg=f"{isa} query {i}")
    for i in range(9):  # a shorter row: its queries past its length see what its last sees
        one = _direct(q[2:3, i:i + 1], kc, vc, slot[2:3], pos[2:3] + i, np.ones(1, np.int32))
        np.testing.assert_array_equal(one[0, 0], batch[2, i])


def _split_case() -> tuple[np.ndarray, ...]:
    """A step large enough that the kernel splits it over threads (16 rows x 16 queries, up to
    about 300 visible keys, 32 query heads)."""
    rng = np.random.default_rng(41)
    args = _batch(rng, 16, 16, 32, 8, 64, 320, idle=(3,), near_end=(5,))
    return args


def test_threads_change_no_bits(isa: str) -> None:
    """1, 2 and 3 threads give the same bits (each (row, query, head group) is computed whole
    by one thread, as it would be alone)."""
    args = _split_case()
    try:
        kernels.load(threads=1)
        one = _direct(*args)
        kernels.load(threads=2)
        two = _direct(*args)
        kernels.load(threads=3)
        three = _direct(*args)
    finally:
        kernels.load(threads=0)
    np.testing.assert_array_equal(one, two)
    np.testing.assert_array_equal(one, three)
    live = args[5] > 0
    portable = np.asarray(jax.jit(layers._attend)(*args))
    np.testing.assert_allclose(one[live], portable[live], rtol=2e-5, atol=2e-6)


def test_wide_and_avx2_paths_both_ran_and_agree() -> None:
    """The AVX-512F and AVX2 paths differ in the order of their sums, so some results differ in
    the last bits (which shows that set_isa switched attention too), within float32 rounding."""
    if not _has_avx512f():
        pytest.skip("this CPU has no AVX-512F")
    args = _split_case()
    try:
        kernels.set_isa(False)
        avx2 = _direct(*args)
        kernels.set_isa(True)
        wide = _direct(*args)
    finally:
        kernels.set_isa(True)
    assert not np.array_equal(wide, avx2), "set_isa did not switch attention's vector code"
    np.testing.assert_allclose(wide, avx2, rtol=2e-5, atol=2e-6)


_SUBPROCESS = """
import sys
import numpy as np
from jaxdist.core import kernels
sys.path.insert(0, {tests!r})
import test_attention_kernel as t
info = kernels.load()
np.save({out!r}, t._direct(*t._split_case()))
print(info.cpus)
"""


@pytest.mark.parametrize("env_isa", ["", "avx2"])
def test_pinned_process_gives_the_same_bits(tmp_path: pathlib.Path, env_isa: str) -> None:
    """A process pinned to one core (one thread by default: no helper) computes the bits this
    process computes on 2 threads; with JAXDIST_KERNELS_ISA=avx2 it runs the AVX2 path, the bits
    of set_isa(False) here."""
    out = tmp_path / "y.npy"
    env = {**os.environ, "JAXDIST_KERNELS_ISA": env_isa}
    code = _SUBPROCESS.format(tests=str(pathlib.Path(__file__).parent), out=str(out))
    cpus = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable,
                           "-c", code], env=env, capture_output=True, text=True, timeout=180,
                          check=True).stdout.split()
    assert cpus[-1] == "1"
    try:
        kernels.load(threads=2)
        kernels.set_isa(env_isa != "avx2")
        here = _direct(*_split_case())
    finally:
        kernels.load(threads=0)
        kernels.set_isa(True)
    np.testing.assert_array_equal(np.load(out), here)


# ---- sliding-window attention (jaxdist_cache_attention_v2) and the v1 interface it left alone ---

def _direct_v2(q, kc, vc, slot, pos, length, window) -> np.ndarray:
    call = jax.ffi.ffi_call(kernels.ATTENTION_V2_TARGET,
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    scale = np.float32(q.shape[3] ** -0.5)
    return np.asarray(jax.jit(lambda *a: call(*a, scale=scale, window=np.int32(window)))(
        q, kc, vc, slot, pos, length))


def _true_queries(length: np.ndarray, s: int) -> np.ndarray:
    """(b, s) mask of the queries that are tokens, not padding: a padding query past the window
    sees no key (zeros from the kernel, garbage from the portable form; callers ignore both)."""
    return np.arange(s)[None, :] < length[:, None]


def _seeing(pos: np.ndarray, length: np.ndarray, s: int, t: int, window: int) -> np.ndarray:
    """The true queries that see at least one key: a query past the cache end whose window lies
    wholly past it sees none (the kernel gives zeros, the portable form garbage)."""
    p = pos[:, None] + np.arange(s)[None, :]
    return _true_queries(length, s) & (p + 1 - window < t)


@pytest.mark.parametrize("s", [1, 5, 16, 40])
def test_window_matches_reference_and_portable(isa: str, s: int) -> None:
    """Windows of 1, 3, 8 and 17 keys (and one longer than the cache: full attention), rows at
    random positions, idle rows and rows at the cache end, against the float64 reference and
    the exporter's portable read with the same window."""
    for h, n_kv, d in ((12, 4, 64), (6, 2, 20)):
        rng = np.random.default_rng(500 + 10 * s + d)
        t = s + 50
        args = _batch(rng, 5, s, h, n_kv, d, t, idle=(4,), near_end=(0,))
        true = _true_queries(args[5], s)
        for window in (1, 3, 8, 17, t + 5):
            got = _direct_v2(*args, window)
            where = f"{isa} S={s} H={h}/{n_kv} D={d} window={window}"
            np.testing.assert_array_equal(got[args[5] == 0], 0.0)
            np.testing.assert_allclose(got[true], _reference(*args, window=window)[true],
                                       rtol=2e-5, atol=2e-6, err_msg=where)
            portable = np.asarray(jax.jit(lambda *a, w=window: layers._attend(*a, window=w))(
                *args))
            seeing = _seeing(args[4], args[5], s, t, window)
            np.testing.assert_allclose(got[seeing], portable[seeing], rtol=2e-5, atol=2e-6,
                                       err_msg=where)
        # A window that covers every position a query can see (queries past the cache end
        # included) is full attention, bit for bit.
        np.testing.assert_array_equal(_direct_v2(*args, t + s), _direct(*args))
        np.testing.assert_array_equal(_direct_v2(*args, 0), _direct(*args))


def test_window_through_ops_calls_v2_and_full_attention_calls_v1() -> None:
    """ops.cache_attention lowers a window to the v2 target and full attention to v1."""
    rng = np.random.default_rng(61)
    args = _case(rng, 3, 4, 8, 2, 32, t=40)

    def lowered(window: int) -> tuple[str, np.ndarray]:
        with ops.exporting_for_kernels():
            fn = jax.jit(lambda *a: ops.cache_attention(
                *a, scale=a[0].shape[3] ** -0.5, window=window,
                portable=functools.partial(layers._attend, window=window)))
            compiled = fn.lower(*args).compile()
        return compiled.as_text(), np.asarray(compiled(*args))

    text, got = lowered(5)
    assert kernels.ATTENTION_V2_TARGET in text and kernels.ATTENTION_TARGET not in text
    true = _true_queries(args[5], 4)
    np.testing.assert_allclose(got[true], _reference(*args, window=5)[true], rtol=2e-5,
                               atol=2e-6)
    text, got = lowered(0)
    assert kernels.ATTENTION_TARGET in text and kernels.ATTENTION_V2_TARGET not in text
    np.testing.assert_allclose(got, _reference(*args), rtol=2e-5, atol=2e-6)


def test_v1_call_serialized_and_read_back_runs() -> None:
    """An artifact that calls jaxdist_cache_attention_v1 as full attention does (the call, its
    one attribute ``scale``), serialized and read back, runs here and gives the reference."""
    rng = np.random.default_rng(62)
    args = _case(rng, 2, 3, 8, 2, 32, t=40)

    def full(*a):
        call = jax.ffi.ffi_call("jaxdist_cache_attention_v1",
                                jax.ShapeDtypeStruct(a[0].shape, jnp.float32))
        kernel = lambda *x: call(*x, scale=np.float32(a[0].shape[3] ** -0.5))  # noqa: E731
        return jax.lax.platform_dependent(*a, cpu=kernel, default=layers._attend)

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    exp = export.export(jax.jit(full), platforms=("cpu",), disabled_checks=[
        export.DisabledSafetyCheck.custom_call("jaxdist_cache_attention_v1")])(*shapes)
    blob = exp.serialize()
    back = export.deserialize(blob)
    assert "jaxdist_cache_attention_v1" in back.mlir_module()
    np.testing.assert_allclose(np.asarray(back.call(*args)), _reference(*args), rtol=2e-5,
                               atol=2e-6)


def test_error_negative_window() -> None:
    q = np.zeros((1, 1, 2, 8), np.float32)
    kc = np.zeros((2, 2, 4, 8), np.float32)
    ints = np.zeros((1,), np.int32)
    with pytest.raises(Exception, match=r"jaxdist_cache_attention_v2: window -2 is negative"):
        _direct_v2(q, kc, kc, ints, ints, np.ones(1, np.int32), -2)
    with pytest.raises(SpecError, match=r"cache_attention: window -1 is negative"):
        ops.cache_attention(q, kc, kc, ints, ints, ints, scale=1.0, window=-1,
                            portable=layers._attend)
