"""Tests for jaxdist.registry.publish: export into a registry, and what garbage collection may delete."""

from __future__ import annotations

import os
import pathlib

import pytest
from deploy_utils import serve_directory, write_tiny_llama
from models import mlp

from jaxdist.core.artifacts import ArtifactMeta, load_artifact
from jaxdist.core.errors import ArtifactError, SpecError
from jaxdist.export.plugins import load_model
from jaxdist.registry.local import LocalRegistry
from jaxdist.registry.publish import publish, unreferenced


def test_publish_stores_artifacts_meta_and_manifest(tmp_path: pathlib.Path) -> None:
    pub = publish(mlp(), tmp_path / "reg", split=[1, 3], platforms=("cpu",),
                  model_path="mlp.safetensors")
    reg = LocalRegistry(tmp_path / "reg")
    assert [e.digest for e in reg.list_manifests()] == [pub.digest]
    assert sorted(pub.manifest.digests) == [e.digest for e in reg.list()]
    for stage in pub.manifest.stages:
        data = reg.get(stage.digest)
        assert load_artifact(data, expected_digest=stage.digest).platforms == ("cpu",)
        meta = ArtifactMeta.from_dict(reg.meta(stage.digest))
        assert [t.name for t in meta.params] == [w.param for w in stage.spec.weights]
    assert [list(s.units) for s in pub.manifest.stages] == [["l0"], ["l1", "l2", "l3"]]
    # Same model, same jax: same artifacts, same digests (only the manifest's date differs).
    again = publish(mlp(), reg, split=[1, 3], platforms=("cpu",), model_path="mlp.safetensors")
    assert again.manifest.digests == pub.manifest.digests


def test_publish_loaded_model_records_options(tmp_path: pathlib.Path) -> None:
    write_tiny_llama(tmp_path / "models" / "tiny")
    options = {"max_seq": 16, "max_slots": 1, "prefill_buckets": (8,)}
    loaded = load_model("tiny", roots=[str(tmp_path / "models")], **options)
    pub = publish(loaded, tmp_path / "reg", stages=2, platforms=("cpu",), model_path="tiny",
                  export_options=options)
    m = pub.manifest.model
    assert (m.name, m.architecture, m.kind, m.path) == ("tiny", "llama", "causal-lm", "tiny")
    assert m.options == {"max_slots": 1, "max_seq": 16, "prefill_buckets": [8], "bos_id": None,
                         "eos_ids": []}
    assert m.export_options == {"max_seq": 16, "max_slots": 1, "prefill_buckets": [8]}
    assert m.inputs["tokens"] == ("b, s", "int32")
    uris = pub.manifest.weight_uris
    assert uris[0] == "safetensors://{model}#model.embed_tokens.weight"
    assert all(u.startswith("safetensors://{model}#") for u in uris)


def test_unreferenced(tmp_path: pathlib.Path) -> None:
    reg = LocalRegistry(tmp_path)
    pub = publish(mlp(), reg, stages=2, platforms=("cpu",), model_path="mlp.safetensors")
    stray = reg.put(b"an orphan from a failed export")
    garbage, young = unreferenced(reg)
    assert [a.digest for a in garbage] == [stray] and young == []
    garbage, young = unreferenced(reg, min_age=3600)  # just written: kept
    assert garbage == [] and [a.digest for a in young] == [stray]
    reg.delete_manifest(pub.digest)
    assert sorted(a.digest for a in unreferenced(reg)[0]) == sorted([stray, *pub.manifest.digests])


def test_error_gc_with_unreadable_manifest(tmp_path: pathlib.Path) -> None:
    reg = LocalRegistry(tmp_path)
    entry = reg.put_manifest(b"not json", "broken")
    with pytest.raises(SpecError, match=rf"cannot collect garbage: .*{entry.location}.*not a "
                                        r"JSON manifest"):
        unreferenced(reg)


def test_error_publish_to_http_registry(tmp_path: pathlib.Path) -> None:
    LocalRegistry(tmp_path / "reg")
    with serve_directory(tmp_path) as base:
        with pytest.raises(ArtifactError, match=rf"registry {base}/reg is read-only"):
            publish(mlp(), f"{base}/reg", platforms=("cpu",))
    assert not os.listdir(tmp_path / "reg" / "sha256")
