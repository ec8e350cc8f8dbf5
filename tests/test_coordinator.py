"""Tests for Cluster.deploy_manifest / attach: deploying exported models on real workers,
digest first and without tracing."""

from __future__ import annotations

import pathlib
import shutil
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from deploy_utils import serve_directory
from models import mlp, mlp_reference

import jaxdist.coordinator.cluster
import jaxdist.core.artifacts
from jaxdist.coordinator.cluster import Cluster
from jaxdist.core.errors import ArtifactError, PipelineKeyError, SpecError, WeightError
from jaxdist.core.transport.client import WorkerClient
from jaxdist.registry.local import LocalRegistry
from jaxdist.registry.manifest import open_manifest
from jaxdist.registry.publish import Published, publish


@pytest.fixture(scope="module")
def worker_root(tmp_path_factory: pytest.TempPathFactory, mlp_root: pathlib.Path
                ) -> pathlib.Path:
    """The workers' weights root: the MLP at its exported path and, renamed, somewhere else."""
    root = tmp_path_factory.mktemp("worker_root")
    shutil.copy(mlp_root / "mlp.safetensors", root / "mlp.safetensors")
    (root / "store").mkdir()
    shutil.copy(mlp_root / "mlp.safetensors", root / "store" / "renamed.safetensors")
    return root


@pytest.fixture(scope="module")
def cluster(worker_root: pathlib.Path) -> Iterator[Cluster]:
    with Cluster.local(2, weights_roots=[str(worker_root)], max_sessions=8) as c:
        yield c


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("registry")


def _publish(registry: pathlib.Path, split: list[int]) -> Published:
    """The MLP exported as ``split``: a stage's artifact depends only on its units, so two
    splits that share a stage's units share its artifact."""
    return publish(mlp(), registry, split=split, platforms=("cpu",), model_path="mlp.safetensors")


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Digests uploaded to workers during the test."""
    seen: list[str] = []
    original = WorkerClient.start_upload_artifact  # upload_artifact calls it too

    def counting(self: WorkerClient, digest: str, data: bytes, timeout: float = 300.0):
        seen.append(digest)
        return original(self, digest, data, timeout)

    monkeypatch.setattr(WorkerClient, "start_upload_artifact", counting)
    return seen


def _check(pipe: jaxdist.coordinator.cluster.Pipeline, root: pathlib.Path) -> None:
    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    np.testing.assert_allclose(pipe.call(x=x)["x"], mlp_reference(root, x), rtol=1e-5, atol=1e-5)


def test_deploy_manifest_never_traces(cluster: Cluster, registry: pathlib.Path,
                                      worker_root: pathlib.Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pub = _publish(registry, [2, 2])

    def traced(*args: object, **kwargs: object) -> None:
        raise AssertionError("the manifest deploy path traced or exported a stage")

    monkeypatch.setattr(jax.export, "export", traced)
    monkeypatch.setattr(jaxdist.core.artifacts, "export_stage", traced)
    monkeypatch.setattr(jaxdist.coordinator.cluster, "build_stage_specs", traced)
    pipe = cluster.deploy_manifest(pub.location)  # registry found beside the manifest
    try:
        assert [s.artifact_digest for s in pipe.specs] == pub.manifest.digests
        _check(pipe, worker_root)
    finally:
        pipe.close()


def test_digest_first(cluster: Cluster, registry: pathlib.Path, worker_root: pathlib.Path,
                      uploads: list[str]) -> None:
    pub = _publish(registry, [3, 1])
    digests = pub.manifest.digests
    # Stage k goes to worker k. Stage 1 (l3 alone) is also the last stage of another test's
    # split, so a worker may hold it already, depending on the order the tests ran in.
    lacking = [not c.has_artifact(d) for c, d in zip(cluster.clients, digests, strict=True)]
    assert lacking[0], "stage 0 (l0..l2) is in no other test's split"
    first = cluster.deploy_manifest(pub.manifest, registry=str(registry))
    assert sorted(uploads) == sorted(d for d, miss in zip(digests, lacking) if miss)
    assert [x.uploaded for x in cluster.stage_loads(first.pipeline_id)] == lacking
    first.close()
    uploads.clear()
    second = cluster.deploy(pub.manifest, registry=LocalRegistry(registry))  # Manifest object
    assert uploads == []
    assert [x.uploaded for x in cluster.stage_loads(second.pipeline_id)] == [False, False]
    _check(second, worker_root)
    second.close()


def test_model_path_moves_the_model(cluster: Cluster, registry: pathlib.Path,
                                    worker_root: pathlib.Path) -> None:
    pub = _publish(registry, [2, 2])
    with cluster.deploy_manifest(pub.manifest, registry=str(registry),
                                 model_path="store/renamed.safetensors") as pipe:
        assert pipe.specs[0].weights[0].uri == "safetensors://store/renamed.safetensors#l0.w"
        _check(pipe, worker_root)


def test_deploy_from_http_registry(cluster: Cluster, registry: pathlib.Path,
                                   worker_root: pathlib.Path, uploads: list[str]) -> None:
    pub = _publish(registry, [1, 2, 1])  # three stages on two workers
    lacking = {d for d in pub.manifest.digests if not cluster.clients[0].has_artifact(d)}
    assert lacking  # the workers share one artifact cache
    with serve_directory(registry.parent) as base:
        url = f"{base}/{registry.name}/manifests/{pathlib.Path(pub.location).name}"
        with cluster.deploy_manifest(url) as pipe:  # registry inferred from the URL
            assert set(uploads) == lacking
            assert [c.address for c in pipe.clients] == [*cluster.addresses, cluster.addresses[0]]
            _check(pipe, worker_root)


def test_attach(cluster: Cluster, registry: pathlib.Path, worker_root: pathlib.Path) -> None:
    pub = _publish(registry, [2, 2])
    pipe = cluster.deploy_manifest(pub.manifest, registry=str(registry), pin=True)  # shared
    private = cluster.deploy_manifest(pub.manifest, registry=str(registry))
    try:
        with Cluster.connect(cluster.addresses) as other:
            # A pipeline loaded for one run has a key: another coordinator cannot attach to it.
            with pytest.raises(PipelineKeyError, match=rf"Subscribe: pipeline "
                                                       rf"'{private.pipeline_id}' on worker "
                                                       r".* was loaded by another coordinator"):
                other.attach(private.pipeline_id, pub.manifest)
            _check(private, worker_root)  # and it still serves its own
            attached = other.attach(pipe.pipeline_id, pub.manifest)
            assert [c.address for c in attached.clients] == [c.address for c in pipe.clients]
            _check(attached, worker_root)
            wrong = open_manifest(_publish(registry, [1, 3]).location)[0]
            with pytest.raises(SpecError, match=rf"pipeline '{pipe.pipeline_id}' stage 0 runs "
                                                r"sha256:.*the manifest says"):
                other.attach(pipe.pipeline_id, wrong)
            with pytest.raises(SpecError, match="pipeline 'nope' is not loaded on any of"):
                other.attach("nope")
    finally:
        pipe.close()
        private.close()


def test_error_artifact_missing_from_registry(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    pub = _publish(tmp_path, [4])
    LocalRegistry(tmp_path).delete(pub.manifest.digests[0])
    with pytest.raises(ArtifactError, match=rf"artifact {pub.manifest.digests[0]} not in "
                                            rf"registry at {tmp_path}"):
        cluster.deploy_manifest(pub.location)
    with pytest.raises(ArtifactError, match=rf"artifact {pub.manifest.digests[0]} is not on the "
                                            r"worker, and no registry was given"):
        cluster.deploy_manifest(pub.manifest)


def test_error_wrong_model_path(cluster: Cluster, registry: pathlib.Path) -> None:
    pub = _publish(registry, [2, 2])
    # Both stages fail; the first to fail is raised, and the other's load is cancelled.
    with pytest.raises(WeightError, match=r"worker 127\.0\.0\.1:\d+: LoadStage \(stage [01]\): .*"
                                          r"nowhere\.safetensors"):
        cluster.deploy_manifest(pub.manifest, registry=str(registry),
                                model_path="nowhere.safetensors")
