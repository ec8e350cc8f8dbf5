"""The jaxdist error hierarchy.

Every error a user can act on derives from :class:`JaxdistError`. Messages follow one rule: say
where (the stage, tensor, URI or field), what was expected, what was found, and how to fix it.
The worker maps each class to one gRPC status code (``jaxdist/core/transport/status.py``); the
coordinator maps status codes back to these classes, so a caller catches the same type locally
and remotely.
"""

from __future__ import annotations

__all__ = [
    "JaxdistError",
    "SpecError",
    "CodecError",
    "WeightError",
    "DeviceError",
    "ArtifactError",
    "TransportError",
    "SessionError",
    "LimitError",
    "AuthError",
    "PipelineKeyError",
    "RemoteStageError",
]


class JaxdistError(Exception):
    """Base class of every error jaxdist raises on purpose.

    Attributes:
        code: the canonical status name (``"NOT_FOUND"``, ``"PERMISSION_DENIED"``, ...) a worker
            answers with. Each class has a default; a raise site may refine it with ``code=``.
            ``jaxdist/core/transport/status.py`` turns it into a gRPC status, in one place.

    Example:
        >>> from jaxdist import JaxdistError, parse_directive
        >>> try:
        ...     parse_directive("gpu")
        ... except JaxdistError as exc:  # every jaxdist error, raised here or on a worker
        ...     print(type(exc).__name__, exc.code)
        DeviceError FAILED_PRECONDITION
    """

    code: str = "INTERNAL"

    def __init__(self, *args: object, code: str | None = None) -> None:
        super().__init__(*args)
        if code is not None:
            self.code = code


class SpecError(JaxdistError):
    """A StageSpec (or a part of it) is malformed or inconsistent. The message names the field.

    Example:
        >>> from jaxdist import Model, SpecError
        >>> try:
        ...     Model("m", units=[], inputs={"x": ("b, 4", "float32")})
        ... except SpecError as exc:
        ...     print(exc)
        model 'm': needs at least one unit
    """

    code = "INVALID_ARGUMENT"


class CodecError(JaxdistError):
    """Bytes could not be turned into a tensor, or a tensor into bytes.

    Example:
        >>> from jaxdist import CodecError
        >>> from jaxdist.core import codec
        >>> try:
        ...     codec.from_bytes(bytes([0, 1]))  # not a Tensor message
        ... except CodecError as exc:
        ...     print(exc.code)
        INVALID_ARGUMENT
    """

    code = "INVALID_ARGUMENT"


class WeightError(JaxdistError):
    """A weight URI could not be resolved, is outside the roots, or does not match its WeightRef.

    Example:
        >>> import tempfile
        >>> from jaxdist import WeightError, resolve_weight
        >>> try:
        ...     resolve_weight("file:///etc/passwd", roots=[tempfile.mkdtemp()])
        ... except WeightError as exc:  # outside the weight roots
        ...     print(exc.code)
        PERMISSION_DENIED
    """

    code = "INVALID_ARGUMENT"


class DeviceError(JaxdistError):
    """A device directive is malformed or cannot be honoured on this machine.

    Example:
        >>> from jaxdist import DeviceError, parse_directive
        >>> try:
        ...     parse_directive("gpu")
        ... except DeviceError as exc:
        ...     print(str(exc).split(":")[0])
        device directive 'gpu' is ambiguous
    """

    code = "FAILED_PRECONDITION"


class ArtifactError(JaxdistError):
    """An exported artifact is corrupt, incompatible, for another platform, or not allowed.

    Also raised for registries and artifact stores that cannot be read or written.

    Example:
        >>> from jaxdist import ArtifactError, LocalRegistry
        >>> try:
        ...     LocalRegistry("no/such/registry", create=False)
        ... except ArtifactError as exc:
        ...     print(exc.code)
        NOT_FOUND
    """

    code = "FAILED_PRECONDITION"


class TransportError(JaxdistError):
    """A peer could not be reached, timed out, or broke the protocol.

    Example:
        >>> from jaxdist import Cluster, TransportError
        >>> try:
        ...     Cluster([])
        ... except TransportError as exc:
        ...     print(exc)
        a cluster needs at least one worker address
    """

    code = "UNAVAILABLE"


class SessionError(JaxdistError):
    """A session is unknown, ended, reclaimed after idling, lost, or used out of order.

    Example:
        >>> try:                                                    # doctest: +SKIP
        ...     s(x=x)  # a session whose worker restarted: its state is gone
        ... except SessionError:
        ...     s = pipe.session()  # start again from step 0
    """

    code = "FAILED_PRECONDITION"


class LimitError(JaxdistError):
    """A configured limit (sessions, frame size, artifact size, KV bytes) would be exceeded.

    Example:
        >>> import numpy as np
        >>> from jaxdist import LimitError
        >>> from jaxdist.core import codec
        >>> assembler = codec.TensorAssembler(max_bytes=1024)
        >>> try:
        ...     assembler.add(codec.encode("x", np.ones(512, np.float32))[0])
        ... except LimitError as exc:
        ...     print(exc)
        tensor 'x' is 2048 bytes, over the limit of 1024 bytes per tensor
    """

    code = "RESOURCE_EXHAUSTED"


class AuthError(JaxdistError):
    """Credentials are missing or wrong.

    A worker that refuses a call answers ``UNAUTHENTICATED``, which the coordinator raises as
    this class too.

    Example:
        >>> from jaxdist import AuthError, Cluster
        >>> try:
        ...     Cluster.local(1, token_file="no-such-token")
        ... except AuthError as exc:
        ...     print(exc)
        token file 'no-such-token' does not exist
    """

    code = "UNAUTHENTICATED"


class PipelineKeyError(AuthError):
    """A call or frame for a pipeline did not present that pipeline's key.

    The key is chosen by the coordinator that loaded the pipeline (``LoadStageRequest``'s
    ``pipeline_key``); the worker token alone does not open another coordinator's pipeline.
    A worker answers ``PERMISSION_DENIED``, which the coordinator raises as this class (an
    :class:`AuthError`, so one ``except AuthError`` catches both).

    Example:
        >>> import grpc
        >>> from jaxdist import AuthError, PipelineKeyError
        >>> from jaxdist.core.transport.status import error_class_for
        >>> cls = error_class_for(grpc.StatusCode.PERMISSION_DENIED)  # as a worker refused
        >>> cls is PipelineKeyError and issubclass(cls, AuthError)
        True
    """

    code = "PERMISSION_DENIED"


class RemoteStageError(JaxdistError):
    """A stage failed on a remote worker.

    Attributes:
        stage: index of the failing stage in its pipeline (``-1`` when unknown).
        address: ``HOST:PORT`` of the worker that failed.
        remote_type: the class name of the error on the worker, e.g. ``"WeightError"``.
        remote_traceback: the worker-side traceback text (may be empty).
        code: the worker's status for the failure when given, else that of ``remote_type``'s
            class (``"RESOURCE_EXHAUSTED"`` for a ``LimitError``), else ``"ABORTED"``.

    Example:
        >>> from jaxdist import RemoteStageError
        >>> exc = RemoteStageError("input 'x' has 3 dims, expected 2", stage=1,
        ...                        address="10.0.0.2:50051", remote_type="SpecError")
        >>> print(exc)
        stage 1 on worker 10.0.0.2:50051: SpecError: input 'x' has 3 dims, expected 2
        >>> exc.code
        'INVALID_ARGUMENT'
    """

    code = "ABORTED"

    def __init__(
        self,
        message: str,
        *,
        stage: int = -1,
        address: str = "",
        remote_type: str = "",
        remote_traceback: str = "",
        code: str | None = None,
    ) -> None:
        known = globals().get(remote_type)
        if code:
            self.code = code
        elif isinstance(known, type) and issubclass(known, JaxdistError):
            self.code = known.code
        self.stage = stage
        self.address = address
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        where = f"stage {stage} on worker {address}" if stage >= 0 else f"worker {address}"
        kind = f"{remote_type}: " if remote_type else ""
        text = f"{where}: {kind}{message}"
        if remote_traceback:
            text += "\n--- remote traceback ---\n" + remote_traceback.rstrip()
        super().__init__(text)
        self.message = message
