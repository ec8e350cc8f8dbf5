"""jaxdist.core.quant against the independent reference, gguf.quants (which matches llama.cpp)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as ref

from jaxdist.core import quant
from jaxdist.core.errors import JaxdistError, WeightError

# Byte offsets of the f16 scale fields inside one block, from llama.cpp's block_* structs. Random
# bytes elsewhere are valid quants; the scales are overwritten so every value is finite.
_F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

# Types gguf.quants can also quantize: test on realistic blocks made from floats as well.
_QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def random_blocks(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Valid stored bytes of a ``qtype`` tensor of logical ``shape``: (rows..., row_bytes)."""
    byte_shape = quant.packed_shape(qtype, shape)
    if qtype in ("F32", "F16", "BF16"):
        dtype = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[qtype]
        values = rng.standard_normal(shape).astype(np.float32).astype(dtype)
        return np.ascontiguousarray(values).view(np.uint8).reshape(byte_shape)
    _, block_bytes = quant.block_layout(qtype)
    blocks = rng.integers(0, 256, (int(np.prod(byte_shape)) // block_bytes, block_bytes), np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(byte_shape)


def reference(blocks: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rows = blocks.reshape(quant.packed_shape(qtype, shape))
    if qtype == "F32":  # gguf.quants returns a float32 view of the bytes for F32
        return rows.view(np.float32).reshape(shape)
    return np.asarray(ref.dequantize(rows, GGMLQuantizationType[qtype])).reshape(shape)


def _shapes(qtype: str) -> list[tuple[int, ...]]:
    block_elems, _ = quant.block_layout(qtype)
    return [(block_elems,), (3, 2 * block_elems), (2, 2, block_elems)]


@pytest.mark.parametrize("qtype", quant.PACKABLE_TYPES)
def test_numpy_matches_reference(qtype: str) -> None:
    rng = np.random.default_rng(0)
    for shape in _shapes(qtype):
        blocks = random_blocks(qtype, shape, rng)
        out = quant.dequantize(blocks, qtype, shape)
        assert out.dtype == np.float32 and out.shape == shape
        np.testing.assert_array_equal(out, reference(blocks, qtype, shape))
        # 1-D input is accepted as well as (rows, row_bytes).
        np.testing.assert_array_equal(quant.dequantize(blocks.reshape(-1), qtype, shape), out)


@pytest.mark.parametrize("qtype", quant.PACKABLE_TYPES)
def test_jax_jit_matches_reference(qtype: str) -> None:
    rng = np.random.default_rng(1)
    shape = _shapes(qtype)[1]
    blocks = random_blocks(qtype, shape, rng)
    fn = jax.jit(lambda b: quant.dequantize(b, qtype, shape, xp=jnp))
    out = np.asarray(fn(jnp.asarray(blocks)))
    assert out.dtype == np.float32 and out.shape == shape
    # Same float32 operations in the same order: expect bit-exact results, not just closeness.
    np.testing.assert_array_equal(out, reference(blocks, qtype, shape))


@pytest.mark.parametrize("qtype", _QUANTIZABLE)
def test_reference_quantized_blocks_round_trip(qtype: str) -> None:
    data = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    blocks = ref.quantize(data, GGMLQuantizationType[qtype])
    expected = ref.dequantize(blocks, GGMLQuantizationType[qtype])
    np.testing.assert_array_equal(quant.dequantize(blocks, qtype, data.shape), expected)
    got = jax.jit(lambda b: quant.dequantize(b, qtype, data.shape, xp=jnp))(blocks)
    np.testing.assert_array_equal(np.asarray(got), expected)
    # The dequantized values approximate the originals (a sanity check of the whole chain).
    assert np.abs(expected - data).max() < 0.5


def test_numpy_chunking_matches_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (5, 256)
    blocks = random_blocks("Q4_K", shape, np.random.default_rng(3))
    whole = quant.dequantize(blocks, "Q4_K", shape)
    monkeypatch.setattr(quant, "_NUMPY_CHUNK_BLOCKS", 2)
    np.testing.assert_array_equal(quant.dequantize(blocks, "Q4_K", shape), whole)


def test_block_layout_and_packed_shape() -> None:
    assert quant.block_layout("Q4_1") == (32, 20)
    assert quant.block_layout("Q6_K") == (256, 210)
    assert quant.block_layout("F16") == (1, 2)
    assert quant.packed_shape("Q8_0", (576, 576)) == (576, 18 * 34)
    assert quant.packed_shape("F32", (3, 5)) == (3, 20)
    assert set(quant.PACKABLE_TYPES) >= {"F32", "F16", "BF16", "Q8_0", "Q4_1", "Q6_K"}


def test_error_unknown_type() -> None:
    with pytest.raises(WeightError, match="unknown GGML type 'Q9_9'"):
        quant.block_layout("Q9_9")


def test_error_unsupported_type() -> None:
    msg = r"cannot dequantize GGML type 'IQ4_NL'.*bind the weight unpacked"
    with pytest.raises(WeightError, match=msg):
        quant.dequantize(np.zeros(18, np.uint8), "IQ4_NL", (32,))


def test_error_size_mismatch() -> None:
    msg = r"Q8_0 tensor of shape \(2, 32\): expected 68 bytes .* found 34"
    with pytest.raises(WeightError, match=msg):
        quant.dequantize(np.zeros(34, np.uint8), "Q8_0", (2, 32))


def test_error_row_not_whole_blocks() -> None:
    msg = "last dim 40 is not a multiple of the Q4_0 block size 32"
    with pytest.raises(WeightError, match=msg):
        quant.dequantize(np.zeros(18, np.uint8), "Q4_0", (40,))


def test_error_blocks_not_uint8() -> None:
    with pytest.raises(WeightError, match="Q8_0 blocks must be uint8, found float32"):
        quant.dequantize(np.zeros(34, np.float32), "Q8_0", (1, 32))


def test_weight_error_is_jaxdist_error() -> None:
    assert issubclass(WeightError, JaxdistError)
