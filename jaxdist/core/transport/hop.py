"""The credential of a pipeline's hop: what a worker presents to the worker of the next stage.

A worker forwards a stage's outputs to the next hop its ``LoadStage`` named. Whoever may load a
stage chooses that address, so the worker never sends its bearer token there, nor a proof keyed
by it. It presents the pipeline's own credential instead::

    credential = HMAC-SHA256(secret, CONTEXT + pipeline id (UTF-8))

``secret`` is the pipeline's key (``LoadStageRequest.pipeline_key``) when it has one, else the
workers' shared token (a pinned pipeline of ``jaxdist deploy`` has no key). Both ends of the hop
hold it: the next worker loaded the same pipeline with the same key, or reads the same
``--token-file``; a third party holds neither. A credential opens one thing: a stream of frames
of that pipeline (a gRPC ``Push``, or a data connection in the frames mode) on a worker where
that pipeline is loaded. Every frame on the stream must be of that pipeline; it opens no other
method (``Info``, ``LoadStage``, ``Subscribe``, ...), no other pipeline, and never stands for
the token.

* gRPC: the stream carries :data:`PIPELINE_HEADER` (the pipeline id) and
  :data:`CREDENTIAL_HEADER` (the 32 bytes) as call metadata, checked by
  ``security.TokenInterceptor`` before the handler is chosen.
* The data port: the handshake's hop answer names the pipeline and proves the credential for
  the connection's nonce (``stream.py``); the credential itself never crosses.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence

from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["CONTEXT", "CREDENTIAL_HEADER", "PIPELINE_HEADER", "PUSH_METHOD", "HopKeys",
           "check", "credential", "metadata", "presented"]

CONTEXT = b"jaxdist hop credential, version 1\x00"
"""What a credential is bound to besides its pipeline: a MAC made for anything else is none."""
PIPELINE_HEADER = "jaxdist-hop-pipeline-bin"
CREDENTIAL_HEADER = "jaxdist-hop-credential-bin"
PUSH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Worker'].full_name}/Push"
"""The one method a hop credential opens."""

HopKeys = Callable[[str], bytes | None]
"""A pipeline's key on this worker: ``b""`` for a pipeline without one, ``None`` when it is
not loaded here (``LoadedPipelines.hop_key``)."""


def credential(pipeline_id: str, key: bytes, token: bytes | None) -> bytes | None:
    """The hop credential of ``pipeline_id``: keyed by the pipeline's ``key``, or by ``token``
    for a pipeline without one; ``None`` when there is neither (nothing to prove)."""
    secret = key or token
    if not secret:
        return None
    return hmac.new(secret, CONTEXT + pipeline_id.encode("utf-8"), hashlib.sha256).digest()


def metadata(pipeline_id: str, given: bytes | None) -> tuple[tuple[str, str | bytes], ...]:
    """The call metadata of a hop stream of ``pipeline_id`` (none without a credential)."""
    if given is None:
        return ()
    return ((PIPELINE_HEADER, pipeline_id.encode("utf-8")), (CREDENTIAL_HEADER, given))


def presented(md: Sequence[tuple[str, str | bytes]] | None) -> tuple[str, bytes] | str | None:
    """The ``(pipeline id, credential)`` a call's metadata presents; ``None`` when it presents
    none; a string saying why when it is malformed."""
    pipelines = [v for k, v in md or () if k == PIPELINE_HEADER]
    given = [v for k, v in md or () if k == CREDENTIAL_HEADER]
    if not pipelines and not given:
        return None
    if len(pipelines) != 1 or len(given) != 1:
        return (f"wrong credentials: a hop stream carries exactly one {PIPELINE_HEADER!r} and "
                f"one {CREDENTIAL_HEADER!r} metadata entry")
    pipeline, cred = pipelines[0], given[0]
    try:
        pipeline_id = pipeline.decode("utf-8") if isinstance(pipeline, bytes) else pipeline
    except UnicodeDecodeError:
        return f"wrong credentials: {PIPELINE_HEADER!r} is not UTF-8"
    return pipeline_id, cred if isinstance(cred, bytes) else cred.encode("utf-8", "replace")


def check(pipeline_id: str, given: bytes, *, key: bytes | None, token: bytes | None
          ) -> str | None:
    """``None`` when ``given`` is ``pipeline_id``'s credential on this worker (its ``key``;
    ``None``: not loaded here), else why not. Compared in constant time."""
    shown = repr(pipeline_id[:64])
    if key is None:
        return (f"wrong credentials: a hop credential for pipeline {shown}, which is not "
                f"loaded on this worker")
    expected = credential(pipeline_id, key, token)
    if expected is None or not hmac.compare_digest(given, expected):
        return (f"wrong credentials: the hop credential presented for pipeline {shown} is not "
                f"that pipeline's (a worker forwarding its frames presents one made from the "
                f"pipeline's key, or for a pipeline without one from the workers' shared "
                f"--token-file)")
    return None
