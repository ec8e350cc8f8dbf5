"""A local, content-addressed artifact store (the layout every registry shares is in
:mod:`jaxdist.registry_layout`).

Artifacts are addressed by ``sha256:<64 hex>`` (:func:`jaxdist.artifacts.digest_of`). On disk::

    ROOT/sha256/ab/abcdef...        the artifact bytes (``ab`` = first two hex digits)
    ROOT/sha256/ab/abcdef....json   optional sidecar metadata (e.g. ``ArtifactMeta.to_dict()``)
    ROOT/manifests/NAME-HEX.json    manifests (:mod:`jaxdist.manifest`); HEX = sha256 of the file

The same layout served by any URL that ``fsspec`` reads (``http://``, ``file://``, ``s3://``,
...) is a registry too: :class:`jaxdist.urlregistry.UrlRegistry`. :func:`open_registry` picks
the class from the location. A worker's artifact cache (``--artifact-cache``) is a
LocalRegistry.

Writes are atomic (a temp file in the same directory, fsync, ``os.replace``), so a reader never
sees a half-written artifact and a crash leaves at most a ``.tmp-*`` file that :meth:`list`
ignores. Every :meth:`LocalRegistry.get` re-hashes the bytes: a store that silently returns
damaged bytes would hand a worker an artifact that fails in obscure ways, or runs wrong.

Example:
    >>> reg = LocalRegistry(tmp_path)  # doctest: +SKIP
    >>> digest = reg.put(artifact.data, meta=artifact.meta.to_dict())  # doctest: +SKIP
    >>> reg.get(digest) == artifact.data  # doctest: +SKIP
    True
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxdist.artifacts import digest_of
from jaxdist.errors import ArtifactError
from jaxdist.registry_layout import (MANIFESTS, ArtifactEntry, ArtifactStore, ManifestEntry,
                                     Registry, find_manifest, hex_of, manifest_filename,
                                     parse_manifest_filename)

__all__ = ["ArtifactEntry", "ArtifactStore", "LocalRegistry", "ManifestEntry", "find_manifest",
           "manifest_filename", "open_registry", "Registry"]

logger = logging.getLogger(__name__)

_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_TMP_PREFIX = ".tmp-"


def _write_atomic(path: Path, data: bytes) -> None:
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


class LocalRegistry:
    """A content-addressed artifact store in a local directory (see the module docstring).

    Args:
        root: the store's directory.
        create: create ``root`` if missing; otherwise a missing root is an error (so a typo in
            a path to read from does not look like an empty registry).

    Raises:
        ArtifactError: ``root`` exists and is not a directory, or is missing and not created.
    """

    writable = True

    def __init__(self, root: str | Path, *, create: bool = True) -> None:
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise ArtifactError(f"artifact registry root {self.root} exists and is not a directory")
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
        return f"LocalRegistry({str(self.root)!r})"

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
            _write_atomic(path, data)
            logger.info("stored artifact %s (%d bytes) in %s", digest, len(data), self.root)
        if text is not None:
            _write_atomic(path.with_name(path.name + ".json"), text.encode())
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
                f"artifact {digest} not in registry at {self.root}; put it first, or ship the "
                "bytes with the StageSpec",
                code="NOT_FOUND",
            ) from None
        found = digest_of(data)
        if found != digest:
            raise ArtifactError(
                f"artifact {digest} in registry at {self.root} is corrupt: the file {path} "
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
            raise ArtifactError(f"artifact {digest} not in registry at {self.root}",
                                code="NOT_FOUND")
        sidecar = path.with_name(path.name + ".json")
        try:
            return json.loads(sidecar.read_text())
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
            raise ArtifactError(f"artifact {digest} not in registry at {self.root}",
                                code="NOT_FOUND") from None
        path.with_name(path.name + ".json").unlink(missing_ok=True)
        logger.info("deleted artifact %s from %s", digest, self.root)

    # -- manifests ---------------------------------------------------------------------------

    def put_manifest(self, data: bytes, name: str) -> ManifestEntry:
        """Store a manifest's bytes as ``manifests/NAME-HEX.json`` (idempotent)."""
        digest = digest_of(bytes(data))
        path = self.root / MANIFESTS / manifest_filename(name, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_file() and digest_of(path.read_bytes()) == digest):
            _write_atomic(path, bytes(data))
            logger.info("stored manifest %s of %s in %s", digest, name, self.root)
        return ManifestEntry(name, digest, len(data), path.stat().st_mtime, str(path))

    def list_manifests(self) -> builtins.list[ManifestEntry]:
        """Every stored manifest, oldest first."""
        entries = []
        for path in (self.root / MANIFESTS).glob("*.json"):
            parsed = parse_manifest_filename(path.name)
            if parsed is not None and path.is_file():
                stat = path.stat()
                entries.append(ManifestEntry(parsed[0], parsed[1], stat.st_size, stat.st_mtime,
                                             str(path)))
        return sorted(entries, key=lambda e: (e.mtime, e.name))

    def find_manifest(self, ref: str) -> ManifestEntry:
        """See :func:`find_manifest`."""
        return find_manifest(self.list_manifests(), ref, f"registry {self.root}")

    def get_manifest(self, digest: str) -> bytes:
        """A stored manifest's bytes, verified against its digest.

        Raises:
            ArtifactError: missing, or corrupt (the bytes hash to something else).
        """
        hex_of(digest)
        entry = next((e for e in self.list_manifests() if e.digest == digest), None)
        if entry is None:
            raise ArtifactError(f"manifest {digest} not in registry at {self.root}",
                                code="NOT_FOUND")
        data = Path(entry.location).read_bytes()
        if digest_of(data) != digest:
            raise ArtifactError(f"manifest {digest} in registry at {self.root} is corrupt: "
                                f"{entry.location} hashes to {digest_of(data)}. Export it again")
        return data

    def delete_manifest(self, digest: str) -> None:
        """Remove a stored manifest (its artifacts stay until ``gc``)."""
        entries = [e for e in self.list_manifests() if e.digest == digest]
        if not entries:
            raise ArtifactError(f"manifest {digest} not in registry at {self.root}",
                                code="NOT_FOUND")
        for e in entries:
            Path(e.location).unlink(missing_ok=True)


def open_registry(location: str | os.PathLike[str], *, create: bool = False) -> Registry:
    """The registry at ``location``: a directory (:class:`LocalRegistry`) or a URL that fsspec
    reads (:class:`jaxdist.urlregistry.UrlRegistry`: ``file://``, ``http(s)://``, ``s3://``, ...).

    Args:
        location: directory or URL.
        create: create a missing local directory (for writing); otherwise it must exist.

    Raises:
        ArtifactError: the location cannot be opened (missing directory, unknown URL scheme, or
            the fsspec backend for it is not installed).
    """
    text = os.fspath(location)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        from jaxdist.urlregistry import UrlRegistry  # fsspec is imported only for URLs

        return UrlRegistry(text, create=create)
    return LocalRegistry(text, create=create)
