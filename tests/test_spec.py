"""jaxdist.core.spec: the StageSpec wire round trip and validate's refusals.

Every refusal is a SpecError whose message starts with the offending field
(``StageSpec.weights[0].sha256``), so each error test asserts that field name.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.core.spec import (
    SPEC_VERSION,
    ShapeBucket,
    StageSpec,
    StateSig,
    TensorSig,
    Versions,
    WeightRef,
    validate,
)
from jaxdist.proto import jaxdist_pb2 as pb

DIGEST = "sha256:" + hashlib.sha256(b"artifact").hexdigest()
SHA = hashlib.sha256(b"tensor").hexdigest()


def full_spec() -> StageSpec:
    """A spec that sets every field to something other than its default."""
    return StageSpec(
        artifact_digest=DIGEST,
        inputs=(TensorSig("x", "float32", ("b", "s", 64)), TensorSig("pos", "int32", ())),
        outputs=(TensorSig("h", "bfloat16", ("b", "s", 64)),
                 TensorSig("ids", "int64", ("b",))),
        weights=(
            WeightRef("blk.0.wq", "gguf://m.gguf#blk.0.attn_q.weight", (64, 64), "float32",
                      sha256=SHA, transpose=True),
            WeightRef("blk.0.wk", "gguf:///abs/m.gguf#blk.0.attn_k.weight", (64, 68), "uint8",
                      packed=True, quant="Q8_0"),
            WeightRef("norm", "safetensors://ckpt#model.norm.weight", (64,), "float16"),
            WeightRef("raw", "file://raw.bin", (2, 3), "int8"),
        ),
        state=(StateSig("blk.0.k", "float32", (128, 64)), StateSig("steps", "int32", ())),
        device="cuda:1",
        stage_index=1,
        num_stages=3,
        next_hop="[::1]:50051",
        buckets=(ShapeBucket({"b": 1, "s": 1}), ShapeBucket({"b": 4, "s": 64})),
        platforms=("cpu", "cuda"),
        versions=Versions(spec=SPEC_VERSION, jax="0.10.2", jaxlib="0.10.2",
                          serialization_version=3, calling_convention_version=10,
                          stablehlo="1.12.0"),
        model="smollm2-135m",
        stage_id="pipe-7/1",
        artifact=b"\x00\x01inline artifact bytes\xff",
        spec_version=SPEC_VERSION,
        any_shape=True,
    )


def test_round_trip_full_spec() -> None:
    spec = full_spec()
    validate(spec)
    data = spec.serialize()
    back = StageSpec.deserialize(data)
    assert back == spec
    # Field by field, so a failure names the field (and symbolic dims stay strings).
    for field in dataclasses.fields(StageSpec):
        assert getattr(back, field.name) == getattr(spec, field.name), field.name
    assert back.inputs[0].dims == ("b", "s", 64)
    assert isinstance(back.inputs[0].dims[2], int)
    assert back.weights[0].transpose and not back.weights[1].transpose
    assert back.weights[1].packed and back.weights[1].quant == "Q8_0"
    assert back.weights[0].sha256 == SHA and back.weights[2].sha256 is None
    # The layout travels as the proto enum, not as a bool.
    msg = pb.StageSpec.FromString(data)
    assert msg.weights[0].layout == pb.LAYOUT_TRANSPOSE
    assert msg.weights[2].layout == pb.LAYOUT_AS_STORED
    # Serialization is deterministic enough to be stable across a round trip.
    assert back.serialize() == data


def test_round_trip_minimal_spec_keeps_defaults() -> None:
    spec = StageSpec(artifact_digest=DIGEST, inputs=(TensorSig("x", "float32", (2,)),),
                     outputs=(TensorSig("y", "float32", (2,)),))
    back = StageSpec.deserialize(spec.serialize())
    assert back == spec
    assert back.artifact is None and back.weights == () and back.state == ()
    assert back.device == "auto" and back.next_hop == "" and back.spec_version == SPEC_VERSION
    assert back.any_shape is False
    # Left at its default, any_shape is not on the wire: what was written before it existed
    # (the golden registry) reads the same.
    assert "any_shape" not in str(spec.to_proto())


def test_strict_shapes_needs_buckets_and_not_any_shape() -> None:
    spec = full_spec()
    assert spec.buckets and spec.any_shape and not spec.strict_shapes
    assert spec.replace(any_shape=False).strict_shapes
    # With no buckets there is nothing to hold a frame to: any shape, compiled on first use.
    assert not spec.replace(any_shape=False, buckets=()).strict_shapes
    assert StageSpec.deserialize(spec.replace(any_shape=False).serialize()).strict_shapes


def test_byte_counts() -> None:
    spec = full_spec()
    assert spec.weight_bytes == 64 * 64 * 4 + 64 * 68 + 64 * 2 + 6
    assert spec.state_bytes == 128 * 64 * 4 + 4


def test_minor_version_accepted() -> None:
    major = SPEC_VERSION.split(".")[0]
    validate(full_spec().replace(spec_version=f"{major}.99"))


_dim = st.one_of(st.integers(0, 2**31 - 1),
                 st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True))


@given(dims=st.lists(_dim, max_size=5).map(tuple))
def test_tensor_sig_dims_round_trip(dims: tuple[int | str, ...]) -> None:
    sig = TensorSig("x", "float32", dims)
    assert TensorSig.from_proto(pb.TensorSig.FromString(sig.to_proto().SerializeToString())) == sig


# -- validate refusals ----------------------------------------------------------------------------


def _refused(spec: StageSpec, pattern: str) -> SpecError:
    with pytest.raises(SpecError, match=pattern) as info:
        validate(spec)
    # The wire path refuses the same spec with the same message.
    with pytest.raises(SpecError, match=pattern):
        StageSpec.deserialize(spec.serialize())
    return info.value


def test_error_spec_error_is_jaxdist_error() -> None:
    err = _refused(full_spec().replace(spec_version="2.0"), r"StageSpec\.spec_version")
    assert isinstance(err, JaxdistError) and err.code == "INVALID_ARGUMENT"


def test_error_bad_spec_version_major() -> None:
    _refused(full_spec().replace(spec_version="2.0"),
             r"^StageSpec\.spec_version: unsupported version '2\.0'.*\(1,\)")


def test_error_non_numeric_spec_version() -> None:
    _refused(full_spec().replace(spec_version="v1"), r"^StageSpec\.spec_version: .*'v1'")


def test_error_malformed_digest() -> None:
    for bad in ("sha256:" + "A" * 64, "md5:" + "0" * 32, DIGEST[:-1], ""):
        _refused(full_spec().replace(artifact_digest=bad),
                 r"^StageSpec\.artifact_digest: expected 'sha256:' and 64 lowercase hex digits")


def test_error_stage_index_out_of_range() -> None:
    _refused(full_spec().replace(stage_index=3, num_stages=3, next_hop=""),
             r"^StageSpec\.stage_index: .*stage_index=3, num_stages=3")
    _refused(full_spec().replace(stage_index=0, num_stages=0, next_hop=""),
             r"^StageSpec\.stage_index: .*num_stages=0")


def test_error_negative_stage_index() -> None:
    with pytest.raises(SpecError, match=r"^StageSpec\.stage_index: .*stage_index=-1"):
        validate(full_spec().replace(stage_index=-1))


def test_error_bad_next_hop() -> None:
    for bad in ("localhost", "host:", ":50051", "host:port", "a b:1", "unix:/tmp/w.sock:1",
                "unix-abstract:w:1", "dns:///h:1", "ipv4:1.2.3.4:5"):
        _refused(full_spec().replace(next_hop=bad),
                 rf"^StageSpec\.next_hop: expected HOST:PORT, found '{bad}'")


def test_error_next_hop_on_last_stage() -> None:
    _refused(full_spec().replace(stage_index=2, num_stages=3, next_hop="h:1"),
             r"^StageSpec\.next_hop: the last stage returns to the coordinator")


def test_error_bad_device_directive() -> None:
    for bad in ("npu", "gpu", "cuda:x", "auto:0"):
        _refused(full_spec().replace(device=bad), r"^StageSpec\.device: device directive")


def test_error_no_outputs() -> None:
    _refused(full_spec().replace(outputs=()), r"^StageSpec\.outputs: .*at least one output")


def test_error_duplicate_input_names() -> None:
    spec = full_spec()
    dup = spec.inputs + (TensorSig("x", "float32", (1,)),)
    _refused(spec.replace(inputs=dup), r"^StageSpec\.inputs\[2\]\.name: duplicate name 'x'")


def test_error_empty_output_name() -> None:
    _refused(full_spec().replace(outputs=(TensorSig("", "float32", (1,)),)),
             r"^StageSpec\.outputs\[0\]\.name: must not be empty")


def test_error_unknown_dtype() -> None:
    spec = full_spec()
    bad = (spec.inputs[0], TensorSig("pos", "float7", ()))
    _refused(spec.replace(inputs=bad),
             r"^StageSpec\.inputs\[1\]\.dtype: unknown dtype 'float7'; expected one of .*float32")


def test_error_non_canonical_dtype() -> None:
    spec = full_spec()
    _refused(spec.replace(outputs=(TensorSig("h", "f32", (1,)),)),
             r"^StageSpec\.outputs\[0\]\.dtype: .*canonical name 'float32', found 'f32'")
    _refused(spec.replace(state=(StateSig("k", "bf16", (2,)),)),
             r"^StageSpec\.state\[0\]\.dtype: .*'bfloat16', found 'bf16'")
    w = dataclasses.replace(spec.weights[0], dtype="f16")
    _refused(spec.replace(weights=(w,)), r"^StageSpec\.weights\[0\]\.dtype: .*'float16'")


def test_error_bad_symbolic_dim() -> None:
    for bad in ("2b", "b+", "b s", "", "b\t+ 1", "max(b)", "pow(b, 2)"):
        _refused(full_spec().replace(inputs=(TensorSig("x", "float32", (1, bad)),),
                                     buckets=()),
                 r"^StageSpec\.inputs\[0\]\.dims\[1\]: expected an integer or a symbol name")


def test_error_negative_dim() -> None:
    _refused(full_spec().replace(outputs=(TensorSig("h", "float32", (-1,)),)),
             r"^StageSpec\.outputs\[0\]\.dims\[0\]: negative size -1")


def test_error_bad_weight_uri_scheme() -> None:
    spec = full_spec()
    w = dataclasses.replace(spec.weights[2], uri="http://example.com/m.gguf#t")
    _refused(spec.replace(weights=(spec.weights[0], spec.weights[1], w)),
             r"^StageSpec\.weights\[2\]\.uri: .*found scheme 'http'")


def test_error_bad_sha256() -> None:
    spec = full_spec()
    for bad in (SHA.upper(), SHA[:-1], "sha256:" + SHA):
        w = dataclasses.replace(spec.weights[0], sha256=bad)
        _refused(spec.replace(weights=(w,)),
                 r"^StageSpec\.weights\[0\]\.sha256: expected 64 lowercase hex digits")


def test_error_packed_without_quant_or_uint8() -> None:
    spec = full_spec()
    no_quant = dataclasses.replace(spec.weights[1], quant=None)
    _refused(spec.replace(weights=(no_quant,)),
             r"^StageSpec\.weights\[0\]: a packed weight \('blk\.0\.wk'\) needs dtype 'uint8' and "
             r"a quant type, found dtype='uint8' quant=None")
    not_uint8 = dataclasses.replace(spec.weights[1], dtype="float32")
    _refused(spec.replace(weights=(not_uint8,)),
             r"^StageSpec\.weights\[0\]: .*found dtype='float32' quant='Q8_0'")


def test_error_duplicate_weight_param() -> None:
    spec = full_spec()
    _refused(spec.replace(weights=(spec.weights[0], spec.weights[0])),
             r"^StageSpec\.weights\[1\]\.name: duplicate name 'blk\.0\.wq'")


def test_error_bucket_unknown_symbol() -> None:
    _refused(full_spec().replace(buckets=(ShapeBucket({"b": 1, "t": 8}),)),
             r"^StageSpec\.buckets\[0\]: unknown symbols \['t'\]; the inputs use \['b', 's'\]")


def test_error_bucket_size_zero() -> None:
    _refused(full_spec().replace(buckets=(ShapeBucket({"b": 0}),)),
             r"^StageSpec\.buckets\[0\]: sizes must be >= 1")


def test_error_garbage_bytes() -> None:
    for garbage in (b"\xff\xff\xff\xff", b"garbage bytes", full_spec().serialize()[:-7]):
        with pytest.raises(SpecError, match=rf"malformed StageSpec bytes \({len(garbage)} bytes\)"):
            StageSpec.deserialize(garbage)
