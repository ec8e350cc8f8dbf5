"""The one table between jaxdist errors and gRPC status codes, used in both directions.

Every :class:`~jaxdist.core.errors.JaxdistError` carries a canonical status name in ``code`` (a class
default, refined at the raise site where it matters, e.g. ``NOT_FOUND`` for a missing tensor).
The worker turns an exception into a status here (:func:`code_for`); the coordinator turns the
status and the remote class name back into the same error class (:func:`error_class_for`), so
callers catch ``WeightError`` whether the weight failed locally or on a worker.
"""

from __future__ import annotations

import grpc

from jaxdist.core import errors

__all__ = ["code_for", "error_class_for"]


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for an exception raised while serving a request."""
    if isinstance(exc, errors.JaxdistError):
        return grpc.StatusCode[exc.code]
    return grpc.StatusCode.INTERNAL


_ERROR_BY_NAME: dict[str, type[errors.JaxdistError]] = {
    cls.__name__: cls for cls in (
        errors.AuthError, errors.PipelineKeyError, errors.LimitError, errors.SessionError, errors.SpecError,
        errors.CodecError, errors.DeviceError, errors.ArtifactError, errors.TransportError,
        errors.WeightError, errors.JaxdistError)}

_ERROR_BY_CODE: dict[grpc.StatusCode, type[errors.JaxdistError]] = {
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PipelineKeyError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.LimitError,
    grpc.StatusCode.UNAVAILABLE: errors.TransportError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.TransportError,
    grpc.StatusCode.CANCELLED: errors.TransportError,
}


def error_class_for(code: grpc.StatusCode, remote_type: str = "") -> type[errors.JaxdistError]:
    """The local error class for a status code, refined by the remote class name when known."""
    if remote_type in _ERROR_BY_NAME:
        return _ERROR_BY_NAME[remote_type]
    return _ERROR_BY_CODE.get(code, errors.JaxdistError)
