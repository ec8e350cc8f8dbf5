"""Tests for jaxdist.core.artifacts: export_stage, load_artifact and its refusals.

This machine has no GPU or TPU. Artifacts for cuda/tpu are exported and inspected here (platforms,
module text, custom calls) but only ever executed on cpu.
"""

from __future__ import annotations

import fnmatch
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.core.artifacts import (
    DEFAULT_CUSTOM_CALL_ALLOWLIST,
    MAX_SERIALIZATION_VERSION,
    MIN_SERIALIZATION_VERSION,
    Artifact,
    ArtifactMeta,
    custom_call_targets,
    digest_of,
    export_stage,
    load_artifact,
)
from jaxdist.core.errors import ArtifactError

D = 512


def block(params, state, inputs):
    """A small stage: a masked projection, a residual, a running step counter."""
    x = inputs["x"] * inputs["mask"][..., None]  # "b", "s" must be the same dims in both inputs
    h = jnp.tanh(x @ params["w_in"]) @ params["w_out"] + x
    # Not in sorted order on purpose: the artifact must keep this order.
    outputs = {"hidden": h, "argmax": jnp.argmax(h, axis=-1).astype(jnp.int32)}
    return outputs, {"steps": state["steps"] + 1}


PARAMS = {
    "w_out": jax.ShapeDtypeStruct((D, D), jnp.float32),
    "w_in": jax.ShapeDtypeStruct((D, D), jnp.float32),
}
STATE = {"steps": ((), "int32")}
INPUTS = {"x": ("b, s, 512", "float32"), "mask": ("b, s", "float32")}


@pytest.fixture(scope="module")
def artifact() -> Artifact:
    return export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS,
                        platforms=("cpu", "cuda", "tpu"))


def _values(b: int, s: int, seed: int = 0) -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal((D, D), np.float32) / np.sqrt(D) for n in ("w_out", "w_in")}
    state = {"steps": np.int32(5)}
    inputs = {"x": rng.standard_normal((b, s, D), np.float32),
              "mask": (rng.random((b, s)) > 0.2).astype(np.float32)}
    return params, state, inputs


def test_export_lists_platforms_and_is_small(artifact: Artifact) -> None:
    assert artifact.meta.platforms == ("cpu", "cuda", "tpu")
    assert not artifact.meta.portable
    weight_bytes = 2 * D * D * 4  # 2 MiB of weights: they are arguments, not constants
    assert len(artifact.data) < weight_bytes / 100


def test_meta_names_in_call_order(artifact: Artifact) -> None:
    meta = artifact.meta
    assert [t.name for t in meta.params] == ["w_out", "w_in"]
    assert [t.name for t in meta.state] == ["steps"]
    assert [t.name for t in meta.inputs] == ["x", "mask"]
    assert [t.name for t in meta.outputs] == ["hidden", "argmax"]
    assert meta.inputs[0].dims == ("b", "s", 512)  # a constant dim is an int, as in a StageSpec
    assert meta.inputs[1].dims == ("b", "s")
    assert (meta.outputs[1].dtype, meta.outputs[1].dims) == ("int32", ("b", "s"))
    assert meta.state[0].dims == ()
    assert meta.jax_version == jax.__version__
    assert meta.custom_call_targets == ("shape_assertion",)
    assert MIN_SERIALIZATION_VERSION <= meta.serialization_version <= MAX_SERIALIZATION_VERSION
    assert meta.nr_devices == 1
    assert ArtifactMeta.from_dict(meta.to_dict()) == meta


@pytest.mark.parametrize(("b", "s"), [(1, 3), (2, 7)])
def test_exported_call_matches_jit(artifact: Artifact, b: int, s: int) -> None:
    exported = load_artifact(artifact.data, expected_digest=artifact.digest, platform="cpu")
    params, state, inputs = _values(b, s, seed=b * 100 + s)
    flat = [*params.values(), *state.values(), *inputs.values()]
    got = jax.jit(exported.call)(*flat)
    outputs, new_state = jax.jit(block)(params, state, inputs)
    # jit returns dicts with sorted keys; the artifact keeps the order block() returned.
    expected = [outputs["hidden"], outputs["argmax"], new_state["steps"]]
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-5)
    assert int(got[2]) == 6


def test_output_names_override() -> None:
    art = export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("cpu",),
                       output_names=["argmax", "hidden"])
    assert [t.name for t in art.meta.outputs] == ["argmax", "hidden"]
    assert art.meta.outputs[0].dtype == "int32"


def test_digest_is_stable(artifact: Artifact) -> None:
    assert artifact.digest == digest_of(artifact.data) == digest_of(bytes(artifact.data))
    assert artifact.digest.startswith("sha256:") and len(artifact.digest) == 7 + 64
    again = export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS,
                         platforms=("cpu", "cuda", "tpu"))
    assert again.digest == artifact.digest  # export is deterministic, so content addresses dedupe


def test_cuda_tpu_artifact_inspectable(artifact: Artifact) -> None:
    # No GPU/TPU here: we can only check the lowering is present and the module is readable.
    exported = load_artifact(artifact.data, platform="tpu")
    assert exported.platforms == ("cpu", "cuda", "tpu")
    assert load_artifact(artifact.data, platform="cuda").platforms == exported.platforms
    text = exported.mlir_module()
    assert "_platform_index" in text  # multi-platform modules dispatch on a platform index
    assert custom_call_targets(exported) == {"shape_assertion"}


LINALG_ALLOWED = DEFAULT_CUSTOM_CALL_ALLOWLIST | {"lapack_*_ffi", "cusolver_*_ffi",
                                                 "cu_lu_pivots_to_permutation", "Eigh", "Qr",
                                                 "ProductOfElementaryHouseholderReflectors",
                                                 "LuDecomposition"}


def test_linalg_custom_calls_are_denied_by_default_and_load_when_allowed() -> None:
    def solve(params, state, inputs):
        a = inputs["a"] @ inputs["a"].T + 8 * jnp.eye(8)
        return {"x": jnp.linalg.solve(a, params["b"]), "l": jnp.linalg.cholesky(a)}, {}

    for platforms in (("cpu",), ("cuda",), ("tpu",)):
        art = export_stage(solve, params={"b": ((8, 2), "float32")},
                           inputs={"a": ((8, 8), "float32")}, platforms=platforms)
        assert art.meta.custom_call_targets, platforms  # linalg lowers to custom calls
        with pytest.raises(ArtifactError, match="not on the allowlist"):
            load_artifact(art.data, platform=platforms[0])
        # jax's own lowerings alias each result buffer they overwrite to an operand of its type
        load_artifact(art.data, platform=platforms[0], allowed_custom_calls=LINALG_ALLOWED)


def _undersized_getrf(params, state, inputs):
    """The attack: LAPACK's LU factorization of a 512 x 512 operand into a declared 1 x 1
    result (the handler sizes what it writes from the operand: a heap overflow)."""
    call = jax.ffi.ffi_call("lapack_sgetrf_ffi", (jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                                  jax.ShapeDtypeStruct((1,), jnp.int32),
                                                  jax.ShapeDtypeStruct((), jnp.int32)))
    return {"y": call(inputs["x"])[0]}, {}


def test_undersized_linalg_result_is_refused_even_when_allowed() -> None:
    art = export_stage(_undersized_getrf, params={}, inputs={"x": ((512, 512), "float32")},
                       platforms=("cpu",), unstable_custom_calls=["lapack_sgetrf_ffi"])
    assert len(art.data) < 4096  # the attacker's artifact is small
    with pytest.raises(ArtifactError, match="'lapack_sgetrf_ffi', which is not on the allowlist"):
        load_artifact(art.data)
    with pytest.raises(ArtifactError, match=r"'lapack_sgetrf_ffi' does not check its buffers"):
        load_artifact(art.data, allowed_custom_calls=LINALG_ALLOWED)


def test_default_allowlist_is_what_the_projects_stages_need() -> None:
    assert DEFAULT_CUSTOM_CALL_ALLOWLIST == {"shape_assertion"}


def test_default_allowlist_only_has_jax_stable_targets() -> None:
    from jax._src.export._export import _CUSTOM_CALL_TARGETS_GUARANTEED_STABLE as stable

    for pattern in DEFAULT_CUSTOM_CALL_ALLOWLIST:
        matches = [t for t in stable if fnmatch.fnmatchcase(t, pattern)]
        assert matches, f"{pattern} matches no target jax guarantees"


def test_portable_metal_artifact() -> None:
    art = export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("metal",))
    assert art.meta.platforms == ("cpu",) and art.meta.portable
    exported = load_artifact(art.data, platform="metal")
    assert load_artifact(art.data, platform="tpu").platforms == ("cpu",)
    params, state, inputs = _values(1, 2)
    out = jax.jit(exported.call)(*params.values(), *state.values(), *inputs.values())
    assert out[0].shape == (1, 2, D)


def test_symbolic_constraints_recorded() -> None:
    art = export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("cpu",),
                       symbolic_constraints=("s <= 4096",))
    assert art.meta.symbolic_constraints == ("s <= 4096",)


# --- refusals on load


def test_error_corrupt_random_bytes() -> None:
    data = np.random.default_rng(0).bytes(4096)
    with pytest.raises(ArtifactError, match=r"corrupt artifact \(4096 bytes\)"):
        load_artifact(data)


@pytest.mark.parametrize("keep", [0, 10, 100, 0.5, 0.9])
def test_error_corrupt_truncated(artifact: Artifact, keep: float) -> None:
    n = int(len(artifact.data) * keep) if isinstance(keep, float) else keep
    expected = rf"corrupt artifact \({n} bytes\).*Re-export or re-fetch"
    with pytest.raises(ArtifactError, match=expected):
        load_artifact(artifact.data[:n])


def test_error_digest_mismatch(artifact: Artifact) -> None:
    wrong = digest_of(b"something else")
    with pytest.raises(ArtifactError) as info:
        load_artifact(artifact.data, expected_digest=wrong)
    assert f"expected {wrong}, found {artifact.digest}" in str(info.value)


def test_error_digest_malformed(artifact: Artifact) -> None:
    with pytest.raises(ArtifactError, match="expected digest 'md5:abc' is malformed"):
        load_artifact(artifact.data, expected_digest="md5:abc")


def test_error_platform_not_present() -> None:
    art = export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("tpu",))
    with pytest.raises(ArtifactError) as info:
        load_artifact(art.data, platform="cpu")
    assert "was exported for ['tpu'], not for 'cpu'" in str(info.value)


def test_error_platform_unknown(artifact: Artifact) -> None:
    with pytest.raises(ArtifactError, match="platform 'gpu' is not known"):
        load_artifact(artifact.data, platform="gpu")


def _ffi_stage(params, state, inputs):
    # A made-up FFI target: it lowers to a custom call without the target existing.
    result = jax.ShapeDtypeStruct(inputs["x"].shape, jnp.float32)
    call = jax.ffi.ffi_call("my_secret_kernel", result)
    return {"y": call(inputs["x"])}, {}


def test_error_forbidden_custom_call() -> None:
    art = export_stage(_ffi_stage, params={}, inputs={"x": ((4,), "float32")},
                       platforms=("cpu",), unstable_custom_calls=["my_secret_kernel"])
    assert art.meta.custom_call_targets == ("my_secret_kernel",)
    with pytest.raises(ArtifactError) as info:
        load_artifact(art.data)
    message = str(info.value)
    assert "uses custom call 'my_secret_kernel', which is not on the allowlist" in message
    assert "allowed_custom_calls=DEFAULT_CUSTOM_CALL_ALLOWLIST | {'my_secret_kernel'}" in message
    # Extending the allowlist (also by glob) lets it through.
    load_artifact(art.data, allowed_custom_calls=DEFAULT_CUSTOM_CALL_ALLOWLIST | {"my_*"})


def test_error_tiny_allowlist_excludes_shape_assertion(artifact: Artifact) -> None:
    with pytest.raises(ArtifactError, match="uses custom call 'shape_assertion'"):
        load_artifact(artifact.data, allowed_custom_calls={"lapack_*"})


def _with_serialization_version(data: bytes, version: int) -> bytes:
    # Built by patching the bytes: we locate the serialization_version field (vtable slot 4) with
    # jax's generated flatbuffer reader and overwrite its uint16 in place.
    from jax._src.export import serialization_generated as ser_flatbuf

    buf = bytearray(data)
    table = ser_flatbuf.Exported.GetRootAs(buf, 0)._tab
    field = table.Offset(4)
    assert field != 0, "jax wrote no serialization_version field"
    struct.pack_into("<H", buf, table.Pos + field, version)
    return bytes(buf)


@pytest.mark.parametrize("version", [MAX_SERIALIZATION_VERSION + 1, 999, 1, 0])
def test_error_unsupported_serialization_version(artifact: Artifact, version: int) -> None:
    data = _with_serialization_version(artifact.data, version)
    with pytest.raises(ArtifactError) as info:
        load_artifact(data, expected_digest=digest_of(data))
    message = str(info.value)
    assert f"serialization version {version} is not supported" in message
    assert f"local jax {jax.__version__}" in message
    assert f"reads versions {MIN_SERIALIZATION_VERSION}..{MAX_SERIALIZATION_VERSION}" in message


def test_patched_supported_version_still_loads(artifact: Artifact) -> None:
    data = _with_serialization_version(artifact.data, MAX_SERIALIZATION_VERSION)
    assert load_artifact(data).platforms == ("cpu", "cuda", "tpu")


# --- refusals on export


def test_error_export_bad_return() -> None:
    with pytest.raises(ArtifactError, match=r"must return \(outputs: dict, new_state: dict\)"):
        export_stage(lambda p, s, x: x["x"], params={}, inputs={"x": ((2,), "float32")},
                     platforms=("cpu",))


def test_error_export_state_changes_shape() -> None:
    def grows(p, s, x):
        return {"y": x["x"]}, {"cache": jnp.concatenate([s["cache"], x["x"]])}

    with pytest.raises(ArtifactError, match=r"new_state\['cache'\] is float32\[4\], expected "
                                            r"float32\[2\]"):
        export_stage(grows, params={}, state={"cache": ((2,), "float32")},
                     inputs={"x": ((2,), "float32")}, platforms=("cpu",))


def test_error_export_duplicate_name() -> None:
    with pytest.raises(ArtifactError, match=r"inputs\['w'\]: name already used in params"):
        export_stage(block, params={"w": ((2,), "float32")}, inputs={"w": ((2,), "float32")},
                     platforms=("cpu",))


def test_error_export_bad_shape_spec() -> None:
    with pytest.raises(ArtifactError, match=r"inputs\['x'\]: cannot parse shape spec 'b, \?'"):
        export_stage(block, params=PARAMS, inputs={"x": ("b, ?", "float32")}, platforms=("cpu",))


def test_error_export_bad_dtype() -> None:
    with pytest.raises(ArtifactError, match=r"params\['w'\]: dtype 'float33' is not a dtype"):
        export_stage(block, params={"w": ((2,), "float33")}, inputs={}, platforms=("cpu",))


def test_error_export_metal_mixed() -> None:
    with pytest.raises(ArtifactError, match="'metal' means a portable cpu lowering"):
        export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("metal", "cuda"))


def test_error_export_unknown_platform() -> None:
    with pytest.raises(ArtifactError, match=r"unknown: \['gpu'\]"):
        export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("gpu",))


def test_error_export_output_names_mismatch() -> None:
    with pytest.raises(ArtifactError, match=r"output_names \['hidden'\] do not match"):
        export_stage(block, params=PARAMS, state=STATE, inputs=INPUTS, platforms=("cpu",),
                     output_names=["hidden"])
