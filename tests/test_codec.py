"""Round-trip and error tests for the tensor codec."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxdist import codec
from jaxdist.errors import CodecError, JaxdistError
from jaxdist.proto import jaxdist_pb2 as pb

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int8, np.int16, np.int32,
          np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]


def _arrays(dtype):
    shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)
    if dtype is ml_dtypes.bfloat16:
        return hnp.arrays(np.float32, shapes).map(lambda a: a.astype(ml_dtypes.bfloat16))
    return hnp.arrays(dtype, shapes)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), chunk=st.integers(min_value=1, max_value=64))
def test_roundtrip_property(dtype, data, chunk):
    arr = data.draw(_arrays(dtype))
    msgs = codec.encode("t", arr, chunk_bytes=chunk)
    assert all(len(m.data) <= chunk for m in msgs)
    # Messages survive real serialization, as on the wire.
    wire = [pb.Tensor.FromString(m.SerializeToString()) for m in msgs]
    out = codec.decode_tensors(wire)["t"]
    assert out.dtype == np.dtype(dtype)
    assert out.shape == arr.shape
    assert out.tobytes() == arr.tobytes()  # bitwise, so NaNs and -0.0 count too


def test_decode_is_zero_copy():
    arr = np.arange(1024, dtype=np.float32)
    (msg,) = codec.encode("x", arr)
    out = codec.decode(msg)
    assert not out.flags.writeable  # a view of the message's immutable bytes
    assert not out.flags.owndata
    np.testing.assert_array_equal(out, arr)


def test_non_contiguous_and_big_endian_inputs():
    arr = np.arange(24, dtype=">i4").reshape(4, 6)[:, ::2]
    name, out = codec.from_bytes(codec.to_bytes("be", arr))
    assert name == "be"
    assert out.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out, arr)


def test_jax_array_encodes():
    import jax.numpy as jnp

    x = jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4)
    out = codec.decode(codec.encode("x", x)[0])
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, np.asarray(x))


def test_large_tensor_is_chunked_and_reassembled():
    arr = np.random.default_rng(0).standard_normal((1024, 1100)).astype(np.float32)  # ~4.3 MiB
    msgs = codec.encode("big", arr)
    assert len(msgs) == 5
    assert max(len(m.data) for m in msgs) <= codec.DEFAULT_CHUNK_BYTES
    np.testing.assert_array_equal(codec.decode_tensors(reversed(msgs))["big"], arr)


def test_encode_tensors_groups_small_tensors():
    tensors = {f"t{i}": np.full((10,), i, np.int32) for i in range(5)}
    groups = list(codec.encode_tensors(tensors, chunk_bytes=100))
    assert [len(g) for g in groups] == [2, 2, 1]
    out = codec.decode_tensors(m for g in groups for m in g)
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)


@pytest.mark.parametrize("name", ["f32", "bf16", "bool", "int64", "uint8"])
def test_dtype_names(name):
    assert codec.dtype_from_name(name) == np.dtype(codec.dtype_from_name(codec.canonical_dtype(name)))


def test_error_unsupported_dtype():
    with pytest.raises(CodecError, match=r"tensor 'c': unsupported dtype .*complex64"):
        codec.encode("c", np.zeros(3, np.complex64))
    assert issubclass(CodecError, JaxdistError)


def test_error_length_mismatch():
    msg = pb.Tensor(name="x", dtype=pb.F32, shape=[2, 3], data=b"\0" * 20, total_bytes=24)
    with pytest.raises(CodecError, match=r"tensor 'x': expected 24 bytes for shape \(2, 3\) of float32, found 20"):
        codec.decode(msg)


def test_error_header_total_mismatch():
    msg = pb.Tensor(name="x", dtype=pb.F32, shape=[2, 3], data=b"\0" * 24, total_bytes=99)
    with pytest.raises(CodecError, match="needs 24 bytes, header says total_bytes=99"):
        codec.decode(msg)


def test_error_unknown_dtype_enum():
    msg = pb.Tensor(name="x", dtype=77, shape=[1], data=b"\0")
    with pytest.raises(CodecError, match="unknown dtype enum 77"):
        codec.decode(msg)


def test_error_incomplete_chunks():
    msgs = codec.encode("x", np.zeros(100, np.float32), chunk_bytes=64)
    asm = codec.TensorAssembler()
    asm.extend(msgs[:-1])
    with pytest.raises(CodecError, match=r"incomplete tensors at end of frame: 'x'"):
        asm.finish()


def test_error_chunk_overrun():
    msg = pb.Tensor(name="x", dtype=pb.U8, shape=[8], data=b"\0" * 4, offset=6, total_bytes=8)
    with pytest.raises(CodecError, match=r"chunk \[6, 10\) overruns 8 bytes"):
        codec.decode_tensors([msg])


def test_error_limits():
    msgs = codec.encode("x", np.zeros(100, np.float32))
    with pytest.raises(CodecError, match="400 bytes, over the limit of 100"):
        codec.decode_tensors(msgs, max_bytes=100)
    two = codec.encode("a", np.zeros(1)) + codec.encode("b", np.zeros(1))
    with pytest.raises(CodecError, match="more than 1 tensors in one frame"):
        codec.decode_tensors(two, max_tensors=1)


def test_error_garbage_bytes():
    with pytest.raises(CodecError, match="malformed tensor bytes"):
        codec.from_bytes(b"\xff\xff\xff\xff\x0f")
