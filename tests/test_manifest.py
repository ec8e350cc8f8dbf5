"""Tests for jaxdist.registry.manifest: the format, the {model} placeholder, finding a manifest."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jaxlib
import pytest
from google.protobuf import json_format
from models import mlp

import jaxdist
from jaxdist.core.errors import ArtifactError, SpecError
from jaxdist.core.spec import SPEC_VERSION, ShapeBucket, StageSpec, StateSig, TensorSig, WeightRef
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.registry.manifest import (
    MANIFEST_VERSION,
    PLACEMENT_FIELDS,
    SUPPORTED_MANIFEST_VERSIONS,
    Manifest,
    ManifestStage,
    ModelInfo,
    _spec_from_json,
    _spec_to_json,
    open_manifest,
    relative_uri,
    resolve_uri,
)
from jaxdist.registry.publish import Published, publish

DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    return publish(mlp(), tmp_path_factory.mktemp("reg"), stages=2, platforms=("cpu",),
                   model_path="mlp.safetensors")


def _full_spec() -> StageSpec:
    """A spec with every field away from its default."""
    return StageSpec(
        artifact_digest=DIGEST, inputs=(TensorSig("x", "float32", ("b", 8)),
                                        TensorSig("pos", "int32", ("b",))),
        outputs=(TensorSig("y", "bfloat16", ("b", 8)),),
        weights=(WeightRef("w", "gguf://{model}#blk.0.w", (8, 8), "uint8", "cd" * 32, True,
                           True, "Q8_0"),),
        state=(StateSig("k", "float32", (2, 8)),), device="cuda:1", stage_index=1,
        num_stages=3, next_hop="h:1", buckets=(ShapeBucket({"b": 4}),),
        platforms=("cpu", "cuda"), model="m", stage_id="p/1", artifact=b"bytes",
        control=("pos",), any_shape=True)


def test_every_spec_field_but_placement_is_written() -> None:
    spec = _full_spec()
    back = _spec_from_json(json.loads(json.dumps(_spec_to_json(spec))))
    placement = {f: getattr(StageSpec(DIGEST, (), ()), f) for f in PLACEMENT_FIELDS}
    assert back == spec.replace(**placement)
    # A new StageSpec field must be written by the manifest or declared placement.
    written = set(_spec_to_json(spec)) | PLACEMENT_FIELDS
    assert {f.name for f in dataclasses.fields(StageSpec)} == written
    # The manifest's spec is the protobuf's own JSON: the wire schema parses it unchanged.
    msg = json_format.ParseDict(_spec_to_json(spec), pb.StageSpec())
    assert StageSpec.from_proto(msg).replace(device="auto") == back


def test_round_trip_is_byte_identical(published: Published) -> None:
    data = pathlib.Path(published.location).read_bytes()
    manifest = Manifest.from_json(data)
    assert manifest == published.manifest
    assert manifest.to_json() == data
    assert manifest.digest == published.digest


def test_contents(published: Published) -> None:
    m = published.manifest
    doc = json.loads(pathlib.Path(published.location).read_text())
    assert doc["manifest_version"] == MANIFEST_VERSION
    assert doc["versions"] == {
        "jaxdist": jaxdist.__version__, "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "stablehlo": m.stages[0].spec.versions.stablehlo,
        "serialization_version": m.stages[0].spec.versions.serialization_version,
        "calling_convention_version": m.stages[0].spec.versions.calling_convention_version,
        "spec": SPEC_VERSION}
    assert doc["model"]["name"] == "mlp" and doc["model"]["path"] == "mlp.safetensors"
    assert [s["units"] for s in doc["stages"]] == [["l0", "l1"], ["l2", "l3"]]
    assert doc["weights"] == [f"safetensors://{{model}}#l{i}.w" for i in range(4)]
    for k, stage in enumerate(doc["stages"]):
        assert stage["artifact_digest"] == stage["spec"]["artifact_digest"] == m.digests[k]
        assert stage["artifact_size"] == len(published.registry.get(m.digests[k]))
        assert not PLACEMENT_FIELDS & set(stage["spec"])  # no device, next hop, id or bytes
        assert stage["spec"]["platforms"] == ["cpu"]


def test_placeholder_uris() -> None:
    assert relative_uri("gguf://m.gguf#tok", "m.gguf") == "gguf://{model}#tok"
    assert relative_uri("safetensors://d/model.safetensors#w", "d") == (
        "safetensors://{model}/model.safetensors#w")
    assert relative_uri("gguf:///abs/m.gguf#t", "/abs/m.gguf") == "gguf://{model}#t"
    assert relative_uri("gguf://other.gguf#t", "m.gguf") == "gguf://other.gguf#t"
    assert relative_uri("gguf://m.gguf2#t", "m.gguf") == "gguf://m.gguf2#t"  # not a prefix match
    assert resolve_uri("gguf://{model}#t", "/srv/x.gguf") == "gguf:///srv/x.gguf#t"
    assert resolve_uri("safetensors://{model}/a#w", "m/") == "safetensors://m/a#w"
    assert resolve_uri("file://w.bin", "m") == "file://w.bin"


def test_stage_specs_resolve_model_path(published: Published) -> None:
    specs = published.manifest.stage_specs("moved/elsewhere.safetensors")
    assert specs[1].weights[0].uri == "safetensors://moved/elsewhere.safetensors#l2.w"
    assert published.manifest.stage_specs()[0].weights[0].uri == (
        "safetensors://mlp.safetensors#l0.w")
    assert all(s.device == "auto" and not s.next_hop and not s.stage_id for s in specs)


def test_open_manifest_by_path_name_and_digest(published: Published) -> None:
    root = pathlib.Path(published.registry.location)
    m, digest, store = open_manifest(published.location)
    assert digest == published.digest and pathlib.Path(store.location) == root  # inferred
    for ref in ("mlp", published.digest, published.digest[7:19]):
        m2, d2, _ = open_manifest(ref, str(root))
        assert d2 == published.digest and m2 == m


@pytest.mark.parametrize("version", [1, MANIFEST_VERSION + 1])
def test_error_unsupported_manifest_version(published: Published, version: int) -> None:
    """A later version, and version 1 (never released: jaxdist's own dict form of a spec)."""
    doc = published.manifest.to_dict() | {"manifest_version": version}
    with pytest.raises(SpecError) as info:
        Manifest.from_dict(doc, source="m.json")
    msg = str(info.value)
    assert f"m.json: manifest_version {version} is not supported" in msg
    assert f"reads manifest versions {list(SUPPORTED_MANIFEST_VERSIONS)}" in msg


def test_error_malformed_field_is_named(published: Published) -> None:
    doc = published.manifest.to_dict()
    doc["stages"][1]["spec"]["weights"][0]["uri"] = "ftp://{model}#l2.w"
    with pytest.raises(SpecError, match=r"m\.json: stages\[1\]: StageSpec\.weights\[0\]\.uri: "
                                        r"weight URI 'ftp://model#l2\.w'"):
        Manifest.from_dict(doc, source="m.json")
    # Proto3 JSON leaves an empty list out, so no inputs is a spec with none: refused, naming
    # the output dim that then has no symbol to bind.
    doc = published.manifest.to_dict()
    del doc["stages"][0]["spec"]["inputs"]
    with pytest.raises(SpecError, match=r"m\.json: stages\[0\]: StageSpec\.outputs\[0\]\.dims"
                                        r"\[0\]: 'b' uses \['b'\], which no input binds"):
        Manifest.from_dict(doc, source="m.json")
    doc = published.manifest.to_dict()
    doc["stages"][0]["spec"]["stage_index"] = "first"
    with pytest.raises(SpecError, match=r"m\.json: stages\[0\]: spec is not a StageSpec: .*"
                                        r"stage_index"):
        Manifest.from_dict(doc, source="m.json")
    doc = published.manifest.to_dict()
    del doc["stages"][0]["spec"]
    with pytest.raises(SpecError, match=r"m\.json: stages\[0\] is malformed: missing key "
                                        r"'spec'"):
        Manifest.from_dict(doc, source="m.json")


def test_error_not_json() -> None:
    with pytest.raises(SpecError, match="x.json: not a JSON manifest"):
        Manifest.from_json(b"{nope", source="x.json")


def test_error_model_path_for_fixed_uris() -> None:
    spec = StageSpec(DIGEST, (TensorSig("x", "float32", (2,)),),
                     (TensorSig("x", "float32", (2,)),),
                     weights=(WeightRef("w", "file://w.bin", (2,), "float32"),))
    manifest = Manifest(ModelInfo("fixed"), (ManifestStage(spec),))
    assert manifest.stage_specs()[0].weights[0].uri == "file://w.bin"
    with pytest.raises(SpecError, match=r"names its weights by fixed paths \(no \{model\}"):
        manifest.stage_specs("elsewhere")


def test_error_corrupt_stored_manifest(published: Published, tmp_path: pathlib.Path) -> None:
    path = pathlib.Path(published.location)
    copy = tmp_path / "manifests" / path.name
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes().replace(b'"mlp"', b'"mlq"', 1))
    with pytest.raises(ArtifactError, match=f"manifest {copy} is corrupt: its name says "
                                            f"{published.digest}"):
        open_manifest(str(copy))


def test_error_manifest_not_found(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SpecError, match="manifest 'nope': no such file"):
        open_manifest("nope")
    with pytest.raises(ArtifactError, match=r"no manifest 'nope' in registry .*jaxdist registry "
                                            r"ls"):
        open_manifest("nope", str(tmp_path))
