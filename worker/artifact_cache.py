"""The worker's artifact cache (``--artifact-cache``): a :class:`LocalStore` bounded in bytes.

Every artifact a worker receives (uploaded, or inlined in a ``LoadStage`` spec) is kept on disk
so that the next deploy of the same stage uploads nothing, across restarts too. Kept forever, a
long-running worker that sees many models and export settings would fill its disk, so the cache
holds at most ``--max-artifact-cache-bytes``: storing an artifact deletes the least recently
used ones (``HasArtifact`` and ``LoadStage`` mark an artifact used) past the bound, except the
artifacts of the stages loaded now and the one just stored. Each deletion is logged.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from jaxdist.core.store import LocalStore

__all__ = ["ArtifactCache"]

log = logging.getLogger(__name__)


class ArtifactCache(LocalStore):
    """A worker's artifact store, least recently used out first past ``max_bytes``.

    Args:
        root: the cache's directory (created if missing).
        max_bytes: the bound on the artifacts' bytes; ``0``: no bound.
        in_use: the digests that must stay (the loaded stages' artifacts), asked at each prune.
    """

    _what = "artifact cache"

    def __init__(self, root: str | Path, *, max_bytes: int,
                 in_use: Callable[[], Collection[str]] = frozenset) -> None:
        super().__init__(root)
        self.max_bytes = max_bytes
        self._in_use = in_use
        self._lock = threading.Lock()  # one prune at a time: each lists the whole cache
        self.deleted = 0  # artifacts deleted to stay within max_bytes, since start

    def put(self, data: bytes, meta: Mapping[str, Any] | None = None) -> str:
        digest = super().put(data, meta)
        if self.max_bytes:
            self._prune(digest)
        return digest

    def adopt(self, path: Path, digest: str) -> bool:
        """Take in ``path``, a finished file of this cache's filesystem whose bytes hash to
        ``digest`` (an upload: ``worker/uploads.py``), by renaming it: no copy in memory.

        Returns:
            True when stored; False when the cache had ``digest`` already (``path`` is left
            for the caller to delete).
        """
        if self.has(digest):
            return False
        dest = self.path_of(digest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        log.info("stored artifact %s (%d bytes) in %s", digest, dest.stat().st_size, self.root)
        if self.max_bytes:
            self._prune(digest)
        return True

    def get(self, digest: str) -> bytes:
        data = super().get(digest)
        self.touch(digest)
        return data

    def has(self, digest: str) -> bool:
        found = super().has(digest)
        if found:  # asked before a LoadStage that will use it: it is the last to go
            self.touch(digest)
        return found

    def _prune(self, stored: str) -> None:
        with self._lock:
            keep = {stored, *self._in_use()}
            gone = self.prune(self.max_bytes, keep)
            self.deleted += len(gone)
            if gone:
                log.info("artifact cache %s: over --max-artifact-cache-bytes=%d, deleted the "
                         "least recently used: %s (%d bytes)", self.root, self.max_bytes,
                         ", ".join(e.digest for e in gone), sum(e.size for e in gone))
            held = sum(e.size for e in self.list())
            if held > self.max_bytes:
                log.warning("artifact cache %s holds %d bytes, over --max-artifact-cache-bytes="
                            "%d: the artifacts of the loaded stages and the one just stored "
                            "are never deleted", self.root, held, self.max_bytes)
