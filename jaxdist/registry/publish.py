"""Export a model into a registry once, so that deploys need no tracing.

:func:`publish` partitions a model, exports every stage (:func:`jaxdist.coordinator.cluster.
build_stage_specs`), stores each artifact content-addressed with its metadata sidecar, and stores
a manifest (:mod:`jaxdist.registry.manifest`) that lists them. ``jaxdist export`` is its command line.
:func:`unreferenced` finds the artifacts no manifest needs (``jaxdist registry gc``).

Example:
    >>> loaded = load_model("SmolLM2.gguf", roots=["/models"], max_seq=512)  # doctest: +SKIP
    >>> pub = publish(loaded, "/srv/reg", stages=2, model_path="SmolLM2.gguf")  # doctest: +SKIP
    >>> with Cluster.connect("h1:50051,h2:50051") as cluster:               # doctest: +SKIP
    ...     pipe = cluster.deploy_manifest(pub.manifest, registry="/srv/reg")
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jaxlib

import jaxdist
from jaxdist.core.errors import ArtifactError, JaxdistError
from jaxdist.core.spec import SPEC_VERSION
from jaxdist.export.model import Model
from jaxdist.export.plugins import LoadedModel
from jaxdist.export.stages import Progress, build_stage_specs, log_progress, plan_stages
from jaxdist.registry.local import ArtifactEntry, ManifestEntry, Registry, open_registry
from jaxdist.registry.manifest import Manifest, ModelInfo, manifest_stage

__all__ = ["Published", "publish", "unreferenced"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Published:
    """What :func:`publish` stored.

    Attributes:
        manifest: the manifest.
        digest: ``sha256:<hex>`` of the manifest file.
        location: path or URL of the stored manifest.
        registry: the registry it was stored in.
        export_seconds: time spent tracing and exporting.
    """

    manifest: Manifest
    digest: str
    location: str
    registry: Registry
    export_seconds: float


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options as JSON-friendly values (tuples -> lists); drops what JSON cannot hold."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        if isinstance(v, (tuple, list, frozenset, set)):
            v = list(v)
        if v is None or isinstance(v, (str, int, float, bool, list, dict)):
            out[k] = v
        else:
            log.debug("option %s=%r is not JSON; left out of the manifest", k, v)
    return out


def publish(model: Model | LoadedModel, registry: Registry | str | os.PathLike[str], *,
            stages: int | None = None, split: Sequence[int] | None = None,
            platforms: Sequence[str] = ("cpu", "cuda", "tpu"), model_path: str | None = None,
            name: str | None = None, export_options: Mapping[str, Any] | None = None,
            exported_from: str = "", progress: Progress | None = None) -> Published:
    """Export every stage of a model into a registry and store its manifest there.

    Args:
        model: a :class:`~jaxdist.export.plugins.LoadedModel` (from ``load_model``: its kind,
            architecture and generation options go into the manifest) or a bare Model.
        registry: a registry object, a directory (created if missing) or a writable URL.
        stages: number of stages (default 1); ``split`` gives unit counts per stage instead.
        platforms: platforms to export for.
        model_path: the model's location as its weight URIs name it (e.g. ``"m.gguf"``). URIs
            under it are written as ``{model}...``, so a deploy can put the model elsewhere.
            ``None`` keeps the URIs as they are.
        name: the manifest's model name (default: the model's, without a ``.gguf`` suffix, as
            ``jaxdist export`` names it).
        export_options: the options the model was described with (recorded for later).
        exported_from: the model's absolute path here (recorded, informational).
        progress: ``progress(what, done, total)`` callback.

    Returns:
        :class:`Published`.

    Raises:
        ArtifactError: the registry is read-only or unreachable.
        SpecError: impossible split; errors of tracing propagate.
    """
    progress = progress or log_progress
    loaded: LoadedModel | None
    if isinstance(model, LoadedModel):
        loaded, bare = model, model.model
    else:
        loaded, bare = None, model
    store = (open_registry(registry, create=True)
             if isinstance(registry, (str, os.PathLike)) else registry)
    if not getattr(store, "writable", True):
        raise ArtifactError(f"registry {store.location} is read-only (HTTP); export into a "
                            f"directory or a writable URL and serve that")
    ranges = plan_stages(bare, stages=stages, split=split)
    t0 = time.perf_counter()
    built = build_stage_specs(bare, ranges, platforms=platforms, progress=progress)
    export_s = time.perf_counter() - t0
    manifest_stages = []
    for k, (b, rng) in enumerate(zip(built, ranges)):
        progress(f"storing stage {k} ({len(b.artifact.data) / 1024:.1f} KB)", k, len(built))
        store.put(b.artifact.data, meta=b.artifact.meta.to_dict())
        manifest_stages.append(manifest_stage(
            b.spec, model_path=model_path, artifact_size=len(b.artifact.data),
            units=[bare.units[i].name for i in rng]))
    meta = built[0].artifact.meta
    manifest = Manifest(
        model=ModelInfo(
            name=name or bare.name.removesuffix(".gguf") or "model",
            architecture=loaded.architecture if loaded is not None else "",
            kind=loaded.kind if loaded is not None else "",
            path=model_path or "",
            inputs={k: (str(v[0]), str(v[1])) for k, v in bare.inputs.items()},
            options=_jsonable(loaded.options) if loaded is not None else {},
            export_options=_jsonable(export_options or {}),
            exported_from=exported_from),
        stages=tuple(manifest_stages),
        versions={"jaxdist": jaxdist.__version__, "jax": jax.__version__,
                  "jaxlib": jaxlib.__version__, "stablehlo": meta.stablehlo_version,
                  "serialization_version": meta.serialization_version,
                  "calling_convention_version": meta.calling_convention_version,
                  "spec": SPEC_VERSION},
        platforms=tuple(meta.platforms),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    entry: ManifestEntry = store.put_manifest(manifest.to_json(), manifest.model.name)
    progress(f"manifest {entry.location}", len(built), len(built))
    log.info("published %s: %d stages, manifest %s", manifest.model.name, len(built),
             entry.digest)
    return Published(manifest, entry.digest, entry.location, store, export_s)


def unreferenced(store: Registry, *, min_age: float = 0.0
                 ) -> tuple[list[ArtifactEntry], list[ArtifactEntry]]:
    """Artifacts that no stored manifest references.

    Args:
        store: the registry.
        min_age: artifacts younger than this (seconds) are kept: an export stores its
            artifacts before its manifest, so a young unreferenced artifact may belong to an
            export still running.

    Returns:
        ``(garbage, kept_young)``.

    Raises:
        SpecError: a stored manifest cannot be read; nothing is collected then, since its
            artifacts cannot be known.
    """
    referenced: set[str] = set()
    for entry in store.list_manifests():
        try:
            data = store.get_manifest(entry.digest)
            referenced.update(Manifest.from_json(data, source=entry.location).digests)
        except JaxdistError as exc:
            raise type(exc)(f"cannot collect garbage: {exc}; fix or delete that manifest "
                            f"first") from None
    now = time.time()
    garbage: list[ArtifactEntry] = []
    young: list[ArtifactEntry] = []
    for a in store.list():
        if a.digest in referenced:
            continue
        (young if a.mtime and now - a.mtime < min_age else garbage).append(a)
    return garbage, young
