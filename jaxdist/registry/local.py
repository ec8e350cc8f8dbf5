"""A registry in a local directory: artifacts and the manifests that deploy them.

On disk::

    ROOT/sha256/ab/abcdef...        the artifact bytes (``ab`` = first two hex digits)
    ROOT/sha256/ab/abcdef....json   optional sidecar metadata (e.g. ``ArtifactMeta.to_dict()``)
    ROOT/manifests/NAME-HEX.json    manifests (:mod:`jaxdist.registry.manifest`); HEX = sha256

The artifact half is :class:`jaxdist.core.store.LocalStore` (a worker's artifact cache is one);
the manifest half is in :mod:`jaxdist.registry.layout`. The same layout served by any URL that
``fsspec`` reads (``http://``, ``file://``, ``s3://``, ...) is a registry too:
:class:`jaxdist.registry.url.UrlRegistry`. :func:`open_registry` picks the class from the
location. Manifest writes are atomic, like artifact writes, and reads are verified.

Example:
    >>> reg = LocalRegistry(tmp_path)  # doctest: +SKIP
    >>> digest = reg.put(artifact.data, meta=artifact.meta.to_dict())  # doctest: +SKIP
    >>> reg.get(digest) == artifact.data  # doctest: +SKIP
    True
"""

from __future__ import annotations

import builtins
import logging
import os
import re
from pathlib import Path

from jaxdist.core.artifacts import digest_of
from jaxdist.core.errors import ArtifactError
from jaxdist.core.store import ArtifactEntry, ArtifactStore, LocalStore, hex_of, write_atomic
from jaxdist.registry.layout import (
    MANIFESTS,
    ManifestEntry,
    Registry,
    find_manifest,
    manifest_filename,
    parse_manifest_filename,
)

__all__ = ["ArtifactEntry", "ArtifactStore", "LocalRegistry", "ManifestEntry", "find_manifest",
           "manifest_filename", "open_registry", "Registry"]

logger = logging.getLogger(__name__)


class LocalRegistry(LocalStore):
    """A registry in a local directory: a :class:`~jaxdist.core.store.LocalStore` of artifacts
    with manifests beside them (see the module docstring).

    Args:
        root: the registry's directory.
        create: create ``root`` if missing; otherwise a missing root is an error (so a typo in
            a path to read from does not look like an empty registry).

    Raises:
        ArtifactError: ``root`` exists and is not a directory, or is missing and not created.

    Example:
        >>> import tempfile
        >>> from jaxdist import LocalRegistry
        >>> reg = LocalRegistry(tempfile.mkdtemp())
        >>> digest = reg.put(b"artifact bytes")  # content-addressed: "sha256:<hex>"
        >>> reg.get(digest), reg.has(digest), reg.list_manifests()
        (b'artifact bytes', True, [])
        >>> from jaxdist.registry.publish import publish
        >>> pub = publish(model, reg, stages=2)  # export a model into it  # doctest: +SKIP
    """

    _what = "registry"

    # -- manifests ---------------------------------------------------------------------------

    def put_manifest(self, data: bytes, name: str) -> ManifestEntry:
        """Store a manifest's bytes as ``manifests/NAME-HEX.json`` (idempotent)."""
        digest = digest_of(bytes(data))
        path = self.root / MANIFESTS / manifest_filename(name, digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_file() and digest_of(path.read_bytes()) == digest):
            write_atomic(path, bytes(data))
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
    reads (:class:`jaxdist.registry.url.UrlRegistry`: ``file://``, ``http(s)://``, ``s3://``, ...).

    Args:
        location: directory or URL.
        create: create a missing local directory (for writing); otherwise it must exist.

    Raises:
        ArtifactError: the location cannot be opened (missing directory, unknown URL scheme, or
            the fsspec backend for it is not installed).
    """
    text = os.fspath(location)
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        from jaxdist.registry.url import UrlRegistry  # fsspec is imported only for URLs

        return UrlRegistry(text, create=create)
    return LocalRegistry(text, create=create)
