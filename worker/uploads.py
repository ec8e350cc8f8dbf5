"""Artifacts uploaded to a worker (``UploadArtifact``), received under its limits.

An upload is received on the data-plane loop: one that stalls holds no thread, only the bytes
it sent, which count against ``--max-upload-bytes`` (all uploads in progress together) until it
ends. It ends ``RESOURCE_EXHAUSTED`` after ``--upload-idle-timeout`` seconds without a chunk, or
past ``--max-artifact-bytes``.

Each chunk is held once: as it arrives it is added, in a thread, to a running sha256 and to the
upload's bytes, then dropped. The first :data:`SPOOL_AFTER_BYTES` stay in memory; past them they
go to the upload's temp file in the artifact cache's directory, and the rest follows there, so
an unfinished upload holds at most that much memory, its other bytes on disk. A finished one
whose digest matches is moved into the cache (``os.replace``, no copy), and any other is
deleted. Only an upload past :data:`SPOOL_AFTER_BYTES` holds a file open, so the open files of
all uploads are bounded by ``--max-upload-bytes`` (128 at the defaults), not by their number.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO

from jaxdist.core.errors import ArtifactError, LimitError
from jaxdist.core.weights.uri import clip
from jaxdist.proto import jaxdist_pb2 as pb
from jaxdist.worker.artifact_cache import ArtifactCache
from jaxdist.worker.config import WorkerConfig
from jaxdist.worker.limits import next_within

__all__ = ["SPOOL_AFTER_BYTES", "SPOOL_PREFIX", "ArtifactUploads"]

SPOOL_PREFIX = ".tmp-upload-"
"""The name an upload's temp file starts with, in ``ROOT/sha256/`` of the artifact cache (where
the store's listing never looks)."""

SPOOL_AFTER_BYTES = 4 << 20
"""An upload's bytes kept in memory before they go to its temp file."""


class _Spool:
    """One upload's bytes so far, in memory and then in a temp file, and their sha256.
    :meth:`write` and :meth:`finish` run in threads, one at a time; :meth:`discard` from any.

    Args:
        directory: where the temp file goes (the cache's filesystem: it is renamed into it).
    """

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._head = bytearray()  # the bytes before the file is opened
        self._file: BinaryIO | None = None
        self._sha = hashlib.sha256()
        self._lock = threading.Lock()  # a write in its thread against a discard on the loop
        self._closed = False
        self.path: Path | None = None
        self.size = 0
        self.moved = False  # into the cache: the name is no longer ours

    def _open(self) -> BinaryIO:
        """The temp file, with what was kept in memory written to it (under ``_lock``)."""
        try:
            fd, name = tempfile.mkstemp(prefix=SPOOL_PREFIX, dir=self._directory)
        except OSError as exc:
            raise ArtifactError(f"UploadArtifact: cannot write an upload into the artifact "
                                f"cache at {self._directory}: {exc}") from None
        self.path = Path(name)
        self._file = file = os.fdopen(fd, "wb")
        file.write(self._head)
        self._head = bytearray()
        return file

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._closed:  # discarded meanwhile
                return
            self._sha.update(data)
            self.size += len(data)
            if self._file is None and self.size <= SPOOL_AFTER_BYTES:
                self._head += data
                return
            (self._file or self._open()).write(data)

    def digest(self) -> str:
        """The digest of the bytes so far, ``sha256:<hex>``."""
        with self._lock:
            return "sha256:" + self._sha.hexdigest()

    def finish(self) -> Path:
        """All the bytes in the temp file, on disk: its path."""
        with self._lock:
            file = self._file or self._open()
            # Readable by others, as the cache's other files (mkstemp makes it 0600)
            os.fchmod(file.fileno(), 0o644)
            file.flush()
            os.fsync(file.fileno())
            file.close()
            assert self.path is not None  # set by _open
            return self.path

    def discard(self) -> None:
        """Drop the bytes: close and delete the file, unless it was moved into the cache."""
        with self._lock:
            self._closed = True
            self._head = bytearray()
            if self._file is not None:
                self._file.close()
        if self.path is not None and not self.moved:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class ArtifactUploads:
    """The uploads of one worker into its artifact cache. :meth:`upload` runs on the loop.

    Args:
        config: the worker's limits (``max_upload_bytes``, ``max_artifact_bytes``,
            ``upload_idle_timeout``).
        registry: where a received artifact is stored, and its uploads are spooled.
    """

    def __init__(self, config: WorkerConfig, registry: ArtifactCache) -> None:
        self._config = config
        self._registry = registry
        self.held = 0  # bytes received by unfinished uploads (on the loop only)

    async def upload(self, chunks: AsyncIterator[pb.ArtifactChunk]) -> pb.UploadReply:
        """Receive one upload, check its digest and store it (if new).

        Raises:
            LimitError: over a limit, or stalled. ArtifactError: empty, or not its digest.
        """
        held = [0]  # this upload's bytes in the worker-wide count
        spool = _Spool(self._registry.root / "sha256")
        try:
            digest = await self._receive(chunks, held, spool)
            return await asyncio.to_thread(self._store, digest, spool)
        finally:
            self.held -= held[0]
            spool.discard()  # in the cache by now, or not to be kept

    async def _receive(self, request_iterator: AsyncIterator[pb.ArtifactChunk],
                       held: list[int], spool: _Spool) -> str:
        cfg = self._config
        digest, size = "", 0
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
            data = chunk.data  # read once: each read of the field copies it
            if len(data) + self.held > cfg.max_upload_bytes:
                raise LimitError(f"UploadArtifact of {clip(digest or chunk.digest, 80)}: the "
                                 f"uploads in progress on this worker hold {self.held} "
                                 f"bytes; {len(data)} more would pass the limit of "
                                 f"{cfg.max_upload_bytes} (--max-upload-bytes). Retry when "
                                 f"they have finished")
            self.held += len(data)
            held[0] += len(data)
            if not digest:
                digest = chunk.digest
                if chunk.total_bytes > cfg.max_artifact_bytes:
                    raise LimitError(f"artifact {digest} is {chunk.total_bytes} bytes, over the "
                                     f"artifact size limit of {cfg.max_artifact_bytes} "
                                     f"(--max-artifact-bytes)")
            size += len(data)
            if size > cfg.max_artifact_bytes:
                raise LimitError(f"artifact {digest} exceeds the artifact size limit of "
                                 f"{cfg.max_artifact_bytes} bytes (--max-artifact-bytes): "
                                 f"{size} bytes received so far")
            del chunk
            await asyncio.to_thread(spool.write, data)
            del data  # held until written, and no longer
        if not digest:
            raise ArtifactError("empty artifact upload: the first chunk must name the digest")
        return digest

    def _store(self, digest: str, spool: _Spool) -> pb.UploadReply:
        found = spool.digest()
        if found != digest:
            raise ArtifactError(f"uploaded artifact does not match its digest: expected {digest}, "
                                f"found {found} ({spool.size} bytes)")
        stored = not self._registry.has(digest) and self._registry.adopt(spool.finish(), digest)
        spool.moved = stored
        return pb.UploadReply(digest=digest, stored=stored, size=spool.size)
