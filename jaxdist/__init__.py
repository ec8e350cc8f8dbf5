"""jaxdist: build the worker once, run any model.

The public API. Everything here is stable within a minor version; anything else is internal.

Names resolve lazily (PEP 562): ``import jaxdist`` loads nothing of either side, so a worker
process that imports ``jaxdist.worker`` never loads the coordinator, and an offline export never
loads gRPC through this namespace. ``from jaxdist import Cluster`` imports the coordinator then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(["JaxdistError", "SpecError", "CodecError", "WeightError", "DeviceError",
                     "ArtifactError", "TransportError", "SessionError", "LimitError",
                     "AuthError", "PipelineKeyError", "RemoteStageError"],
                    "jaxdist.core.errors"),
    **dict.fromkeys(["WeightCache", "WeightInfo", "resolve_weight", "resolve_weight_bytes",
                     "describe_weights"], "jaxdist.core.weights"),
    **dict.fromkeys(["DeviceDirective", "parse_directive", "resolve_device"], "jaxdist.core.devices"),
    **dict.fromkeys(["SPEC_VERSION", "StageSpec", "TensorSig", "StateSig", "WeightRef"],
                    "jaxdist.core.spec"),
    **dict.fromkeys(["Artifact", "export_stage", "load_artifact"], "jaxdist.core.artifacts"),
    "LocalRegistry": "jaxdist.registry.local",
    "WorkerStage": "jaxdist.core.stage",
    **dict.fromkeys(["Model", "Param", "Unit"], "jaxdist.export.model"),
    **dict.fromkeys(["Pipeline", "Session"], "jaxdist.coordinator.pipeline"),
    "Cluster": "jaxdist.coordinator.cluster",
    "Engine": "jaxdist.coordinator.engine",
    "LLM": "jaxdist.coordinator.llm",
    **dict.fromkeys(["SamplingParams", "GenerationResult"], "jaxdist.coordinator.request"),
    "InProcessPipeline": "jaxdist.coordinator.inprocess",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see (the names are in __all__)
    # ruff: noqa: F401
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.engine import Engine
    from jaxdist.coordinator.inprocess import InProcessPipeline
    from jaxdist.coordinator.llm import LLM
    from jaxdist.coordinator.request import GenerationResult, SamplingParams
    from jaxdist.coordinator.pipeline import Pipeline, Session
    from jaxdist.core.artifacts import Artifact, export_stage, load_artifact
    from jaxdist.core.devices import DeviceDirective, parse_directive, resolve_device
    from jaxdist.core.errors import (
        ArtifactError,
        AuthError,
        CodecError,
        DeviceError,
        JaxdistError,
        LimitError,
        PipelineKeyError,
        RemoteStageError,
        SessionError,
        SpecError,
        TransportError,
        WeightError,
    )
    from jaxdist.core.spec import SPEC_VERSION, StageSpec, StateSig, TensorSig, WeightRef
    from jaxdist.core.stage import WorkerStage
    from jaxdist.core.weights import (
        WeightCache,
        WeightInfo,
        describe_weights,
        resolve_weight,
        resolve_weight_bytes,
    )
    from jaxdist.export.model import Model, Param, Unit
    from jaxdist.registry.local import LocalRegistry
