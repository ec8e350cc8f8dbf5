"""A local, content-addressed artifact store: the artifact half of a registry's layout.

Artifacts are addressed by ``sha256:<64 hex>`` (:func:`jaxdist.core.artifacts.digest_of`)::

    ROOT/sha256/ab/abcdef...        the artifact bytes (``ab`` = first two hex digits)
    ROOT/sha256/ab/abcdef....json   optional sidecar metadata (e.g. ``ArtifactMeta.to_dict()``)

A worker's artifact cache (``--artifact-cache``) is a :class:`LocalStore`. A registry
(:class:`jaxdist.registry.local.LocalRegistry`) is one too, with manifests beside the artifacts.

Writes are atomic (a temp file in the same directory, fsync, ``os.replace``), so a reader never
sees a half-written artifact and a crash leaves at most a ``.tmp-*`` file that :meth:`list`
ignores. Every :meth:`LocalStore.get` re-hashes the bytes: a store that silently returns damaged
bytes would hand a worker an artifact that fails in obscure ways, or runs wrong.

Example:
    >>> store = LocalStore(tmp_path)  # doctest: +SKIP
    >>> digest = store.put(artifact.data, meta=artifact.meta.to_dict())  # doctest: +SKIP
    >>> store.get(digest) == artifact.data  # doctest: +SKIP
    True
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import re
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from jaxdist.core.artifacts import digest_of
from jaxdist.core.errors import ArtifactError

__all__ = ["ArtifactEntry", "ArtifactStore", "LocalStore", "hex_of", "write_atomic"]

logger = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"


@dataclasses.dataclass(frozen=True)
class ArtifactEntry:
    """One stored artifact.

    Attributes:
        digest: ``sha256:<hex>``.
        size: size of the artifact in bytes.
        mtime: modification time of the stored file (seconds since the epoch).
    """

    digest: str
    size: int
    mtime: float


@runtime_checkable
class ArtifactStore(Protocol):
    """Where artifacts live, keyed by digest. ``LocalStore`` is the on-disk implementation."""

    def put(self, data: bytes, meta: Mapping[str, Any] | None = None) -> str:
        """Store ``data`` (idempotent) and return its digest."""
        ...

    def get(self, digest: str) -> bytes:
        """The bytes stored under ``digest``, verified; ``ArtifactError`` if missing or corrupt."""
        ...

    def has(self, digest: str) -> bool:
        """Whether ``digest`` is stored."""
        ...

    def list(self) -> builtins.list[ArtifactEntry]:
        """Every stored artifact, sorted by digest."""
        ...

    def delete(self, digest: str) -> None:
        """Remove ``digest`` and its metadata; ``ArtifactError`` if missing."""
        ...


def hex_of(digest: str) -> str:
    """The 64 hex digits of a ``sha256:<hex>`` digest.

    Raises:
        ArtifactError: the digest is malformed.
    """
    match = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if match is None:
        raise ArtifactError(
            f"artifact digest {digest!r} is malformed: expected 'sha256:' followed by 64 "
            "lowercase hex digits, as returned by jaxdist.core.artifacts.digest_of"
        )
    return match.group(1)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
    try:
        # mkstemp makes the file private (0600); a registry is meant to be read by others (a
        # web server serving it, other users' workers), like any file written with open().
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class LocalStore:
    """A content-addressed artifact store in a local directory (see the module docstring).

    Args:
        root: the store's directory.
        create: create ``root`` if missing; otherwise a missing root is an error (so a typo in
            a path to read from does not look like an empty registry).

    Raises:
        ArtifactError: ``root`` exists and is not a directory, or is missing and not created.
    """

    writable = True
    _what = "artifact store"  # in messages

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise ArtifactError(f"{self._what} root {self.root} exists and is not a directory")
        if not create and not self.root.is_dir():
            raise ArtifactError(f"artifact registry {self.root} does not exist; export a model "
                                f"into it first (jaxdist export --registry {self.root})",
                                code="NOT_FOUND")
        if create:
            (self.root / "sha256").mkdir(parents=True, exist_ok=True)

    @property
    def location(self) -> str:
        """The registry's directory, as a string (messages, ``jaxdist registry ls``)."""
        return str(self.root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.root)!r})"

    def _path(self, hex_digest: str) -> Path:
        return self.root / "sha256" / hex_digest[:2] / hex_digest

    def path_of(self, digest: str) -> Path:
        """Where ``digest`` is (or would be) stored."""
        return self._path(hex_of(digest))

    def put(self, data: bytes, meta: Mapping[str, Any] | None = None) -> str:
        """Store ``data`` and return its digest. Storing the same bytes again is a no-op.

        Args:
            data: the artifact bytes.
            meta: optional JSON-serializable metadata, written (or replaced) as a sidecar;
                ``None`` leaves an existing sidecar alone.

        Returns:
            The digest, ``sha256:<hex>``.

        Raises:
            ArtifactError: ``meta`` is not JSON-serializable.
        """
        data = bytes(data)
        digest = digest_of(data)
        text = None
        if meta is not None:  # serialized first, so bad metadata stores nothing at all
            try:
                text = json.dumps(dict(meta), indent=1, sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise ArtifactError(
                    f"metadata for artifact {digest} is not JSON-serializable: {exc}"
                ) from exc
        path = self._path(hex_of(digest))
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and digest_of(path.read_bytes()) == digest:
            logger.debug("artifact %s already in %s", digest, self.root)
        else:
            # A damaged file under this name is replaced: putting the artifact again heals it.
            write_atomic(path, data)
            logger.info("stored artifact %s (%d bytes) in %s", digest, len(data), self.root)
        if text is not None:
            write_atomic(path.with_name(path.name + ".json"), text.encode())
        return digest

    def get(self, digest: str) -> bytes:
        """Read and verify an artifact.

        Raises:
            ArtifactError: the digest is malformed, the artifact is missing, or the stored file
                no longer hashes to its digest (corrupt).
        """
        path = self._path(hex_of(digest))
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ArtifactError(
                f"artifact {digest} not in {self._what} at {self.root}; put it first, or ship the "
                "bytes with the StageSpec",
                code="NOT_FOUND",
            ) from None
        found = digest_of(data)
        if found != digest:
            raise ArtifactError(
                f"artifact {digest} in {self._what} at {self.root} is corrupt: the file {path} "
                f"({len(data)} bytes) hashes to {found}. Delete it and put the artifact again"
            )
        return data

    def has(self, digest: str) -> bool:
        """Whether ``digest`` is stored (without verifying its bytes).

        Raises:
            ArtifactError: the digest is malformed.
        """
        return self._path(hex_of(digest)).is_file()

    def meta(self, digest: str) -> dict[str, Any] | None:
        """The sidecar metadata of ``digest``, or ``None`` if it was stored without any.

        Raises:
            ArtifactError: the digest is malformed, the artifact is missing, or the sidecar is
                not valid JSON.
        """
        path = self._path(hex_of(digest))
        if not path.is_file():
            raise ArtifactError(f"artifact {digest} not in {self._what} at {self.root}",
                                code="NOT_FOUND")
        sidecar = path.with_name(path.name + ".json")
        try:
            meta: dict[str, Any] = json.loads(sidecar.read_text())
            return meta
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ArtifactError(
                f"metadata of artifact {digest} at {sidecar} is not valid JSON: {exc}; put the "
                "artifact again with its metadata"
            ) from exc

    def list(self) -> builtins.list[ArtifactEntry]:
        """Every stored artifact, sorted by digest. Temp files and sidecars are skipped."""
        entries = []
        for path in (self.root / "sha256").glob("??/*"):
            if _HEX_RE.match(path.name) and path.parent.name == path.name[:2] and path.is_file():
                stat = path.stat()
                entries.append(ArtifactEntry(f"sha256:{path.name}", stat.st_size, stat.st_mtime))
        return sorted(entries, key=lambda e: e.digest)

    def delete(self, digest: str) -> None:
        """Remove an artifact and its sidecar.

        Raises:
            ArtifactError: the digest is malformed or the artifact is missing.
        """
        path = self._path(hex_of(digest))
        try:
            path.unlink()
        except FileNotFoundError:
            raise ArtifactError(f"artifact {digest} not in {self._what} at {self.root}",
                                code="NOT_FOUND") from None
        path.with_name(path.name + ".json").unlink(missing_ok=True)
        logger.info("deleted artifact %s from %s", digest, self.root)

    def touch(self, digest: str) -> None:
        """Mark ``digest`` as just used (its file's modification time), for :meth:`prune`.
        A missing artifact, or a store that cannot be written, is left as it is.

        Raises:
            ArtifactError: the digest is malformed.
        """
        with contextlib.suppress(OSError):
            os.utime(self._path(hex_of(digest)))

    def prune(self, max_bytes: int, keep: Collection[str] = ()) -> builtins.list[ArtifactEntry]:
        """Delete the least recently used artifacts (the oldest modification time first, see
        :meth:`touch`) until those left hold at most ``max_bytes``; never one in ``keep``.

        Returns:
            The deleted artifacts, oldest first. Those in ``keep`` may leave the store above
            ``max_bytes``.
        """
        entries = sorted(self.list(), key=lambda e: (e.mtime, e.digest))
        total = sum(e.size for e in entries)
        gone = []
        for e in entries:
            if total <= max_bytes:
                break
            if e.digest in keep:
                continue
            with contextlib.suppress(ArtifactError):  # deleted meanwhile: gone all the same
                self.delete(e.digest)
            total -= e.size
            gone.append(e)
        return gone
