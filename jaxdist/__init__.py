"""jaxdist: build the worker once, run any model."""

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

__version__ = "0.1.0"
