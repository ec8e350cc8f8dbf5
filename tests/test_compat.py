"""Backward compatibility: artifacts and a manifest written by the first release (spec 1.0,
manifest version 2, jax 0.10.2) are kept in ``tests/testdata/golden`` (made by ``python
tests/testdata/make_golden.py``) and must still load and run, in-process and on real workers, with
outputs equal to numpy's. A later format version adds its own registry beside it, and every one
is loaded. This is what jax does for its own export format
(``jax/_src/internal_test_util/export_back_compat_test_data``).

Artifacts outside the window the local jax reads are refused, naming the versions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import struct
from typing import Any

import jax
import jaxlib
import numpy as np
import pytest
from jax import export as jexport
from jax._src.export import serialization_generated as ser_flatbuf
from jax._src.lib.mlir.dialects import hlo

from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.errors import ArtifactError
from jaxdist.core.stage import WorkerStage
from jaxdist.core.vetting import digest_of, load_artifact
from jaxdist.core.weights import WeightCache
from jaxdist.registry.local import LocalRegistry
from jaxdist.registry.manifest import Manifest, open_manifest

TESTDATA = pathlib.Path(__file__).parent / "testdata"
GOLDEN = TESTDATA / "golden"


def _make_golden() -> Any:
    spec = importlib.util.spec_from_file_location("make_golden", TESTDATA / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


golden = _make_golden()


GOLDENS = {2: GOLDEN}  # manifest version -> the registry its first release wrote


def _open_golden(root: pathlib.Path) -> Manifest:
    (path,) = (root / "manifests").glob("*.json")
    m, digest, store = open_manifest(str(path))
    assert digest == f"sha256:{path.stem.rsplit('-', 1)[1]}"
    assert pathlib.Path(store.location) == root
    return m


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    """The oldest golden manifest: the first release's."""
    return _open_golden(GOLDEN)


@pytest.fixture(scope="module", params=sorted(GOLDENS), ids=lambda v: f"manifest-v{v}")
def golden_version(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def _inputs(n: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.standard_normal((2, golden.D)).astype(np.float32) for _ in range(n)]


def _assert_matches(outs: list[dict[str, np.ndarray]]) -> None:
    for got, want in zip(outs, golden.reference(_inputs(len(outs))), strict=True):
        for name in ("x", "total"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_golden_manifest_reads(golden_version: int) -> None:
    root = GOLDENS[golden_version]
    manifest = _open_golden(root)
    assert manifest.manifest_version == golden_version
    assert [list(s.units) for s in manifest.stages] == [["l0"], ["l1", "acc"]]
    assert manifest.weight_uris[0] == "safetensors://{model}#l0.w"
    reg = LocalRegistry(root, create=False)
    for stage in manifest.stages:
        assert digest_of(reg.get(stage.digest)) == stage.digest  # bytes intact
        assert reg.meta(stage.digest)["jax_version"] == manifest.versions["jax"]


def test_golden_is_what_the_first_release_writes(manifest: Manifest) -> None:
    assert manifest.manifest_version == 2 and manifest.versions["spec"] == "1.0"
    assert [s.spec.spec_version for s in manifest.stages] == ["1.0", "1.0"]
    assert manifest.versions["jax"] == "0.10.2"


def test_golden_manifests_describe_the_same_model() -> None:
    """Each format version reads to the same stages: the same signatures, weights, state and
    buckets (the artifacts differ only by the jax that wrote them)."""
    def shape_of(m: Manifest) -> list[tuple[object, ...]]:
        return [(s.spec.inputs, s.spec.outputs, s.spec.weights, s.spec.state, s.spec.buckets,
                 s.spec.stage_index, s.spec.num_stages, s.spec.device) for s in m.stages]
    first, *later = (_open_golden(GOLDENS[v]) for v in sorted(GOLDENS))
    for m in later:
        assert shape_of(m) == shape_of(first)


def test_golden_runs_in_process(golden_version: int, tmp_path: pathlib.Path) -> None:
    root = GOLDENS[golden_version]
    manifest = _open_golden(root)
    golden.write_weights(tmp_path)
    reg = LocalRegistry(root, create=False)
    cache = WeightCache([str(tmp_path)])
    stages = [WorkerStage.load(spec.replace(device="cpu", stage_id=f"golden/{k}"),
                               artifact=reg.get(spec.artifact_digest), cache=cache)
              for k, spec in enumerate(manifest.stage_specs())]
    states = [s.init_state() for s in stages]
    outs = []
    for x in _inputs():
        carry: Any = {"x": x}
        for k, stage in enumerate(stages):
            carry, states[k] = stage.run(carry, states[k])
        outs.append({k: np.asarray(v) for k, v in carry.items()})
    cache.close()
    _assert_matches(outs)


def test_golden_runs_on_workers(golden_version: int, cluster3: Cluster,
                                mlp_root: pathlib.Path) -> None:
    root = GOLDENS[golden_version]
    golden.write_weights(mlp_root)  # the shared workers' weights root
    with cluster3.deploy_manifest(_open_golden(root), registry=str(root)) as pipe:
        with pipe.session() as session:
            outs = [session(x=x) for x in _inputs()]
    _assert_matches(outs)


# --- the compatibility window


def _patched(data: bytes, *, calling_convention: int | None = None,
             stablehlo: str | None = None) -> bytes:
    """The artifact with a version field rewritten in place (what a far older or newer jax
    would have written there)."""
    buf = bytearray(data)
    if calling_convention is not None:
        table = ser_flatbuf.Exported.GetRootAs(buf, 0)._tab
        field = table.Offset(32)  # Exported.calling_convention_version
        assert field, "jax wrote no calling_convention_version field"
        struct.pack_into("<H", buf, table.Pos + field, calling_convention)
    if stablehlo is not None:
        old = f"StableHLO_v{_golden_stablehlo()}".encode()
        new = f"StableHLO_v{stablehlo}".encode()
        assert len(old) == len(new) and buf.count(old) == 1
        buf = bytearray(bytes(buf).replace(old, new))
    return bytes(buf)


def _golden_stablehlo() -> str:
    (path,) = (GOLDEN / "manifests").glob("*.json")
    return Manifest.from_json(path.read_bytes()).versions["stablehlo"]


def _artifact(manifest: Manifest) -> bytes:
    return LocalRegistry(GOLDEN, create=False).get(manifest.digests[0])


LOCAL = f"local jax {jax.__version__} / jaxlib {jaxlib.__version__}"


@pytest.mark.parametrize("version", [jexport.minimum_supported_calling_convention_version - 1,
                                     jexport.maximum_supported_calling_convention_version + 1])
def test_error_calling_convention_outside_window(manifest: Manifest, version: int) -> None:
    with pytest.raises(ArtifactError) as info:
        load_artifact(_patched(_artifact(manifest), calling_convention=version))
    lo = jexport.minimum_supported_calling_convention_version
    hi = jexport.maximum_supported_calling_convention_version
    assert str(info.value).startswith(
        f"artifact calling convention version {version} is not supported: {LOCAL} supports "
        f"{lo}..{hi}")


def test_error_stablehlo_outside_window(manifest: Manifest) -> None:
    future = "9" + _golden_stablehlo()[1:]  # same length, major version 9
    with pytest.raises(ArtifactError) as info:
        load_artifact(_patched(_artifact(manifest), stablehlo=future))
    assert str(info.value).startswith(
        f"artifact StableHLO version {future} is outside the window "
        f"{hlo.get_minimum_version()}..{hlo.get_current_version()} that {LOCAL} can read")


def test_error_worker_refuses_artifact_outside_window(manifest: Manifest, cluster3: Cluster,
                                                      tmp_path: pathlib.Path) -> None:
    bad = _patched(_artifact(manifest),
                   calling_convention=jexport.maximum_supported_calling_convention_version + 1)
    reg = LocalRegistry(tmp_path)
    digest = reg.put(bad)
    golden = LocalRegistry(GOLDEN, create=False)
    for stage in manifest.stages[1:]:  # the registry holds every stage's artifact: the workers
        reg.put(golden.get(stage.digest))  # may not have them yet (any test order)
    first = manifest.stages[0]
    stages = (dataclasses.replace(first, spec=first.spec.replace(artifact_digest=digest)),
              *manifest.stages[1:])
    with pytest.raises(ArtifactError) as info:
        cluster3.deploy_manifest(dataclasses.replace(manifest, stages=stages), registry=reg)
    msg = str(info.value)
    assert "LoadStage (stage 0)" in msg and "calling convention version" in msg
    assert LOCAL in msg  # the worker's versions ...
    v = first.spec.versions  # ... and the exporter's
    assert f"[stage 0 was exported with jax {v.jax}, jaxlib {v.jaxlib}, StableHLO " \
           f"{v.stablehlo}]" in msg
