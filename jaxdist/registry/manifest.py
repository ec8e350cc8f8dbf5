"""The manifest: an exported model in a registry, described well enough to deploy it untraced.

``jaxdist export`` (:func:`jaxdist.registry.publish.publish`) traces and exports every stage once, stores
each artifact content-addressed in a registry, and writes a manifest: a JSON document that names
the model, its stages, their artifact digests and full StageSpecs, and the weight URIs. A
StageSpec is written as the ``jaxdist.v1.StageSpec`` protobuf message in proto3 JSON
(``google.protobuf.json_format``): the proto is the one schema of a stage, on the wire and here.
:meth:`jaxdist.coordinator.cluster.Cluster.deploy_manifest` deploys from it with no tracing at all.

What a manifest holds, and what it does not
-------------------------------------------
Everything a StageSpec says about *what* runs (inputs, outputs, state, weights, buckets,
platforms, versions) is in the manifest. *Where* it runs is placement, decided at deploy time,
and is left out: the device directive, the next hop and the stage id. Artifact bytes are never
inlined; the registry holds them under their digest.

Weight URIs are written relative to the model's location through the placeholder ``{model}``:
``gguf://{model}#blk.0.attn_q.weight``, ``safetensors://{model}/model.safetensors#...``. A deploy
substitutes the path the workers hold the model at (``model_path``, by default the path it had
at export), so one manifest serves workers that keep the model anywhere under their weight
roots.

Example:
    >>> manifest = Manifest.from_json(pathlib.Path("m.json").read_bytes())  # doctest: +SKIP
    >>> specs = manifest.stage_specs(model_path="models/SmolLM2.gguf")      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from jaxdist.core.errors import ArtifactError, JaxdistError, SpecError
from jaxdist.core.spec import StageSpec, validate
from jaxdist.core.vetting import digest_of
from jaxdist.core.weights.uri import relocate_uri
from jaxdist.proto import jaxdist_pb2 as pb

__all__ = [
    "MANIFEST_VERSION",
    "MODEL_PLACEHOLDER",
    "Manifest",
    "ManifestStage",
    "ModelInfo",
    "open_manifest",
    "relative_uri",
    "resolve_uri",
]

log = logging.getLogger(__name__)

# Manifest format version, an integer.
# Bump rules:
#   - No bump: a new optional key that old readers may ignore without deploying anything
#     differently (informational fields, a new key inside "model.options"). Readers ignore
#     keys they do not know.
#   - Bump: anything an old reader would misread: a renamed, removed or re-typed key, a new key
#     that changes what is deployed, a change to the placeholder syntax or to how a StageSpec is
#     written (a new StageSpec field that matters to a worker counts). Readers refuse versions
#     they do not know (SUPPORTED_MANIFEST_VERSIONS), naming both.
# Changelog:
#   2: the first release. A stage's "spec" is the StageSpec protobuf message in proto3 JSON
#     (google.protobuf.json_format); keys are sorted. (Version 1, jaxdist's own dict form of a
#     spec, was never released; it is refused, not read.)
MANIFEST_VERSION = 2
SUPPORTED_MANIFEST_VERSIONS = (2,)

MODEL_PLACEHOLDER = "{model}"
"""Stands for the model's location in weight URIs (``gguf://{model}#tok_embd.weight``)."""

# StageSpec fields a manifest leaves out: placement is decided at deploy time, bytes live in the
# registry. tests/test_manifest.py checks that every other field is written.
PLACEMENT_FIELDS = frozenset({"device", "next_hop", "next_data_hop", "stage_id", "artifact"})


# ---------------------------------------------------------------------------------------------
# Weight URIs relative to the model


def relative_uri(uri: str, model_path: str) -> str:
    """Write ``uri`` relative to the model: its path prefix ``model_path`` becomes ``{model}``.

    A URI outside the model (another file) is returned unchanged.

    Example:
        >>> relative_uri("gguf://m.gguf#tok_embd.weight", "m.gguf")
        'gguf://{model}#tok_embd.weight'
    """
    return relocate_uri(uri, model_path, MODEL_PLACEHOLDER)


def resolve_uri(uri: str, model_path: str) -> str:
    """Substitute the model's location for ``{model}`` in ``uri`` (inverse of relative_uri).

    Example:
        >>> resolve_uri("gguf://{model}#tok_embd.weight", "/srv/m.gguf")
        'gguf:///srv/m.gguf#tok_embd.weight'
    """
    return relocate_uri(uri, MODEL_PLACEHOLDER, model_path)


# ---------------------------------------------------------------------------------------------
# StageSpec <-> JSON: the protobuf message is the one schema


def _spec_to_json(spec: StageSpec) -> dict[str, Any]:
    """The spec as proto3 JSON (``google.protobuf.json_format``), placement fields cleared.

    Proto3 JSON writes 64-bit integers as strings (``"shape": ["576", "64"]``) and leaves
    fields at their default out; :func:`_spec_from_json` reads it back exactly."""
    msg = spec.to_proto()
    for name in PLACEMENT_FIELDS:
        msg.ClearField(name)
    out: dict[str, Any] = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    return out


def _spec_from_json(d: Mapping[str, Any]) -> StageSpec:
    """Inverse of :func:`_spec_to_json`. Fields this jaxdist does not know are ignored (a newer
    MINOR spec version may add some; the spec's own version rules say when that is safe)."""
    try:
        msg = json_format.ParseDict(d, pb.StageSpec(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise SpecError(f"spec is not a StageSpec: {exc}") from None
    return StageSpec.from_proto(msg).replace(device="auto")


# ---------------------------------------------------------------------------------------------
# The manifest


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """The model a manifest was exported from.

    Attributes:
        name: model name (for logs, ``jaxdist status`` and the manifest's file name).
        architecture: as read from the model file (``"llama"``); empty for a hand-built Model.
        kind: ``"causal-lm"``, ``"encoder"``, or empty for a hand-built Model.
        path: the model's location at export; the default substitute for ``{model}``.
        inputs: the model's input signature, name -> ``(dims, dtype)``.
        options: what a caller needs to drive it: ``max_slots``, ``max_seq``,
            ``prefill_buckets``, ``eos_ids`` (causal LMs) or ``max_length``, ``buckets``
            (encoders).
        export_options: the options the exporter was called with (``max_seq``, ``dtype``, ...),
            so the same model can be described again (e.g. for its tokenizer).
        exported_from: absolute path of the model on the exporting machine (informational; a
            local ``jaxdist generate --manifest`` looks for the tokenizer there).
    """

    name: str
    architecture: str = ""
    kind: str = ""
    path: str = ""
    inputs: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    export_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    exported_from: str = ""


@dataclasses.dataclass(frozen=True)
class ManifestStage:
    """One stage: its StageSpec (URIs with ``{model}``, no placement), size and units."""

    spec: StageSpec
    artifact_size: int = 0
    units: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        return self.spec.artifact_digest


@dataclasses.dataclass(frozen=True)
class Manifest:
    """An exported model: see the module docstring.

    Attributes:
        model: what was exported.
        stages: in pipeline order.
        versions: of the exporting tools: ``jaxdist``, ``jax``, ``jaxlib``, ``stablehlo``,
            ``spec``, ``serialization_version``, ``calling_convention_version``.
        platforms: the platforms every artifact was lowered for.
        created: ISO 8601 UTC time of the export.
        manifest_version: the format version (:data:`MANIFEST_VERSION`).
    """

    model: ModelInfo
    stages: tuple[ManifestStage, ...]
    versions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    platforms: tuple[str, ...] = ()
    created: str = ""
    manifest_version: int = MANIFEST_VERSION

    @property
    def digests(self) -> list[str]:
        """The artifact digest of each stage, in order."""
        return [s.digest for s in self.stages]

    @property
    def weight_uris(self) -> list[str]:
        """Every weight URI (with ``{model}``), in stage order, without repeats."""
        return list(dict.fromkeys(w.uri for s in self.stages for w in s.spec.weights))

    @property
    def relative(self) -> bool:
        """Whether any weight URI is written relative to the model (``{model}``)."""
        return any(resolve_uri(u, "x") != u for u in self.weight_uris)

    # -- JSON (matched pair) -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "manifest_version": self.manifest_version,
            "created": self.created,
            "model": {"name": m.name, "architecture": m.architecture, "kind": m.kind,
                      "path": m.path, "exported_from": m.exported_from,
                      "inputs": {k: list(v) for k, v in m.inputs.items()},
                      "options": dict(m.options), "export_options": dict(m.export_options)},
            "versions": dict(self.versions),
            "platforms": list(self.platforms),
            "stages": [{"index": k, "artifact_digest": s.digest, "artifact_size": s.artifact_size,
                        "units": list(s.units), "spec": _spec_to_json(s.spec)}
                       for k, s in enumerate(self.stages)],
            "weights": self.weight_uris,
        }

    def to_json(self) -> bytes:
        """The manifest as UTF-8 JSON; deterministic (keys sorted), so ``digest_of`` names it."""
        try:
            return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()
        except (TypeError, ValueError) as exc:
            raise SpecError(f"manifest of {self.model.name!r}: model options are not "
                            f"JSON-serializable: {exc}") from exc

    @property
    def digest(self) -> str:
        """``sha256:<hex>`` of :meth:`to_json`."""
        return digest_of(self.to_json())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "manifest") -> Manifest:
        """Parse and check a manifest dict (see :meth:`from_json`)."""
        if not isinstance(data, Mapping):
            raise SpecError(f"{source}: expected a JSON object, found {type(data).__name__}")
        version = data.get("manifest_version")
        if version not in SUPPORTED_MANIFEST_VERSIONS:
            raise SpecError(
                f"{source}: manifest_version {version!r} is not supported; this jaxdist reads "
                f"manifest versions {list(SUPPORTED_MANIFEST_VERSIONS)} (writes "
                f"{MANIFEST_VERSION}). Upgrade jaxdist, or export the model again with this one")
        where = "model"
        try:
            m = data["model"]
            model = ModelInfo(
                name=str(m["name"]), architecture=str(m.get("architecture", "")),
                kind=str(m.get("kind", "")), path=str(m.get("path", "")),
                inputs={k: (str(v[0]), str(v[1])) for k, v in m.get("inputs", {}).items()},
                options=dict(m.get("options", {})),
                export_options=dict(m.get("export_options", {})),
                exported_from=str(m.get("exported_from", "")))
            stages = []
            raw_stages = data["stages"]
            if not raw_stages:
                raise SpecError(f"{source}: 'stages' is empty; a manifest needs at least one")
            for k, s in enumerate(raw_stages):
                where = f"stages[{k}]"
                spec = _spec_from_json(s["spec"])
                if spec.artifact_digest != s.get("artifact_digest", spec.artifact_digest):
                    raise SpecError(f"{source}: {where}.artifact_digest "
                                    f"{s['artifact_digest']} differs from its spec's "
                                    f"{spec.artifact_digest}")
                if spec.stage_index != k or spec.num_stages != len(raw_stages):
                    raise SpecError(f"{source}: {where}.spec says stage {spec.stage_index} of "
                                    f"{spec.num_stages}, expected {k} of {len(raw_stages)}")
                # Validate with a stand-in model path: {model} is not a path yet.
                validate(spec.replace(weights=tuple(
                    dataclasses.replace(w, uri=resolve_uri(w.uri, "model")) for w in spec.weights)))
                stages.append(ManifestStage(spec, int(s.get("artifact_size", 0)),
                                            tuple(s.get("units", ()))))
        except SpecError as exc:
            if str(exc).startswith(source):
                raise
            raise SpecError(f"{source}: {where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise SpecError(f"{source}: {where} is malformed: {what}") from None
        return cls(model=model, stages=tuple(stages), versions=dict(data.get("versions", {})),
                   platforms=tuple(data.get("platforms", ())), created=str(data.get("created", "")),
                   manifest_version=int(version))

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "manifest") -> Manifest:
        """Parse manifest JSON.

        Args:
            data: the JSON text.
            source: where it came from, for error messages (a path or URL).

        Raises:
            SpecError: not JSON, an unsupported ``manifest_version``, or a malformed field
                (the message names it, e.g. ``stages[1].spec.weights[3].uri``).
        """
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SpecError(f"{source}: not a JSON manifest: {exc}") from None
        return cls.from_dict(parsed, source=source)

    # -- deploying -----------------------------------------------------------------------------

    def stage_specs(self, model_path: str | None = None) -> list[StageSpec]:
        """The StageSpecs with ``{model}`` resolved, ready to place (no device/next hop yet).

        Args:
            model_path: where the workers hold the model, relative to a weights root or
                absolute; default: the path recorded at export (:attr:`ModelInfo.path`).

        Raises:
            SpecError: ``model_path`` is given but the manifest has no ``{model}`` URIs, or no
                path is known for a manifest that needs one.
        """
        if model_path is not None and not self.relative:
            raise SpecError(
                f"manifest of {self.model.name!r} names its weights by fixed paths (no "
                f"{MODEL_PLACEHOLDER} in its URIs, e.g. {self.weight_uris[:1]}), so a model path "
                f"({model_path!r}) cannot apply; export it with a model path to make it movable")
        path = model_path if model_path is not None else self.model.path
        if self.relative and not path:
            raise SpecError(f"manifest of {self.model.name!r} records no model path; pass "
                            f"model_path (--model-path) naming where the workers hold the model")
        return [s.spec.replace(weights=tuple(dataclasses.replace(w, uri=resolve_uri(w.uri, path))
                                             for w in s.spec.weights))
                for s in self.stages]


def manifest_stage(spec: StageSpec, *, model_path: str | None, artifact_size: int,
                   units: Sequence[str]) -> ManifestStage:
    """A built (unplaced) StageSpec as a manifest stage: URIs made relative to the model."""
    weights = spec.weights
    if model_path:
        weights = tuple(dataclasses.replace(w, uri=relative_uri(w.uri, model_path))
                        for w in weights)
    spec = spec.replace(weights=weights, device="auto", next_hop="", next_data_hop="", stage_id="",
                        artifact=None)
    return ManifestStage(spec, artifact_size, tuple(units))


# ---------------------------------------------------------------------------------------------
# Finding a manifest

_MANIFEST_FILE = re.compile(r"^(?P<name>.+)-(?P<hex>[0-9a-f]{64})\.json$")


def _registry_of(location: str) -> str | None:
    """The registry a manifest at ``location`` lives in (``ROOT/manifests/NAME.json``), if any."""
    head, _, _ = location.rstrip("/").rpartition("/")
    root, sep, last = head.rpartition("/")
    return root if sep and last == "manifests" and root else None


def _check_named_digest(location: str, data: bytes) -> str:
    digest = digest_of(data)
    m = _MANIFEST_FILE.match(location.rpartition("/")[2])
    if m is not None and digest != f"sha256:{m['hex']}":
        raise ArtifactError(f"manifest {location} is corrupt: its name says sha256:{m['hex']}, "
                            f"its {len(data)} bytes hash to {digest}. Fetch or export it again")
    return digest


def open_manifest(ref: str, registry: Any = None) -> tuple[Manifest, str, Any]:
    """Find and read a manifest.

    Args:
        ref: a manifest file path, a URL (``http://host/reg/manifests/NAME-HEX.json``), or, with
            ``registry``, a name or digest (a unique prefix will do) of a manifest stored there.
        registry: an artifact store or a registry location (directory or URL). Default: the
            registry the manifest lives in, when ``ref`` is ``ROOT/manifests/FILE``.

    Returns:
        ``(manifest, digest, store)``; ``store`` is ``None`` when no registry is known.

    Raises:
        SpecError: not found, or malformed.
        ArtifactError: a stored manifest whose bytes do not match the digest in its name.
    """
    from jaxdist.registry.local import open_registry  # registry does not import this module

    store = open_registry(registry) if isinstance(registry, (str, pathlib.Path)) else registry
    if "://" in ref:
        from jaxdist.registry.url import read_url
        data, location = read_url(ref), ref
    elif pathlib.Path(ref).expanduser().is_file():
        path = pathlib.Path(ref).expanduser().resolve()
        data, location = path.read_bytes(), str(path)
    elif store is not None:
        entry = store.find_manifest(ref)
        data, location = store.get_manifest(entry.digest), entry.location
    else:
        raise SpecError(f"manifest {ref!r}: no such file; pass a manifest path or URL, or a "
                        f"registry (--registry) to look the name or digest up in")
    digest = _check_named_digest(location, data)
    if store is None:
        root = _registry_of(location)
        if root is not None:
            try:
                store = open_registry(root)
            except JaxdistError as exc:
                log.warning("manifest %s: cannot open its registry %s: %s", location, root, exc)
    return Manifest.from_json(data, source=f"manifest {location}"), digest, store
