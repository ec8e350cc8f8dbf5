"""The CPU kernels (jaxdist.core.kernels) against independent references.

Every expected value is ``gguf.quants`` dequantization of the same blocks followed by a numpy
matmul. The kernels quantize activations as llama.cpp does (Q8_0/Q8_1/Q8_K, or f16/bf16), so
the check is against an error bound computed from that quantization, element by element
(:func:`ggml_blocks.activation_error`), not a loose relative tolerance; for the Q8_0 types the
activations are also quantized with ``gguf.quants`` and the product checked tightly.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zlib

import ggml_blocks
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.core import kernels
from jaxdist.core.errors import SpecError
from jaxdist.core.kernels import ops
from jaxdist.core.weights import WeightCache

INFO = kernels.load()
pytestmark = pytest.mark.skipif(not INFO.available,
                                reason=f"CPU kernels unavailable here: {INFO.reason}")

ROWS = list(range(1, 18))  # batch 1 to 17


def _check(y: np.ndarray, x: np.ndarray, wd: np.ndarray, qtype: str, where: str) -> None:
    ref = x.astype(np.float64) @ wd.T.astype(np.float64)
    bound = ggml_blocks.activation_error(x, qtype) @ np.abs(wd.T).astype(np.float64)
    bound += 1e-5 * (np.abs(x) @ np.abs(wd.T)) + 1e-6  # float32 accumulation
    err = np.abs(y - ref)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{where}: error {err[worst]:.3g} over the bound "
                                  f"{bound[worst]:.3g} at {worst}")
    # The worst case is loose (rounding errors cancel), so check their size too: uniform
    # rounding within +-e has standard deviation e / sqrt(3), summed over K products.
    sigma = np.sqrt((ggml_blocks.activation_error(x, qtype) ** 2 / 3) @ (wd.T ** 2))
    rms, want = np.sqrt(np.mean(err ** 2)), np.sqrt(np.mean(sigma ** 2))
    assert rms <= 1.5 * want + 1e-6, f"{where}: rms error {rms:.3g}, expected about {want:.3g}"


def _random_blocks(rng: np.random.Generator, shape: tuple[int, int], qtype: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 weights quantized to ``qtype``: (blocks, their gguf.quants decoding)."""
    blocks = ggml_blocks.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    return blocks, ggml_blocks.dequantize(blocks, qtype)


@pytest.fixture(scope="module")
def matmul():
    return jax.jit(ops.quant_matmul, static_argnums=2)


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES)
def test_kernel_matches_gguf_reference_random(matmul, qtype: str) -> None:
    rng = np.random.default_rng(zlib.crc32(qtype.encode()))  # not hash(): PYTHONHASHSEED
    n, k = 80, 512
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 2.0, (n, 1))).astype(np.float32)
    blocks = ggml_blocks.quantize(w, qtype)
    wd = ggml_blocks.dequantize(blocks, qtype)
    assert np.abs(wd - w).max() < np.abs(w).max()  # the blocks mean what they should
    for m in ROWS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = np.asarray(matmul(x, blocks, qtype))
        assert y.shape == (m, n) and y.dtype == np.float32
        _check(y, x, wd, qtype, f"{qtype} batch {m}")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0"])
def test_kernel_is_exact_on_q8_0_activations(matmul, qtype: str) -> None:
    """With the activations quantized to Q8_0 by gguf.quants, only float rounding is left."""
    rng = np.random.default_rng(5)
    blocks, wd = _random_blocks(rng, (48, 256), qtype)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for m in (1, 7, 17):
        x = rng.standard_normal((m, 256)).astype(np.float32)
        xq = gguf.quants.dequantize(gguf.quants.quantize(x, q8), q8)
        y = np.asarray(matmul(x, blocks, qtype))
        np.testing.assert_allclose(y, xq.astype(np.float64) @ wd.T, rtol=2e-5, atol=2e-4)


def test_kernel_on_real_smollm2_tensors(matmul, smollm2: pathlib.Path) -> None:
    """SmolLM2's own Q4_1 and Q8_0 blocks, as the GGUF stores them."""
    rng = np.random.default_rng(11)
    with WeightCache([smollm2.parent]) as cache:
        infos = cache.describe(smollm2.name)
        picked = {}
        for name, info in infos.items():
            if info.storage_type in ("Q4_1", "Q8_0") and len(info.shape) == 2:
                picked.setdefault(info.storage_type, name)
        assert set(picked) == {"Q4_1", "Q8_0"}
        for qtype, name in picked.items():
            raw, _ = cache.resolve_bytes(f"gguf://{smollm2.name}#{name}")
            blocks = np.array(raw[:512])  # 512 rows are plenty
            wd = ggml_blocks.dequantize(blocks, qtype)
            for m in (1, 4, 17):
                x = rng.standard_normal((m, wd.shape[1])).astype(np.float32)
                _check(np.asarray(matmul(x, blocks, qtype)), x, wd, qtype, f"{name} batch {m}")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "Q5_K", "F16"])
def test_many_rows_take_the_dequantize_branch(matmul, qtype: str) -> None:
    """Above max_rows (64, or 256 for the types with wide multi-row products) the CPU
    dequantizes (ggml) and runs XLA's dot: f32 activations."""
    rng = np.random.default_rng(2)
    blocks, wd = _random_blocks(rng, (40, 256), qtype)
    m = ops.max_rows(qtype) + 3
    x = rng.standard_normal((m, 256)).astype(np.float32)
    y = np.asarray(matmul(x, blocks, qtype))
    np.testing.assert_allclose(y, x.astype(np.float64) @ wd.T, rtol=1e-5, atol=1e-4)
    text = jax.jit(ops.quant_matmul, static_argnums=2).lower(x, blocks, qtype).compile().as_text()
    assert kernels.DEQUANTIZE_TARGET in text and kernels.TARGET not in text


def test_many_rows_dequantize_one_matrix_at_a_time() -> None:
    """A chain of long products holds one dequantized float32 matrix at a time, not every
    layer's at once (XLA would schedule them all first if nothing tied them to their input)."""
    rng = np.random.default_rng(5)
    ws = [ggml_blocks.quantize(rng.standard_normal((512, 256)).astype(np.float32), "Q4_1")
          for _ in range(10)]

    def chain(x, *ws):
        for w in ws:
            x = jnp.tanh(ops.quant_matmul(x, w, "Q4_1")[:, :256])
        return x

    x = np.zeros((ops.max_rows("Q4_1") + 8, 256), np.float32)
    temp = jax.jit(chain).lower(x, *ws).compile().memory_analysis().temp_size_in_bytes
    one = 512 * 256 * 4
    assert temp < 2 * one + 4 * x.nbytes, f"{temp} bytes of temporaries for 10 x {one}"


@pytest.mark.parametrize("qtype", kernels.KERNEL_TYPES)
def test_portable_branch_numerics_on_cpu(qtype: str) -> None:
    """The branch GPU/TPU workers compile (in-graph dequantize + dot), run here on the CPU:
    the dequantization is bit-exact against gguf.quants, so the product is f32-exact."""
    rng = np.random.default_rng(3)
    blocks, wd = _random_blocks(rng, (24, 256), qtype)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    dq = jax.jit(lambda b: ops.QTensor(b, qtype).dequantize())(blocks)
    np.testing.assert_array_equal(np.asarray(dq), wd)
    y = jax.jit(ops._dequantize_dot, static_argnums=2)(x, blocks, qtype)
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ wd.T, rtol=1e-5, atol=1e-4)


def test_export_keeps_both_branches_for_every_platform() -> None:
    """One artifact for cpu, cuda and tpu: the module holds the custom call and the portable
    dequantize path; the CPU compile keeps only the custom call."""
    from jax import export

    blocks = ggml_blocks.quantize(np.ones((16, 256), np.float32), "Q4_K")
    (b,) = export.symbolic_shape("b")
    exp = export.export(
        jax.jit(lambda x, w: ops.linear(x, ops.QTensor(w, "Q4_K", transposed=True))),
        platforms=("cpu", "cuda", "tpu"),
        disabled_checks=[export.DisabledSafetyCheck.custom_call(t)
                         for t in sorted(kernels.OWN_TARGETS)])(
        jax.ShapeDtypeStruct((b, 256), jnp.float32), jax.ShapeDtypeStruct(blocks.shape, jnp.uint8))
    text = exp.mlir_module()
    assert exp.platforms == ("cpu", "cuda", "tpu")
    assert kernels.TARGET in text and "stablehlo.dot_general" in text
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    y = np.asarray(exp.call(x, blocks))
    _check(y, x, ggml_blocks.dequantize(blocks, "Q4_K"), "Q4_K", "exported")


def test_embedding_rows_are_dequantized_in_graph() -> None:
    rng = np.random.default_rng(4)
    table = rng.standard_normal((50, 64)).astype(np.float32)
    blocks = ggml_blocks.quantize(table, "Q8_0")
    idx = np.array([[3, 49, 0], [7, 7, 1]], np.int32)
    got = jax.jit(lambda b, i: ops.take_rows(ops.QTensor(b, "Q8_0"), i))(blocks, idx)
    np.testing.assert_array_equal(np.asarray(got), ggml_blocks.dequantize(blocks, "Q8_0")[idx])


def test_error_buffer_sizes_checked_by_the_kernel() -> None:
    """A call whose buffers disagree with the declared type fails with a message naming it,
    instead of reading past a buffer."""
    blocks = np.zeros((8, 20), np.uint8)  # Q4_1 rows of 32 elements are 20 bytes: K = 32
    x = np.zeros((2, 64), np.float32)     # but x says K = 64
    rows = np.ones(2, np.int32)
    call = jax.ffi.ffi_call(kernels.TARGET, jax.ShapeDtypeStruct((2, 8), jnp.float32))
    with pytest.raises(Exception, match=r"jaxdist_ggml_matmul_v2: w rows hold 20 bytes, "
                                        r"expected 40 for K = 64 of q4_1"):
        jax.jit(lambda a, b, r: call(a, b, r, ggml_type=np.int32(3)))(
            x, blocks, rows).block_until_ready()
    bad_out = jax.ffi.ffi_call(kernels.TARGET, jax.ShapeDtypeStruct((2, 9), jnp.float32))
    with pytest.raises(Exception, match=r"y is \(2, 9\), expected \(2, 8\)"):
        jax.jit(lambda a, b, r: bad_out(a, b, r, ggml_type=np.int32(3)))(
            x[:, :32], blocks, rows).block_until_ready()
    with pytest.raises(Exception, match=r"unsupported ggml_type 16"):
        jax.jit(lambda a, b, r: call(a, b, r, ggml_type=np.int32(16)))(
            x, blocks, rows).block_until_ready()
    with pytest.raises(Exception, match=r"jaxdist_ggml_matmul_v2: rows must hold one entry per "
                                        r"row of x"):
        jax.jit(lambda a, b, r: call(a, b, r, ggml_type=np.int32(3)))(
            x[:, :32], blocks, np.ones(3, np.int32)).block_until_ready()
    dequantize = jax.ffi.ffi_call(kernels.DEQUANTIZE_TARGET,
                                  jax.ShapeDtypeStruct((8, 64), jnp.float32))
    with pytest.raises(Exception, match=r"jaxdist_ggml_dequantize_v2: expected x \(M, K\) and "
                                        r"y \(N, K\) with the same K"):
        jax.jit(lambda a, b: dequantize(a, b, ggml_type=np.int32(3)))(
            x[:, :32], blocks).block_until_ready()
    with pytest.raises(Exception, match=r"jaxdist_ggml_dequantize_v2: w rows hold 20 bytes"):
        jax.jit(lambda a, b: dequantize(a, b, ggml_type=np.int32(3)))(
            x, blocks).block_until_ready()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0", "BF16"])
def test_masked_rows_are_skipped(matmul, qtype: str) -> None:
    """Rows marked 0 (padding, idle slots) are not computed and come back as zeros; the
    others are the full product: every row marked gives the same rows."""
    rng = np.random.default_rng(10)
    blocks, wd = _random_blocks(rng, (48, 256), qtype)
    x = rng.standard_normal((2, 7, 256)).astype(np.float32)
    live = np.arange(7)[None, :] < np.array([[3], [7]])
    y = np.asarray(jax.jit(lambda a, b, r: ops.quant_matmul(a, b, qtype, r))(x, blocks, live))
    np.testing.assert_array_equal(y[~live], 0.0)
    _check(y[live], x[live], wd, qtype, f"{qtype} masked")
    every = jax.ffi.ffi_call(kernels.TARGET, jax.ShapeDtypeStruct((14, 48), jnp.float32))
    full = np.asarray(jax.jit(lambda a, b: every(a, b, np.ones(14, np.int32), ggml_type=np.int32(
        gguf.GGMLQuantizationType[qtype].value)))(x.reshape(14, 256), blocks))
    np.testing.assert_array_equal(y[live], full.reshape(2, 7, 48)[live])
    none = np.asarray(jax.jit(lambda a, b, r: ops.quant_matmul(a, b, qtype, r))(
        x, blocks, np.zeros((2, 7), bool)))
    np.testing.assert_array_equal(none, 0.0)





def test_own_q8_k_activations_are_ggmls_bytes() -> None:
    """The wide path quantizes the K-quants' activations itself (QuantizeRowQ8K, vectorized);
    they must be the bytes ggml's own from_float writes: scale, quants and block sums. Rows
    with ties of magnitude and sign (the first element decides the sign of the scale), halves
    that round to even, a zero superblock, tiny and huge values."""
    import ctypes

    lib = kernels._lib
    assert lib is not None
    rng = np.random.default_rng(zlib.crc32(b"q8k"))
    rows = [rng.standard_normal(2304).astype(np.float32) * s for s in (1e-30, 1e-3, 1.0, 1e6)]
    tie = rng.standard_normal(256).astype(np.float32)
    tie[[3, 200]] = -7.0, 7.0   # |max| tied; the first one (negative) sets the scale
    tie[[9, 250]] = 3.5, -3.5  # 3.5 * 127 / 7 = 63.5: rounds to even
    rows += [tie, -tie, np.concatenate([np.zeros(256, np.float32), tie])]
    for i, x in enumerate(rows):
        k = x.size
        own = np.zeros(k // 256 * 292, np.uint8)
        ref = np.zeros_like(own)
        ran = lib.jaxdist_kernels_quantize_q8_k(
            x.ctypes.data_as(ctypes.c_void_p), own.ctypes.data_as(ctypes.c_void_p),
            ref.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(k))
        if not ran:
            pytest.skip("jaxdist's wide kernels need a CPU with AVX-512 VNNI and VBMI")
        own_b, ref_b = own.reshape(-1, 292), ref.reshape(-1, 292)
        for b in range(k // 256):
            zero = not x[256 * b:256 * (b + 1)].any()
            # ggml leaves the sums of a zero superblock unwritten (no reader uses them)
            n = 260 if zero else 292
            assert own_b[b, :n].tobytes() == ref_b[b, :n].tobytes(), f"row {i} block {b}"


@pytest.fixture
def both_isas():
    """Runs the test body's products with ggml's dot products, then with jaxdist's wide ones."""
    wide = kernels.set_isa(True).isa
    kernels.set_isa(False)
    if wide != "avx512vnni":
        pytest.skip("jaxdist's wide dot products need a CPU with AVX-512 VNNI and VBMI")
    yield
    kernels.set_isa(True)


@pytest.mark.parametrize("qtype", ops.WIDE_TYPES)
def test_wide_dot_products_match_ggml_and_the_reference(both_isas, qtype: str) -> None:
    """jaxdist's AVX-512 VNNI products (wide_simple.cc, wide_kquants.cc) read the file's blocks
    and ggml's quantized activations; they must give ggml's vec_dot results up to the order of
    float32 sums, and meet the same reference bound. Widths with a partial last vector group
    (K of 96 or 160 for the 32-element blocks), row counts that are not a multiple of the
    16-row chunks, and batches up to 9."""
    rng = np.random.default_rng(zlib.crc32(b"wide" + qtype.encode()))
    ks = (256, 512, 2304) if qtype.endswith("_K") else (32, 96, 160, 576, 2048)
    differ = 0  # results not bit-identical to ggml's: the wide path ran
    for k in ks:
        n = 37 if k < 2048 else 130
        blocks, wd = _random_blocks(rng, (n, k), qtype)
        for m in (1, 2, 9):
            x = rng.standard_normal((m, k)).astype(np.float32)
            matmul = jax.jit(ops.quant_matmul, static_argnums=2)
            kernels.set_isa(False)
            y_ggml = np.asarray(matmul(x, blocks, qtype))
            kernels.set_isa(True)
            y_wide = np.asarray(matmul(x, blocks, qtype))
            where = f"{qtype} K={k} N={n} batch {m}"
            _check(y_wide, x, wd, qtype, f"wide {where}")
            scale = np.abs(x) @ np.abs(wd.T)
            assert (np.abs(y_wide - y_ggml) <= 2e-6 * scale + 1e-6).all(), where
            differ += not np.array_equal(y_wide, y_ggml)
    assert differ, f"{qtype}: every product was bit-identical to ggml's; did the wide path run?"


def test_kernel_cpus_follow_affinity_and_isa_can_be_forced() -> None:
    """A worker pinned to one core starts no helper thread (its default is 1 thread), and
    JAXDIST_KERNELS_ISA=ggml keeps ggml's dot products on a CPU that has the wide ones."""
    code = ("from jaxdist.core import kernels; i = kernels.load(); "
            "print(i.cpus, i.isa, i.available, i.reason)")
    env = {**os.environ, "JAXDIST_KERNELS_ISA": "ggml"}
    out = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable,
                          "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out[:3] == ["1", "ggml", "True"], out


def test_error_quant_matmul_wrong_width_or_type() -> None:
    blocks = np.zeros((8, 20), np.uint8)
    with pytest.raises(SpecError, match=r"x has 64 features, the Q4_1 weight rows hold 32"):
        jax.jit(lambda x: ops.quant_matmul(x, blocks, "Q4_1"))(np.zeros((1, 64), np.float32))
    with pytest.raises(SpecError, match=r"GGML type 'IQ2_XS' has no kernel"):
        ops.quant_matmul(np.zeros((1, 32), np.float32), blocks, "IQ2_XS")


def test_kernel_info_and_threads() -> None:
    assert INFO.types == kernels.KERNEL_TYPES
    assert set(INFO.targets) == kernels.OWN_TARGETS
    assert INFO.version.startswith(f"{kernels.ABI_VERSION}+ggml-")
    assert INFO.isa in ("avx512vnni", "ggml") and INFO.cpus == _cpu_budget()
    try:
        assert kernels.load(threads=1).threads == 1
        rng = np.random.default_rng(9)
        w = rng.standard_normal((600, 512)).astype(np.float32)
        blocks = ggml_blocks.quantize(w, "Q4_K")
        x = rng.standard_normal((8, 512)).astype(np.float32)
        one = np.asarray(jax.jit(ops.quant_matmul, static_argnums=2)(x, blocks, "Q4_K"))
        kernels.load(threads=2)
        two = np.asarray(jax.jit(ops.quant_matmul, static_argnums=2)(x, blocks, "Q4_K"))
        np.testing.assert_array_equal(one, two)  # the split changes no result
    finally:
        kernels.load(threads=0)


def _cpu_budget() -> int:
    """What the kernels should take as this process's CPUs: its affinity, capped by a cgroup
    v2 quota (v1's where that is what is mounted)."""
    cpus = len(os.sched_getaffinity(0))
    v2, v1 = pathlib.Path("/sys/fs/cgroup/cpu.max"), pathlib.Path("/sys/fs/cgroup/cpu")
    if v2.exists():
        quota, period = v2.read_text().split()
    elif (v1 / "cpu.cfs_quota_us").exists():
        quota, period = ((v1 / f).read_text().strip() for f in ("cpu.cfs_quota_us",
                                                                 "cpu.cfs_period_us"))
    else:
        return cpus
    if quota in ("max", "-1"):
        return cpus
    return min(cpus, max(1, int(float(quota) / float(period))))


def _read_syscalls() -> int:
    """This process's read system calls so far (Linux ``/proc/self/io``)."""
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("syscr:"):
            return int(line.split()[1])
    raise AssertionError("/proc/self/io has no syscr line")


@pytest.mark.skipif(not pathlib.Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_kernel_calls_read_no_files(matmul) -> None:
    # A kernel call once asked glibc for the number of cores, which reads
    # /sys/devices/system/cpu/online: about a hundred reads per SmolLM2 decode step.
    rng = np.random.default_rng(3)
    blocks, _ = _random_blocks(rng, (64, 256), "Q4_1")
    x = jnp.asarray(rng.standard_normal((1, 256)).astype(np.float32))
    matmul(x, blocks, "Q4_1").block_until_ready()  # compiled, helpers started
    before = _read_syscalls()
    for _ in range(200):
        matmul(x, blocks, "Q4_1").block_until_ready()
    assert _read_syscalls() - before < 20, "kernel calls read files (expected none per call)"
