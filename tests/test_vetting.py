"""Tests for jaxdist.core.vetting: the version windows, the hand-read flatbuffer field and the
custom call walk.

The refusals that ``export_stage`` artifacts meet in ordinary use (digest, truncation, platform,
allowlist, a patched serialization version) are in ``tests/test_artifacts.py``; artifacts from an
earlier jax, and patched calling convention and StableHLO versions, in ``tests/test_compat.py``.
Here every out-of-window artifact is made by jax itself (exported at another calling convention
version) or by rewriting one field at the offset its vtable gives, and jax's own reader is the
reference for what the field holds.
"""

from __future__ import annotations

import inspect
import re
import struct
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax import export as jexport

# Private jax modules, only as references: jax's generated flatbuffer reader and its changelog.
from jax._src.export import serialization as jax_serialization
from jax._src.export import serialization_generated as ser_flatbuf

from jaxdist.core import kernels
from jaxdist.core.artifacts import Artifact, export_stage
from jaxdist.core.errors import ArtifactError
from jaxdist.core.kernels import ops
from jaxdist.core.vetting import (
    DEFAULT_CUSTOM_CALL_ALLOWLIST,
    MAX_SERIALIZATION_VERSION,
    MIN_SERIALIZATION_VERSION,
    _read_serialization_version,
    custom_call_targets,
    digest_of,
    load_artifact,
)

LOCAL = f"local jax {jax.__version__} / jaxlib {jaxlib.__version__}"
CC_LO = jexport.minimum_supported_calling_convention_version
CC_HI = jexport.maximum_supported_calling_convention_version
CC_FLAG = "jax_export_calling_convention_version"  # what export writes; public jax.config flag

# Field ids of the root table, Exported, in jax's schema (serialization.fbs).
FIELD_SERIALIZATION_VERSION = 0
FIELD_IN_TREE = 2
FIELD_CALLING_CONVENTION_VERSION = 14


def _stage(params: Any, state: Any, inputs: Any) -> Any:
    return {"y": jnp.tanh(inputs["x"] @ params["w"])}, {"n": state["n"] + 1}


def _export(**kwargs: Any) -> Artifact:
    return export_stage(_stage, params={"w": ((4, 4), "float32")}, state={"n": ((), "int32")},
                        inputs={"x": ("b, 4", "float32")}, platforms=("cpu",), **kwargs)


@pytest.fixture(scope="module")
def artifact() -> Artifact:
    return _export()


@pytest.fixture
def calling_convention(request: pytest.FixtureRequest) -> Iterator[int]:
    """Export at ``request.param`` (jax's public config flag), restored afterwards."""
    before = getattr(jax.config, CC_FLAG)
    jax.config.update(CC_FLAG, request.param)
    try:
        yield request.param
    finally:
        jax.config.update(CC_FLAG, before)


def _field_position(data: bytes, field_id: int) -> int:
    """Where a scalar field of the root table is, by the flatbuffer layout (test's own reader)."""
    root = struct.unpack_from("<I", data, 0)[0]
    vtable = root - struct.unpack_from("<i", data, root)[0]
    vt_size = struct.unpack_from("<H", data, vtable)[0]
    slot = 4 + 2 * field_id
    assert slot + 2 <= vt_size, f"jax wrote no field {field_id}"
    offset = struct.unpack_from("<H", data, vtable + slot)[0]
    assert offset, f"jax wrote no field {field_id}"
    return root + offset


def _with_u16(data: bytes, field_id: int, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into("<H", buf, _field_position(data, field_id), value)
    return bytes(buf)


def _without_field(data: bytes, field_id: int) -> bytes:
    """The artifact with a field dropped from the root table's vtable (as if never written)."""
    buf = bytearray(data)
    root = struct.unpack_from("<I", buf, 0)[0]
    vtable = root - struct.unpack_from("<i", buf, root)[0]
    struct.pack_into("<H", buf, vtable + 4 + 2 * field_id, 0)
    return bytes(buf)


def _values(b: int) -> tuple[np.ndarray, np.int32, np.ndarray]:
    rng = np.random.default_rng(b)
    return (rng.standard_normal((4, 4), np.float32), np.int32(3),
            rng.standard_normal((b, 4), np.float32))


# --- the serialization version field


def test_serialization_version_read_by_hand_matches_jax_reader(artifact: Artifact) -> None:
    for version in (artifact.meta.serialization_version, 0, 7, MAX_SERIALIZATION_VERSION + 1,
                    0xFFFF):
        data = _with_u16(artifact.data, FIELD_SERIALIZATION_VERSION, version)
        reference = ser_flatbuf.Exported.GetRootAs(bytearray(data), 0).SerializationVersion()
        assert _read_serialization_version(data) == reference == version


def test_serialization_window_is_the_installed_jax_s(artifact: Artifact) -> None:
    # Every schema jax's changelog lists reads back to the same oldest version: MIN.
    source = inspect.getsource(jax_serialization)
    oldest = {int(v) for v in re.findall(r"backwards compatible with Version (\d+)", source)}
    assert oldest == {MIN_SERIALIZATION_VERSION}
    assert MAX_SERIALIZATION_VERSION == jax_serialization._SERIALIZATION_VERSION
    written = artifact.meta.serialization_version
    assert MIN_SERIALIZATION_VERSION <= written <= MAX_SERIALIZATION_VERSION


def test_jax_reader_ignores_the_serialization_version(artifact: Artifact) -> None:
    """Why the window is vetting's own: jax deserializes a version it does not know."""
    data = _with_u16(artifact.data, FIELD_SERIALIZATION_VERSION, MAX_SERIALIZATION_VERSION + 1)
    assert jexport.deserialize(bytearray(data)).fun_name == "_stage"
    with pytest.raises(ArtifactError) as info:
        load_artifact(data)
    assert str(info.value).startswith(
        f"artifact serialization version {MAX_SERIALIZATION_VERSION + 1} is not supported: "
        f"{LOCAL} reads versions {MIN_SERIALIZATION_VERSION}..{MAX_SERIALIZATION_VERSION} "
        f"(artifact {digest_of(data)})")


def test_error_serialization_version_field_missing(artifact: Artifact) -> None:
    data = _without_field(artifact.data, FIELD_SERIALIZATION_VERSION)
    assert ser_flatbuf.Exported.GetRootAs(bytearray(data), 0).SerializationVersion() == 0
    with pytest.raises(ArtifactError, match=r"^artifact serialization version 0 is not "
                                            r"supported"):
        load_artifact(data)


# --- the calling convention window


@pytest.mark.skipif(CC_LO == CC_HI, reason=f"jax {jax.__version__} exports one version only")
@pytest.mark.parametrize("calling_convention", [CC_LO], indirect=True)
def test_error_calling_convention_below_a_narrowed_window(calling_convention: int) -> None:
    old = _export()  # a real artifact, serialized by jax at its oldest calling convention
    assert old.meta.calling_convention_version == calling_convention
    exported = load_artifact(old.data, expected_digest=old.digest, platform="cpu")
    assert exported.calling_convention_version == calling_convention
    w, n, x = _values(3)
    y, new_n = jax.jit(exported.call)(w, n, x)
    np.testing.assert_allclose(np.asarray(y), np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    assert int(new_n) == 4

    with pytest.raises(ArtifactError) as info:
        load_artifact(old.data, calling_conventions=(CC_LO + 1, CC_HI))
    assert str(info.value) == (
        f"artifact calling convention version {CC_LO} is not supported: {LOCAL} supports "
        f"{CC_LO}..{CC_HI}, and the caller accepts only {CC_LO + 1}..{CC_HI} (artifact '_stage', "
        f"{old.digest}). Re-export the stage with a jax close to the worker's, or with "
        "jax_export_calling_convention_version in the window")


@pytest.mark.parametrize("version", [CC_LO - 1, CC_HI + 1, 0, 0xFFFF])
def test_error_calling_convention_outside_jax_window(artifact: Artifact, version: int) -> None:
    data = _with_u16(artifact.data, FIELD_CALLING_CONVENTION_VERSION, version)
    # jax reads the field and neither its reader nor Exported.call checks it: vetting must.
    assert jexport.deserialize(bytearray(data)).calling_convention_version == version
    with pytest.raises(ArtifactError) as info:
        load_artifact(data, expected_digest=digest_of(data))
    assert str(info.value).startswith(
        f"artifact calling convention version {version} is not supported: {LOCAL} supports "
        f"{CC_LO}..{CC_HI} (artifact '_stage', {digest_of(data)})")


@pytest.mark.parametrize("window", [(CC_LO - 1, CC_HI), (CC_LO, CC_HI + 1), (CC_HI, CC_LO),
                                    [CC_LO, CC_HI], (float(CC_LO), CC_HI)])
def test_error_calling_conventions_argument_outside_jax(artifact: Artifact, window: Any) -> None:
    if window == (CC_HI, CC_LO) and CC_LO == CC_HI:
        pytest.skip("an empty window needs two versions")
    with pytest.raises(ArtifactError) as info:
        load_artifact(artifact.data, calling_conventions=window)
    assert str(info.value) == (
        f"calling_conventions={window!r}: expected a (lowest, highest) pair of ints inside "
        f"{CC_LO}..{CC_HI}, the calling convention versions {LOCAL} supports")


# --- corrupt bytes: every failure is an ArtifactError that names the bytes


def test_error_jax_reader_failure_is_corrupt_artifact(artifact: Artifact) -> None:
    data = _without_field(artifact.data, FIELD_IN_TREE)
    with pytest.raises(AttributeError):  # what jax's own reader raises
        jexport.deserialize(bytearray(data))
    with pytest.raises(ArtifactError) as info:
        load_artifact(data, expected_digest=digest_of(data))
    message = str(info.value)
    assert message.startswith(f"corrupt artifact ({len(data)} bytes): jax.export.deserialize "
                              "failed with AttributeError: ")
    assert f"its digest is {digest_of(data)}). Re-export or re-fetch it" in message


def test_error_module_not_bytecode(artifact: Artifact) -> None:
    assert artifact.data.count(b"ML\xefR") == 1
    data = artifact.data.replace(b"ML\xefR", b"MLIR")
    with pytest.raises(ArtifactError, match=rf"^corrupt artifact \({len(data)} bytes\): the "
                                            r"StableHLO module is not MLIR bytecode"):
        load_artifact(data)


def test_error_corrupt_names_the_digest() -> None:
    data = np.random.default_rng(1).bytes(512)
    with pytest.raises(ArtifactError) as info:
        load_artifact(data)
    assert str(info.value).startswith("corrupt artifact (512 bytes): ")
    assert f"its digest is {digest_of(data)}" in str(info.value)


# --- custom calls, found by walking the module


def _linear_stage(params: Any, state: Any, inputs: Any) -> Any:
    with ops.exporting_for_kernels():
        w = ops.QTensor(params["w"], "Q8_0", transposed=True)
        return {"y": ops.linear(inputs["x"], w)}, {}


def test_walk_finds_the_kernel_targets() -> None:
    row_bytes = 256 // 32 * 34  # Q8_0: 32 values in 34 bytes
    art = export_stage(_linear_stage, params={"w": ((8, row_bytes), "uint8")},
                       inputs={"x": ("b, 256", "float32")}, platforms=("cpu", "cuda"),
                       unstable_custom_calls=sorted(kernels.OWN_TARGETS))
    exported = jexport.deserialize(bytearray(art.data))
    targets = custom_call_targets(exported)
    # The CPU branch: the kernel for few rows, ggml's dequantize then XLA's dot for many.
    assert {kernels.TARGET, kernels.DEQUANTIZE_TARGET} <= targets
    assert targets <= kernels.OWN_TARGETS | {"shape_assertion"}
    assert art.meta.custom_call_targets == tuple(sorted(targets))
    # Reference: this module holds no decoy text, so the printed calls are exactly the targets.
    assert targets == set(re.findall(r"stablehlo\.custom_call @([\w.$-]+)\(",
                                     exported.mlir_module()))
    with pytest.raises(ArtifactError, match=r"uses custom call 'jaxdist_ggml_\w+', which is not "
                                            "on the allowlist"):
        load_artifact(art.data, platform="cpu")
    load_artifact(art.data, platform="cpu",
                  allowed_custom_calls=DEFAULT_CUSTOM_CALL_ALLOWLIST | kernels.OWN_TARGETS)


DECOY = "stablehlo.custom_call @evil(%arg0)"


def _decoy_stage(params: Any, state: Any, inputs: Any) -> Any:
    # The decoy is in a location (the named scope) and in a string attribute of a real call.
    with jax.named_scope(DECOY):
        y = jnp.sin(inputs["x"])
    call = jax.ffi.ffi_call("my_secret_kernel", jax.ShapeDtypeStruct(y.shape, jnp.float32))
    return {"y": call(y, note=DECOY)}, {}


def test_walk_is_not_fooled_by_text() -> None:
    art = export_stage(_decoy_stage, params={}, inputs={"x": ((4,), "float32")},
                       platforms=("cpu",), unstable_custom_calls=["my_secret_kernel"])
    exported = jexport.deserialize(bytearray(art.data))
    text = exported.mlir_module()
    assert text.count(DECOY) == 2  # in a location and in the call's backend_config
    # What a search of the printed module (the former vetting) takes for targets:
    assert set(re.findall(r"stablehlo\.custom_call\s+@([\w.$-]+)", text)) == {
        "my_secret_kernel", "evil"}
    assert custom_call_targets(exported) == {"my_secret_kernel"}
    assert art.meta.custom_call_targets == ("my_secret_kernel",)
    load_artifact(art.data, allowed_custom_calls={"my_secret_kernel"})
    with pytest.raises(ArtifactError, match=r"^artifact '_decoy_stage' uses custom call "
                                            r"'my_secret_kernel', which is not on the allowlist"):
        load_artifact(art.data)


def test_walk_finds_calls_in_every_platform_branch() -> None:
    def solve(params: Any, state: Any, inputs: Any) -> Any:
        return {"l": jnp.linalg.cholesky(inputs["a"] @ inputs["a"].T + 4 * jnp.eye(4))}, {}

    art = export_stage(solve, params={}, inputs={"a": ((4, 4), "float32")},
                       platforms=("cpu", "cuda"))
    exported = load_artifact(art.data, platform="cuda",
                             allowed_custom_calls={"shape_assertion", "lapack_*", "cusolver_*"})
    assert custom_call_targets(exported) == {"lapack_spotrf_ffi", "cusolver_potrf_ffi"}
