"""jaxdist: build the worker once, run any model.

The public API. Everything here is stable within a minor version; anything else is internal.
"""

from jaxdist.errors import (
    ArtifactError,
    AuthError,
    CodecError,
    DeviceError,
    JaxdistError,
    LimitError,
    RemoteStageError,
    SessionError,
    SpecError,
    TransportError,
    WeightError,
)
from jaxdist.weights import (
    WeightCache,
    WeightInfo,
    describe_weights,
    resolve_weight,
    resolve_weight_bytes,
)
from jaxdist.devices import DeviceDirective, parse_directive, resolve_device
from jaxdist.spec import SPEC_VERSION, StageSpec, StateSig, TensorSig, WeightRef
from jaxdist.artifacts import Artifact, export_stage, load_artifact
from jaxdist.registry import LocalRegistry
from jaxdist.stage import WorkerStage
from jaxdist.model import Model, Param, Unit
from jaxdist.pipeline import Pipeline, Session
from jaxdist.coordinator import Cluster
from jaxdist.inprocess import InProcessPipeline

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # errors
    "JaxdistError", "SpecError", "CodecError", "WeightError", "DeviceError", "ArtifactError",
    "TransportError", "SessionError", "LimitError", "AuthError", "RemoteStageError",
    # weights
    "WeightCache", "WeightInfo", "resolve_weight", "resolve_weight_bytes", "describe_weights",
    # devices
    "DeviceDirective", "parse_directive", "resolve_device",
    # specs and artifacts
    "SPEC_VERSION", "StageSpec", "TensorSig", "StateSig", "WeightRef",
    "Artifact", "export_stage", "load_artifact", "LocalRegistry",
    # running
    "WorkerStage", "Model", "Unit", "Param", "Cluster", "Pipeline", "Session",
    "InProcessPipeline",
]
