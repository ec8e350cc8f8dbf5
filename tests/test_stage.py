"""jaxdist.core.stage (WorkerStage) and jaxdist.coordinator.inprocess: the Foundation parity tests, in one process.

Weights are written to real GGUF and safetensors files with the formats' own writers. The
independent reference is a plain single-process ``jax.jit`` of the same math, fed the arrays that
were written (quantized ones decoded by ``gguf.quants.dequantize``), never anything jaxdist read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as ref
from safetensors.numpy import save_file

from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core.artifacts import digest_of
from jaxdist.core.errors import ArtifactError, DeviceError, SpecError
from jaxdist.core.spec import StageSpec
from jaxdist.core.stage import WorkerStage
from jaxdist.core.weights import WeightCache
from jaxdist.export.model import Model, Param, Unit
from jaxdist.export.stages import BuiltStage, build_stage_specs
from jaxdist.proto import jaxdist_pb2 as pb

RTOL, ATOL = 1e-5, 1e-6

D, H = 32, 64                          # MLP widths; D is also the transformer width
HEADS, HD, FF, MAX_SEQ = 4, 8, 256, 16  # transformer block; FF = one Q4_K super-block per row

RNG = np.random.default_rng(0)


def _normal(*shape: int, scale: float) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _k_blocks(qtype: T, rows: int, cols: int, f16: dict[int, float]) -> np.ndarray:
    """Random valid K-quant blocks (gguf.quants cannot quantize K-quants) with fixed f16 scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_elems
    blocks = np.random.default_rng(1).integers(0, 256, (n, block_bytes), np.uint8)
    for offset, value in f16.items():
        blocks[:, offset:offset + 2] = np.full(n, value, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


# What goes into the files. GGUF: name -> (stored array or blocks, GGML type or None for f32).
GGUF_TENSORS: dict[str, tuple[np.ndarray, T | None]] = {
    "mlp.w0": (_normal(D, H, scale=0.3), None),
    "mlp.w1": (ref.quantize(_normal(H, H, scale=0.2), T.Q8_0), T.Q8_0),
    "mlp.w2": (ref.quantize(_normal(H, H, scale=0.2), T.Q4_0), T.Q4_0),
    "blk.wq": (_normal(D, D, scale=0.3), None),
    "blk.wk": (_normal(D, D, scale=0.3), None),
    "blk.wv": (ref.quantize(_normal(D, D, scale=0.3), T.Q8_0), T.Q8_0),
    "blk.wo": (_normal(D, D, scale=0.2), None),     # stored (out, in): bound with transpose
    "blk.up": (_k_blocks(T.Q4_K, D, FF, {0: 0.002, 2: 0.004}), T.Q4_K),  # bound packed
    "blk.down": (ref.quantize(_normal(FF, D, scale=0.05), T.Q4_0), T.Q4_0),
    "t.gguf": (_normal(6, 10, scale=1.0), None),    # transposed-bind test
}
ST_TENSORS: dict[str, np.ndarray] = {
    "mlp.b0": _normal(H, scale=0.1),
    "mlp.w3": _normal(D, H, scale=0.2),              # stored (out, in): bound with transpose
    "blk.attn_norm": 1.0 + _normal(D, scale=0.1),
    "blk.ffn_norm": 1.0 + _normal(D, scale=0.1),
    "t.st": _normal(6, 10, scale=1.0),
}


def expected(name: str) -> np.ndarray:
    """The independent reference value of a stored tensor, as stored (no transpose)."""
    if name in ST_TENSORS:
        return ST_TENSORS[name]
    data, qtype = GGUF_TENSORS[name]
    return data if qtype is None else np.asarray(ref.dequantize(data, qtype), np.float32)


def write_gguf(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in GGUF_TENSORS.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    write_gguf(root / "m.gguf")
    save_file(ST_TENSORS, str(root / "m.safetensors"))
    return root


@pytest.fixture
def cache(root: Path) -> Iterator[WeightCache]:
    with WeightCache([root]) as c:
        yield c


def g(name: str) -> str:
    return f"gguf://m.gguf#{name}"


def s(name: str) -> str:
    return f"safetensors://m.safetensors#{name}"


# -- the 2-stage MLP ------------------------------------------------------------------------------


def _dense_tanh(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]) -> tuple[dict, dict]:
    return {"x": jnp.tanh(c["x"] @ p["w"] + p["b"])}, {}


def _dense_gelu(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]) -> tuple[dict, dict]:
    return {"x": jax.nn.gelu(c["x"] @ p["w"])}, {}


def _dense_packed_q4_0(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]
                       ) -> tuple[dict, dict]:
    w = p["w"].dequantize()  # a QTensor of the stored (H, H) Q4_0 blocks
    assert w.shape == (H, H)
    return {"x": jnp.tanh(c["x"] @ w)}, {}


def _dense_out(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]) -> tuple[dict, dict]:
    return {"y": c["x"] @ p["w"]}, {}


def mlp_model() -> Model:
    return Model(
        "mlp",
        units=[
            # GGUF f32 weight + safetensors bias.
            Unit("l0", _dense_tanh, {"w": Param(g("mlp.w0"), (D, H)),
                                     "b": Param(s("mlp.b0"), (H,))}),
            # GGUF Q8_0, dequantized at bind time.
            Unit("l1", _dense_gelu, {"w": Param(g("mlp.w1"), (H, H), quant="Q8_0")}),
            # GGUF Q4_0, bound packed and dequantized in the graph.
            Unit("l2", _dense_packed_q4_0,
                 {"w": Param(g("mlp.w2"), (H, H), packed=True, quant="Q4_0")}),
            # safetensors (out, in), bound transposed.
            Unit("l3", _dense_out, {"w": Param(s("mlp.w3"), (H, D), transpose=True)}),
        ],
        inputs={"x": ("b, 32", "float32")},
        buckets=[{"b": 1}, {"b": 4}],
    )


@jax.jit
def mlp_reference(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    x = jnp.tanh(x @ w["w0"] + w["b0"])
    x = jax.nn.gelu(x @ w["w1"])
    x = jnp.tanh(x @ w["w2"])
    return x @ w["w3"]


def mlp_reference_weights() -> dict[str, np.ndarray]:
    return {"w0": expected("mlp.w0"), "b0": expected("mlp.b0"), "w1": expected("mlp.w1"),
            "w2": expected("mlp.w2"), "w3": expected("mlp.w3").T}


@pytest.fixture(scope="module")
def mlp_pipeline(root: Path) -> Iterator[InProcessPipeline]:
    with InProcessPipeline(mlp_model(), weights_roots=[root], stages=2) as pipe:
        yield pipe


def test_mlp_two_stages_match_single_process_jit(mlp_pipeline: InProcessPipeline) -> None:
    assert len(mlp_pipeline.stages) == 2
    # Every bucket was compiled when the stage loaded, before any call (buckets come first).
    s0, s1 = mlp_pipeline.stages
    assert s0.compiled_shapes[:2] == [((1, D),), ((4, D),)]
    assert s1.compiled_shapes[:2] == [((1, H),), ((4, H),)]
    assert [s.spec.stage_index for s in mlp_pipeline.stages] == [0, 1]
    # Both stages got units: every weight of the model is bound on exactly one stage.
    params = [[w.param for w in s.spec.weights] for s in mlp_pipeline.stages]
    assert all(params) and sorted(sum(params, [])) == ["l0.b", "l0.w", "l1.w", "l2.w", "l3.w"]
    weights = mlp_reference_weights()
    for b in (1, 4):
        x = np.random.default_rng(b).standard_normal((b, D)).astype(np.float32)
        out = mlp_pipeline.call({"x": x})
        assert list(out) == ["y"] and out["y"].shape == (b, D) and out["y"].dtype == np.float32
        np.testing.assert_allclose(out["y"], mlp_reference(x, weights), rtol=RTOL, atol=ATOL)


def test_mlp_buckets_are_compiled_ahead_of_time(mlp_pipeline: InProcessPipeline) -> None:
    s0, s1 = mlp_pipeline.stages
    # The symbolic batch dim travels from stage 0's output to stage 1's input.
    assert s0.spec.inputs[0].dims == ("b", D) and s1.spec.inputs[0].dims == ("b", H)
    assert [b.dims for b in s0.spec.buckets] == [{"b": 1}, {"b": 4}]
    assert [b.dims for b in s1.spec.buckets] == [{"b": 1}, {"b": 4}]
    assert s0.compiled_shapes[:2] == [((1, D),), ((4, D),)]
    before = (s0.compile_seconds, s1.compile_seconds)
    mlp_pipeline.call({"x": np.zeros((4, D), np.float32)})
    assert (s0.compile_seconds, s1.compile_seconds) == before  # a bucket: nothing compiled


def test_mlp_shape_outside_buckets_is_refused(mlp_pipeline: InProcessPipeline) -> None:
    """A spec with buckets takes their shapes only (StageSpec.any_shape false): another one is
    refused before anything compiles, and the pipeline goes on."""
    s0 = mlp_pipeline.stages[0]
    x = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
    with pytest.raises(SpecError) as err:
        mlp_pipeline.call({"x": x})
    assert str(err.value) == (
        f"stage 0: input shapes x (3, {D}) (b=3) are in none of its 2 buckets (b=1; b=4); the "
        f"spec takes those shapes only (StageSpec.any_shape is false): pad the inputs to a "
        f"bucket")
    assert ((3, D),) not in s0.compiled_shapes
    out = mlp_pipeline.call({"x": x[:1]})
    np.testing.assert_allclose(out["y"], mlp_reference(x[:1], mlp_reference_weights()),
                               rtol=RTOL, atol=ATOL)


def test_mlp_any_shape_compiles_outside_buckets_on_demand(root: Path) -> None:
    model = dataclasses.replace(mlp_model(), any_shape=True)
    with InProcessPipeline(model, weights_roots=[root], stages=2) as pipe:
        s0 = pipe.stages[0]
        assert s0.spec.any_shape and s0.compiled_shapes == [((1, D),), ((4, D),)]
        x = np.random.default_rng(3).standard_normal((3, D)).astype(np.float32)
        out = pipe.call({"x": x})
        assert ((3, D),) in s0.compiled_shapes
        np.testing.assert_allclose(out["y"], mlp_reference(x, mlp_reference_weights()),
                                   rtol=RTOL, atol=ATOL)


# -- a transformer block with a resident KV cache -------------------------------------------------


def _rms(x: jax.Array, gain: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * gain


def _block(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]) -> tuple[dict, dict]:
    x, pos = c["x"], c["pos"]
    n = x.shape[0]  # symbolic: the prompt length, or 1 when decoding
    h = _rms(x, p["attn_norm"])
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    kc = jax.lax.dynamic_update_slice(st["k"], k, (pos, 0))
    vc = jax.lax.dynamic_update_slice(st["v"], v, (pos, 0))
    visible = jnp.arange(MAX_SEQ)[None, :] <= (pos + jnp.arange(n))[:, None]  # (n, MAX_SEQ)
    scores = jnp.einsum("qhd,khd->hqk", q.reshape(n, HEADS, HD),
                        kc.reshape(MAX_SEQ, HEADS, HD)) / np.sqrt(HD).astype(np.float32)
    att = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
    o = jnp.einsum("hqk,khd->qhd", att, vc.reshape(MAX_SEQ, HEADS, HD)).reshape(n, D)
    x = x + o @ p["wo"]
    up = p["up"].dequantize()
    x = x + jax.nn.silu(_rms(x, p["ffn_norm"]) @ up) @ p["down"]
    return {"h": x}, {"k": kc, "v": vc}


def block_model() -> Model:
    params = {
        "attn_norm": Param(s("blk.attn_norm"), (D,)),
        "wq": Param(g("blk.wq"), (D, D)),
        "wk": Param(g("blk.wk"), (D, D)),
        "wv": Param(g("blk.wv"), (D, D), quant="Q8_0"),
        "wo": Param(g("blk.wo"), (D, D), transpose=True),
        "ffn_norm": Param(s("blk.ffn_norm"), (D,)),
        "up": Param(g("blk.up"), (D, FF), packed=True, quant="Q4_K"),
        "down": Param(g("blk.down"), (FF, D), quant="Q4_0"),
    }
    state = {"k": ((MAX_SEQ, D), "float32"), "v": ((MAX_SEQ, D), "float32")}
    return Model("block", units=[Unit("blk", _block, params, state)],
                 inputs={"x": ("s, 32", "float32"), "pos": ((), "int32")},
                 # dynamic_update_slice into the cache needs the update to fit.
                 constraints=(f"s <= {MAX_SEQ}",), buckets=[{"s": 4}, {"s": 1}])


@jax.jit
def block_reference(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """The whole sequence at once, with a causal mask and no cache."""
    n = x.shape[0]
    h = _rms(x, w["attn_norm"])
    q, k, v = (jnp.reshape(h @ w[n_], (n, HEADS, HD)) for n_ in ("wq", "wk", "wv"))
    scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(HD).astype(np.float32)
    causal = jnp.tril(jnp.ones((n, n), bool))
    att = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
    x = x + jnp.einsum("hqk,khd->qhd", att, v).reshape(n, D) @ w["wo"]
    return x + jax.nn.silu(_rms(x, w["ffn_norm"]) @ w["up"]) @ w["down"]


def block_reference_weights() -> dict[str, np.ndarray]:
    names = {"attn_norm": "blk.attn_norm", "wq": "blk.wq", "wk": "blk.wk", "wv": "blk.wv",
             "ffn_norm": "blk.ffn_norm", "up": "blk.up", "down": "blk.down"}
    out = {k: expected(v) for k, v in names.items()}
    out["wo"] = expected("blk.wo").T
    return out


@pytest.fixture(scope="module")
def block_built() -> BuiltStage:
    (built,) = build_stage_specs(block_model(), [range(0, 1)], platforms=("cpu",))
    return built


def test_block_kv_cache_decode_matches_full_sequence(block_built: BuiltStage,
                                                     cache: WeightCache) -> None:
    # The spec crosses the wire first, as it would to a worker.
    spec = StageSpec.deserialize(block_built.spec.serialize()).replace(device="cpu")
    assert [st.name for st in spec.state] == ["blk.k", "blk.v"]
    stage = WorkerStage.load(spec, artifact=block_built.artifact.data, cache=cache)
    assert stage.compiled_shapes == [((4, D), ()), ((1, D), ())]

    prompt, decode = 4, 3
    xs = np.random.default_rng(7).standard_normal((prompt + decode, D)).astype(np.float32)
    want = np.asarray(block_reference(xs, block_reference_weights()))

    state = stage.init_state()
    steps = [(0, xs[:prompt])] + [(prompt + t, xs[prompt + t:prompt + t + 1])
                                  for t in range(decode)]
    for pos, x in steps:
        old = dict(state)
        out, state = stage.run({"x": x, "pos": np.int32(pos)}, state)
        # The state buffers were donated to the call, so XLA could update them in place.
        assert all(a.is_deleted() for a in old.values())
        assert set(state) == {"blk.k", "blk.v"}
        assert all(not a.is_deleted() and a.shape == (MAX_SEQ, D) for a in state.values())
        n = x.shape[0]
        np.testing.assert_allclose(np.asarray(out["h"]), want[pos:pos + n], rtol=RTOL, atol=ATOL)
    # Every step hit a bucket: nothing was compiled at run time.
    assert len(stage.compiled_shapes) == 2
    # The cache holds the k projections of all tokens so far and zeros after them.
    k = np.asarray(state["blk.k"])
    np.testing.assert_allclose(
        k[:prompt + decode],
        _rms(xs, block_reference_weights()["attn_norm"]) @ block_reference_weights()["wk"],
        rtol=RTOL, atol=ATOL)
    assert not k[prompt + decode:].any()


def test_block_state_is_per_session(block_built: BuiltStage, cache: WeightCache) -> None:
    stage = WorkerStage.load(block_built.spec.replace(device="cpu"),
                             artifact=block_built.artifact.data, cache=cache)
    xs = np.random.default_rng(8).standard_normal((4, D)).astype(np.float32)
    a, _ = stage.run({"x": xs, "pos": np.int32(0)}, stage.init_state())
    b, _ = stage.run({"x": xs, "pos": np.int32(0)}, stage.init_state())
    np.testing.assert_array_equal(np.asarray(a["h"]), np.asarray(b["h"]))


# -- weight layouts -------------------------------------------------------------------------------


def _identity_out(p: dict[str, Any], st: dict[str, Any], c: dict[str, Any]) -> tuple[dict, dict]:
    return {"y": c["x"] @ p["w"]}, {}


@pytest.mark.parametrize("uri,name", [(g("t.gguf"), "t.gguf"), (s("t.st"), "t.st")])
def test_transposed_weight_binds_transposed(uri: str, name: str, cache: WeightCache) -> None:
    stored = expected(name)                        # (6, 10)
    model = Model("t", units=[Unit("u", _identity_out,
                                   {"w": Param(uri, stored.shape[::-1], transpose=True)})],
                  inputs={"x": ("b, 10", "float32")})
    (built,) = build_stage_specs(model, [range(0, 1)], platforms=("cpu",))
    assert built.spec.to_proto().weights[0].layout == pb.LAYOUT_TRANSPOSE
    spec = StageSpec.deserialize(built.spec.serialize())
    assert spec.weights[0].transpose and spec.weights[0].shape == (10, 6)
    stage = WorkerStage.load(spec.replace(device="cpu"), artifact=built.artifact.data, cache=cache)
    out, _ = stage.run({"x": np.eye(10, dtype=np.float32)})
    np.testing.assert_array_equal(np.asarray(out["y"]), stored.T)


# -- errors ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_built() -> list[BuiltStage]:
    return build_stage_specs(mlp_model(), [range(0, 2), range(2, 4)], platforms=("cpu",))


@pytest.fixture(scope="module")
def mlp_stage0(mlp_built: list[BuiltStage], root: Path) -> Iterator[WorkerStage]:
    b = mlp_built[0]
    with WeightCache([root]) as cache:
        yield WorkerStage.load(b.spec.replace(device="cpu"), artifact=b.artifact.data,
                               cache=cache, compile_buckets=False)


def _load(spec: StageSpec, data: bytes, cache: WeightCache) -> WorkerStage:
    return WorkerStage.load(spec, artifact=data, cache=cache, compile_buckets=False)


def test_error_corrupt_artifact(mlp_built: list[BuiltStage], cache: WeightCache) -> None:
    spec, data = mlp_built[0].spec.replace(device="cpu"), mlp_built[0].artifact.data
    # Damaged bytes under the planned digest: refused before anything parses them.
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    with pytest.raises(ArtifactError, match=rf"artifact digest mismatch: expected "
                                            rf"{spec.artifact_digest}, found sha256:"):
        _load(spec, bytes(flipped), cache)

    # Damaged bytes whose digest is right for them (a bad export, a lying registry): still an
    # ArtifactError, not a crash. Truncation and damage to the flatbuffer tables only; damage
    # inside the embedded StableHLO module can abort the process natively (see artifacts.py).
    root_off = int.from_bytes(data[:4], "little")
    vtable = root_off - int.from_bytes(data[root_off:root_off + 4], "little", signed=True)
    bad_root = (len(data) + 8).to_bytes(4, "little") + data[4:]
    bad_vtable = data[:vtable] + b"\xff\xff\xff\xff" + data[vtable + 4:]
    cases = [(data[:8], "too short"), (data[:64], ""), (data[:len(data) // 3], "")]
    # Losing only the tail (the function name, which jax writes first) used to load silently.
    cases += [(data[:-n], "the function name ends at byte") for n in (1, 5, 12)]
    cases += [(bad_root, "root table offset"), (bad_vtable, "vtable is malformed")]
    for damaged, why in cases:
        pattern = rf"corrupt artifact \({len(damaged)} bytes\).*{why}"
        with pytest.raises(ArtifactError, match=pattern):
            _load(spec.replace(artifact_digest=digest_of(damaged)), damaged, cache)


def test_error_artifact_platform_not_present(cache: WeightCache) -> None:
    model = Model("t", units=[Unit("u", _identity_out, {"w": Param(g("t.gguf"), (6, 10))})],
                  inputs={"x": ("b, 6", "float32")})
    (built,) = build_stage_specs(model, [range(0, 1)], platforms=("tpu",))
    assert built.spec.platforms == ("tpu",)
    with pytest.raises(ArtifactError, match=r"exported for \['tpu'\], not for 'cpu'"):
        _load(built.spec.replace(device="cpu"), built.artifact.data, cache)


def test_error_unsupported_device_directive(mlp_built: list[BuiltStage],
                                            cache: WeightCache) -> None:
    spec, data = mlp_built[0].spec, mlp_built[0].artifact.data
    # A valid directive this CPU-only machine cannot honour: no silent fallback to cpu.
    with pytest.raises(DeviceError, match=r"'cuda' cannot be honoured: no cuda device is present\. "
                                          r"Devices present: cpu:0"):
        _load(spec.replace(device="cuda"), data, cache)
    with pytest.raises(DeviceError, match=r"'cpu:7' cannot be honoured: index 7 is out of range"):
        _load(spec.replace(device="cpu:7"), data, cache)
    # Not a directive at all: the spec is refused by validate.
    with pytest.raises(SpecError, match=r"^StageSpec\.device: device directive 'npu' is malformed"):
        _load(spec.replace(device="npu"), data, cache)


def test_error_spec_artifact_mismatch(mlp_built: list[BuiltStage], cache: WeightCache) -> None:
    spec, data = mlp_built[0].spec.replace(device="cpu"), mlp_built[0].artifact.data
    assert spec.weights[0].param == "l0.w"
    wrong = dataclasses.replace(spec.weights[0], shape=(H, D))
    with pytest.raises(SpecError, match=r"weight 'l0\.w': the artifact expects float32\(32, 64\), "
                                        r"the spec binds float32\(64, 32\)"):
        _load(spec.replace(weights=(wrong, *spec.weights[1:])), data, cache)
    with pytest.raises(SpecError, match=r"the artifact takes 4 arguments, the spec lists "
                                        r"2 weights \+ 0 state \+ 1 inputs = 3"):
        _load(spec.replace(weights=spec.weights[:2]), data, cache)
    out = dataclasses.replace(spec.outputs[0], dims=("b", 7))
    with pytest.raises(SpecError, match=r"output 'x': the artifact has float32\(b, 64\), "
                                        r"the spec says float32\(b, 7\)"):
        _load(spec.replace(outputs=(out,)), data, cache)


def test_error_wrong_input_shape(mlp_stage0: WorkerStage) -> None:
    with pytest.raises(SpecError, match=r"stage 0: input 'x': expected dims \(b, 32\), "
                                        r"found \(2, 31\)"):
        mlp_stage0.run({"x": np.zeros((2, 31), np.float32)})
    with pytest.raises(SpecError, match=r"input 'x': expected dims \(b, 32\), found \(32,\)"):
        mlp_stage0.run({"x": np.zeros((32,), np.float32)})


def test_input_checks_hold_after_a_shape_is_remembered(mlp_stage0: WorkerStage) -> None:
    """The dims check of a shape runs once, then is remembered; a wrong shape or dtype is still
    refused every time, before and after a good shape of the same rank; so is a shape in none
    of the buckets."""
    good = np.zeros((4, D), np.float32)
    assert mlp_stage0.check_inputs({"x": good}) == ((4, D),)
    for _ in range(2):
        assert mlp_stage0.check_inputs({"x": good}) == ((4, D),)
        with pytest.raises(SpecError, match=r"expected dims \(b, 32\), found \(4, 31\)"):
            mlp_stage0.check_inputs({"x": np.zeros((4, 31), np.float32)})
        with pytest.raises(SpecError, match=r"expected dtype float32, found float64"):
            mlp_stage0.check_inputs({"x": good.astype(np.float64)})
        with pytest.raises(SpecError, match=r"input shapes x \(2, 32\) \(b=2\) are in none of "
                                            r"its 2 buckets \(b=1; b=4\)"):
            mlp_stage0.check_inputs({"x": np.zeros((2, D), np.float32)})


def test_error_wrong_input_dtype(mlp_stage0: WorkerStage) -> None:
    with pytest.raises(SpecError, match=r"stage 0: input 'x': expected dtype float32, "
                                        r"found float64"):
        mlp_stage0.run({"x": np.zeros((2, D), np.float64)})


def test_error_wrong_input_names(mlp_stage0: WorkerStage) -> None:
    with pytest.raises(SpecError, match=r"stage 0: expected inputs \['x'\], found \['y'\]"):
        mlp_stage0.run({"y": np.zeros((2, D), np.float32)})


def test_error_missing_state(block_built: BuiltStage, cache: WeightCache) -> None:
    stage = _load(block_built.spec.replace(device="cpu"), block_built.artifact.data, cache)
    inputs = {"x": np.zeros((1, D), np.float32), "pos": np.int32(0)}
    with pytest.raises(SpecError, match=r"stage 0: this stage keeps state \['blk\.k', 'blk\.v'\]; "
                                        r"pass state \(init_state\(\) for a new session\)"):
        stage.run(inputs)
    partial = {"blk.k": stage.init_state()["blk.k"]}
    with pytest.raises(SpecError, match=r"stage 0: .*state \['blk\.k', 'blk\.v'\].*missing "
                                        r"\['blk\.v'\]"):
        stage.run(inputs, partial)
