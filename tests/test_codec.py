"""Round-trip and error tests for the tensor codec."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxdist.core import codec
from jaxdist.core.errors import CodecError, JaxdistError, LimitError
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
    with pytest.raises(LimitError, match="400 bytes, over the limit of 100"):
        codec.decode_tensors(msgs, max_bytes=100)
    two = codec.encode("a", np.zeros(1)) + codec.encode("b", np.zeros(1))
    with pytest.raises(LimitError, match="more than 1 tensors in one frame"):
        codec.decode_tensors(two, max_tensors=1)


def test_error_garbage_bytes():
    with pytest.raises(CodecError, match="malformed tensor bytes"):
        codec.from_bytes(b"\xff\xff\xff\xff\x0f")


def _wire_group(tensors, chunk_bytes):
    return [c for g in codec.group_chunks(tensors, chunk_bytes=chunk_bytes) for c in g]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int64, np.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_tensor_pieces_are_protobuf_tensors(dtype):
    arr = (np.arange(60) % 7).astype(dtype).reshape(3, 4, 5)
    group = _wire_group({"a": arr, "empty": np.zeros((0, 3), dtype)}, chunk_bytes=16)
    pieces, size = codec.tensor_pieces(group, 5)  # as Frame.tensors
    data = b"".join(pieces)
    assert len(data) == size
    frame = pb.Frame.FromString(data)
    assert [codec.chunk_of(t)[:3] for t in frame.tensors] == [c[:3] for c in group]
    np.testing.assert_array_equal(codec.decode_tensors(frame.tensors)["a"], arr)


def test_parse_tensor_reads_what_protobuf_writes():
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    for msg in codec.encode("x", arr, chunk_bytes=20):
        raw = memoryview(msg.SerializeToString())
        name, enum, shape, data, offset, total = codec.parse_tensor(raw, 0, len(raw))
        assert (name, enum, shape, bytes(data), offset, total) == (
            msg.name, msg.dtype, list(msg.shape), msg.data, msg.offset, msg.total_bytes)
        assert isinstance(data, memoryview) and data.obj is raw.obj  # a view, not a copy


def test_parse_tensor_unpacked_shape_and_unknown_fields():
    # Field 3 as separate varints (legal, though proto3 writers pack it) and a field 15
    # a newer writer might add.
    raw = memoryview(b"\x0a\x01t" b"\x10\x09" b"\x18\x02" b"\x18\x03" b"\x22\x06abcdef"
                     b"\x30\x06" b"\x7a\x02zz")
    assert codec.parse_tensor(raw, 0, len(raw))[:3] == ("t", pb.U8, [2, 3])
    assert codec.decode_tensors([pb.Tensor.FromString(bytes(raw))])["t"].shape == (2, 3)


def test_assembled_chunks_are_64_byte_aligned():
    arr = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    out = codec.decode_tensors(codec.encode("x", arr, chunk_bytes=1000))["x"]
    assert out.ctypes.data % 64 == 0  # XLA:CPU reads such a host array without copying it
    np.testing.assert_array_equal(out, arr)


def test_error_overlapping_chunks():
    first = pb.Tensor(name="x", dtype=pb.U8, shape=[8], data=b"\1" * 4, offset=0, total_bytes=8)
    with pytest.raises(CodecError, match=r"tensor 'x': chunks overlap or leave a gap at byte 4"):
        codec.decode_tensors([first, first])


def test_error_negative_dim_on_the_wire():
    raw = memoryview(pb.Tensor(name="x", dtype=pb.U8, shape=[-2, 3]).SerializeToString())
    chunk = codec.parse_tensor(raw, 0, len(raw))
    assert chunk[2] == [-2, 3]
    with pytest.raises(CodecError, match=r"tensor 'x': negative dimension in shape \(-2, 3\)"):
        codec.TensorAssembler().add_chunk(chunk)
