"""The layout every registry shares, and what a registry is.

A registry (:class:`jaxdist.registry.local.LocalRegistry` on disk,
:class:`jaxdist.registry.url.UrlRegistry` behind any fsspec URL) holds::

    ROOT/sha256/ab/abcdef...        the artifact bytes (``ab`` = first two hex digits)
    ROOT/sha256/ab/abcdef....json   optional sidecar metadata
    ROOT/manifests/NAME-HEX.json    manifests (:mod:`jaxdist.registry.manifest`); HEX = sha256 of the file

This module holds the manifest half of that layout (entries, file names, lookup) and the
``Registry`` protocol, so both implementations import it and neither imports the other. The
artifact half is :mod:`jaxdist.core.store`, which a worker's cache uses too.
"""

from __future__ import annotations

import builtins
import dataclasses
import re
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from jaxdist.core.errors import ArtifactError
from jaxdist.core.store import ArtifactStore, hex_of

__all__ = ["MANIFESTS", "ManifestEntry", "Registry", "find_manifest", "manifest_filename",
           "parse_manifest_filename"]

_MANIFEST_FILE_RE = re.compile(r"^(?P<name>.+)-(?P<hex>[0-9a-f]{64})\.json$")
MANIFESTS = "manifests"


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """One stored manifest.

    Attributes:
        name: the model name it was stored under.
        digest: ``sha256:<hex>`` of the manifest file.
        size: bytes.
        mtime: modification time (seconds since the epoch; 0 when the store does not say).
        location: path or URL of the file.
    """

    name: str
    digest: str
    size: int
    mtime: float
    location: str


def manifest_filename(name: str, digest: str) -> str:
    """``NAME-HEX.json``: the file name a manifest is stored under (name made path-safe)."""
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("._") or "model"
    return f"{safe[:100]}-{hex_of(digest)}.json"


def parse_manifest_filename(filename: str) -> tuple[str, str] | None:
    """``(name, digest)`` of a manifest file name, or ``None`` if it is not one."""
    m = _MANIFEST_FILE_RE.match(filename)
    return (m["name"], f"sha256:{m['hex']}") if m else None


def find_manifest(entries: list[ManifestEntry], ref: str, where: str) -> ManifestEntry:
    """Resolve ``ref`` among stored manifests: a file name, a digest or digest prefix (at least
    6 hex digits, ``sha256:`` optional), or a model name (the newest manifest of that name).

    Raises:
        ArtifactError: nothing matches, or a digest prefix is ambiguous.
    """
    ref = ref.strip()
    by_file = [e for e in entries if e.location.rpartition("/")[2] == ref
               or Path(e.location).name == ref]
    if by_file:
        return by_file[0]
    hex_ref = ref.removeprefix("sha256:")
    if re.fullmatch(r"[0-9a-f]{6,64}", hex_ref):
        hits = [e for e in entries if e.digest.removeprefix("sha256:").startswith(hex_ref)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            raise ArtifactError(f"manifest digest prefix {ref!r} is ambiguous in {where}: "
                                f"{', '.join(e.digest[:19] for e in hits)}; give more digits")
    named = sorted((e for e in entries if e.name == ref), key=lambda e: e.mtime)
    if named:
        return named[-1]
    known = sorted({e.name for e in entries})
    raise ArtifactError(f"no manifest {ref!r} in {where}; it holds manifests of "
                        f"{known or 'no model'} (jaxdist registry ls lists them)",
                        code="NOT_FOUND")


@runtime_checkable
class Registry(ArtifactStore, Protocol):
    """An artifact store that also holds manifests: :class:`LocalRegistry` and
    :class:`jaxdist.registry.url.UrlRegistry`."""

    @property
    def location(self) -> str:
        """Where the registry is (a path or URL)."""
        ...

    @property
    def writable(self) -> bool:
        """Whether put/delete are allowed."""
        ...

    def meta(self, digest: str) -> dict[str, Any] | None:
        """The artifact's sidecar metadata, or ``None``."""
        ...

    def put_manifest(self, data: bytes, name: str) -> ManifestEntry:
        ...

    def get_manifest(self, digest: str) -> bytes:
        ...

    def list_manifests(self) -> builtins.list[ManifestEntry]:
        ...

    def find_manifest(self, ref: str) -> ManifestEntry:
        ...

    def delete_manifest(self, digest: str) -> None:
        ...
