"""Artifacts uploaded to a worker (``UploadArtifact``), received under its limits.

An upload is received on the data-plane loop: one that stalls holds no thread, only the bytes
it sent, which count against ``--max-upload-bytes`` (all uploads in progress together) until it
ends. It ends ``RESOURCE_EXHAUSTED`` after ``--upload-idle-timeout`` seconds without a chunk, or
past ``--max-artifact-bytes``. The digest is checked, and the artifact stored, in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from jaxdist.core import artifacts
from jaxdist.core.errors import ArtifactError, LimitError
from jaxdist.core.store import LocalStore
from jaxdist.core.weights.uri import clip
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.config import WorkerConfig
from jaxdist.worker.limits import next_within

__all__ = ["ArtifactUploads"]


class ArtifactUploads:
    """The uploads of one worker into its artifact store. :meth:`upload` runs on the loop.

    Args:
        config: the worker's limits (``max_upload_bytes``, ``max_artifact_bytes``,
            ``upload_idle_timeout``).
        registry: where a received artifact is stored.
    """

    def __init__(self, config: WorkerConfig, registry: LocalStore) -> None:
        self._config = config
        self._registry = registry
        self.held = 0  # bytes held by unfinished uploads (on the loop only)

    async def upload(self, chunks: AsyncIterator[pb.ArtifactChunk]) -> pb.UploadReply:
        """Receive one upload, check its digest and store it (if new).

        Raises:
            LimitError: over a limit, or stalled. ArtifactError: empty, or not its digest.
        """
        held = [0]  # this upload's bytes in the worker-wide count
        try:
            digest, data = await self._receive(chunks, held)
            return await asyncio.to_thread(self._store, digest, data)
        finally:
            self.held -= held[0]

    async def _receive(self, request_iterator: AsyncIterator[pb.ArtifactChunk],
                       held: list[int]) -> tuple[str, bytes]:
        cfg = self._config
        digest, parts, size = "", [], 0
        chunks = aiter(request_iterator)
        while True:
            try:
                chunk = await next_within(chunks, cfg.upload_idle_timeout)
            except TimeoutError:
                raise LimitError(f"UploadArtifact of {clip(digest, 80) or 'an artifact'}: no "
                                 f"data for {cfg.upload_idle_timeout:g} s "
                                 f"(--upload-idle-timeout); {size} bytes had arrived. The upload "
                                 f"is dropped") from None
            if chunk is None:
                break
            if len(chunk.data) + self.held > cfg.max_upload_bytes:
                raise LimitError(f"UploadArtifact of {clip(digest or chunk.digest, 80)}: the "
                                 f"uploads in progress on this worker hold {self.held} "
                                 f"bytes; {len(chunk.data)} more would pass the limit of "
                                 f"{cfg.max_upload_bytes} (--max-upload-bytes). Retry when "
                                 f"they have finished")
            self.held += len(chunk.data)
            held[0] += len(chunk.data)
            if not digest:
                digest = chunk.digest
                if chunk.total_bytes > cfg.max_artifact_bytes:
                    raise LimitError(f"artifact {digest} is {chunk.total_bytes} bytes, over the "
                                     f"artifact size limit of {cfg.max_artifact_bytes} "
                                     f"(--max-artifact-bytes)")
            size += len(chunk.data)
            if size > cfg.max_artifact_bytes:
                raise LimitError(f"artifact {digest} exceeds the artifact size limit of "
                                 f"{cfg.max_artifact_bytes} bytes (--max-artifact-bytes): "
                                 f"{size} bytes received so far")
            parts.append(chunk.data)
        if not digest:
            raise ArtifactError("empty artifact upload: the first chunk must name the digest")
        return digest, b"".join(parts)

    def _store(self, digest: str, data: bytes) -> pb.UploadReply:
        found = artifacts.digest_of(data)
        if found != digest:
            raise ArtifactError(f"uploaded artifact does not match its digest: expected {digest}, "
                                f"found {found} ({len(data)} bytes)")
        stored = not self._registry.has(digest)
        if stored:
            self._registry.put(data)
        return pb.UploadReply(digest=digest, stored=stored, size=len(data))
