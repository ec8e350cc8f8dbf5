"""The jaxdist error hierarchy.

Every error a user can act on derives from :class:`JaxdistError`. Messages follow one rule: say
where (the stage, tensor, URI or field), what was expected, what was found, and how to fix it.
The worker maps each class to one gRPC status code (``worker/status.py``); the coordinator maps
status codes back to these classes, so a caller catches the same type locally and remotely.
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
    "RemoteStageError",
]


class JaxdistError(Exception):
    """Base class of every error jaxdist raises on purpose.

    Attributes:
        code: the canonical status name (``"NOT_FOUND"``, ``"PERMISSION_DENIED"``, ...) a worker
            answers with. Each class has a default; a raise site may refine it with ``code=``.
            ``jaxdist/core/transport/status.py`` turns it into a gRPC status, in one place.
    """

    code: str = "INTERNAL"

    def __init__(self, *args: object, code: str | None = None) -> None:
        super().__init__(*args)
        if code is not None:
            self.code = code


class SpecError(JaxdistError):
    """A StageSpec (or a part of it) is malformed or inconsistent. The message names the field."""

    code = "INVALID_ARGUMENT"


class CodecError(JaxdistError):
    """Bytes could not be turned into a tensor, or a tensor into bytes."""

    code = "INVALID_ARGUMENT"


class WeightError(JaxdistError):
    """A weight URI could not be resolved, is outside the roots, or does not match its WeightRef."""

    code = "INVALID_ARGUMENT"


class DeviceError(JaxdistError):
    """A device directive is malformed or cannot be honoured on this machine."""

    code = "FAILED_PRECONDITION"


class ArtifactError(JaxdistError):
    """An exported artifact is corrupt, incompatible, for another platform, or not allowed."""

    code = "FAILED_PRECONDITION"


class TransportError(JaxdistError):
    """A peer could not be reached, timed out, or broke the protocol."""

    code = "UNAVAILABLE"


class SessionError(JaxdistError):
    """A session is unknown, ended, reclaimed after idling, lost, or used out of order."""

    code = "FAILED_PRECONDITION"


class LimitError(JaxdistError):
    """A configured limit (sessions, frame size, artifact size, KV bytes) would be exceeded."""

    code = "RESOURCE_EXHAUSTED"


class AuthError(JaxdistError):
    """Credentials are missing or wrong."""

    code = "UNAUTHENTICATED"


class RemoteStageError(JaxdistError):
    """A stage failed on a remote worker.

    Attributes:
        stage: index of the failing stage in its pipeline (``-1`` when unknown).
        address: ``HOST:PORT`` of the worker that failed.
        remote_type: the class name of the error on the worker, e.g. ``"WeightError"``.
        remote_traceback: the worker-side traceback text (may be empty).
        code: the worker's status for the failure when given, else that of ``remote_type``'s
            class (``"RESOURCE_EXHAUSTED"`` for a ``LimitError``), else ``"ABORTED"``.
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
