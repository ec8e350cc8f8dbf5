"""Custom calls on a real worker (issue #15 item 4): denied by default, allowed by a flag, and an
artifact that declares a result smaller than what the native handler writes is refused at
``LoadStage`` even when its target is allowed; the worker keeps serving throughout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import ArtifactError, Cluster, JaxdistError, Model, Unit


def _solve(params, state, carry):
    a = carry["a"] @ carry["a"].T + 8 * jnp.eye(8)
    return {"a": jnp.linalg.solve(a, carry["a"]) + jnp.linalg.cholesky(a)}, {}


def _undersized_getrf(params, state, carry):
    call = jax.ffi.ffi_call("lapack_sgetrf_ffi", (jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                                  jax.ShapeDtypeStruct((1,), jnp.int32),
                                                  jax.ShapeDtypeStruct((), jnp.int32)))
    return {"a": call(carry["a"])[0]}, {}


LINALG = Model("linalg", [Unit("solve", _solve)], inputs={"a": ("8, 8", "float32")})
ATTACK = Model("attack", [Unit("getrf", _undersized_getrf)], inputs={"a": ("512, 512", "float32")})


def test_linalg_is_denied_by_default_and_the_worker_keeps_serving():
    with Cluster.local(1) as cluster:
        with pytest.raises(ArtifactError, match=r"'lapack_\w+_ffi', which is not on the "
                                                r"allowlist.*--allow-custom-call"):
            cluster.deploy(LINALG, platforms=("cpu",))
        assert cluster.info()[0].stages == []  # nothing half-loaded


def test_allowed_linalg_matches_jit_and_the_undersized_attack_is_still_refused():
    with Cluster.local(1, extra_args=["--allow-custom-call", "lapack_*_ffi"]) as cluster:
        a = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
        pipe = cluster.deploy(LINALG, platforms=("cpu",))
        want = jax.jit(lambda a: _solve({}, {}, {"a": a})[0]["a"])(a)
        np.testing.assert_allclose(pipe.call(a=a)["a"], want, rtol=1e-5, atol=1e-5)
        pipe.close()
        with pytest.raises(ArtifactError, match=r"'lapack_sgetrf_ffi' does not check its "
                                                r"buffers.*aliases no output"):
            cluster.deploy(ATTACK, platforms=("cpu",))
        (info,) = cluster.info()
        assert info.stages == []


def test_a_pattern_that_allows_everything_is_refused(tmp_path):
    from jaxdist.coordinator.spawn import spawn_workers

    with pytest.raises(JaxdistError, match=r"--allow-custom-call '\*'"):
        spawn_workers(1, extra_args=["--allow-custom-call", "*"], timeout=60)


def test_an_allowed_target_with_no_handler_is_refused_at_load_not_at_the_first_frame():
    from jaxdist.core import artifacts
    from jaxdist.core.spec import StageSpec, TensorSig

    def ffi(params, state, inputs):
        call = jax.ffi.ffi_call("my_secret_kernel", jax.ShapeDtypeStruct((4,), jnp.float32))
        return {"y": call(inputs["x"])}, {}

    art = artifacts.export_stage(ffi, params={}, inputs={"x": ((4,), "float32")},
                                 platforms=("cpu",), unstable_custom_calls=["my_secret_kernel"])
    spec = StageSpec(artifact_digest=art.digest, inputs=(TensorSig("x", "float32", (4,)),),
                     outputs=(TensorSig("y", "float32", (4,)),), device="cpu",
                     stage_id="ffi/0", artifact=art.data)
    with Cluster.local(1, extra_args=["--allow-custom-call", "my_secret_kernel"]) as cluster:
        client = cluster.clients[0]
        with pytest.raises(ArtifactError, match=r"custom call 'my_secret_kernel' is allowed but "
                                                r"no handler for it is registered"):
            client.load_stage(spec, "ffi")
        assert cluster.info()[0].stages == []
