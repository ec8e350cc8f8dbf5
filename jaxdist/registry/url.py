"""A registry at a URL: the layout of :mod:`jaxdist.registry.local`, read (and written) through fsspec.

Any URL that ``fsspec`` can open is a registry: ``file:///srv/registry``, ``http://host/registry``
(any static file server over a registry directory; ``python -m http.server`` will do), and
``s3://bucket/registry`` or ``gs://bucket/registry`` when ``s3fs`` or ``gcsfs`` is installed.
jaxdist tests ``file://`` and ``http://``; S3, GCS and the rest are fsspec's own business.

Every read is checked: the bytes of an artifact or a manifest must hash to the digest they are
stored under, or the read fails with an :class:`~jaxdist.core.errors.ArtifactError` that names the
digest and the URL. A server or a cache that hands back damaged or substituted bytes is caught
before a worker sees them.

HTTP registries are read-only (a plain web server has no write verb that fsspec can rely on):
export into a directory, ``file://`` or a writable object store, and serve that. Listing
(``jaxdist registry ls``) over HTTP works where the server lists directories as HTML links, as
``http.server``, nginx's ``autoindex`` and Apache do; fetching by digest needs no listing.
"""

from __future__ import annotations

import builtins
import json
import logging
import uuid
from collections.abc import Mapping
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import Any

from jaxdist.core.errors import ArtifactError
from jaxdist.core.store import ArtifactEntry, hex_of
from jaxdist.core.vetting import digest_of
from jaxdist.registry.layout import (
    MANIFESTS,
    ManifestEntry,
    find_manifest,
    manifest_filename,
    parse_manifest_filename,
)

__all__ = ["UrlRegistry", "read_url"]

log = logging.getLogger(__name__)

_READ_ONLY = ("http", "https")


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:  # a dependency of jaxdist; only a broken install lacks it
        raise ArtifactError(f"registry {url}: URL registries need fsspec (pip install fsspec)"
                            ) from None
    try:
        fs_path: tuple[Any, str] = fsspec.core.url_to_fs(url)
        return fs_path
    except (ImportError, ValueError) as exc:
        scheme = url.partition("://")[0]
        hint = {"http": "aiohttp", "https": "aiohttp", "s3": "s3fs", "gs": "gcsfs",
                "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(scheme, "")
        extra = f" (pip install {hint})" if hint else ""
        raise ArtifactError(f"registry {url}: fsspec cannot open {scheme}:// URLs: {exc}"
                            f"{extra}") from None


def read_url(url: str) -> bytes:
    """The bytes at ``url`` (any fsspec URL).

    Raises:
        ArtifactError: missing or unreadable.
    """
    fs, path = _filesystem(url)
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise ArtifactError(f"{url}: not found", code="NOT_FOUND") from None
    except OSError as exc:
        raise ArtifactError(f"{url}: cannot read: {exc}", code="UNAVAILABLE") from None


def _mtime(info: Mapping[str, Any]) -> float:
    """Modification time from an fsspec info dict, whatever the backend calls it."""
    http_date = info.get("Last-Modified")
    if isinstance(http_date, str):
        try:
            return parsedate_to_datetime(http_date).timestamp()
        except (TypeError, ValueError):
            pass
    for key in ("mtime", "LastModified", "updated", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


class UrlRegistry:
    """A registry at an fsspec URL (see the module docstring).

    Args:
        url: e.g. ``file:///srv/registry``, ``http://127.0.0.1:8000/registry``.
        create: for a writable filesystem, create the root if missing.

    Raises:
        ArtifactError: fsspec cannot open the URL (unknown scheme or missing backend).
    """

    def __init__(self, url: str, *, create: bool = False) -> None:
        self.url = url.rstrip("/")
        self.fs, root = _filesystem(self.url)
        self.root = root.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (
            self.fs.protocol,)
        self.writable = not any(p in _READ_ONLY for p in protocols)
        self._local = "file" in protocols or "local" in protocols
        if create and self.writable:
            self.fs.makedirs(f"{self.root}/sha256", exist_ok=True)

    @property
    def location(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"UrlRegistry({self.url!r})"

    # -- paths ---------------------------------------------------------------------------------

    def _rel(self, hex_digest: str) -> str:
        return f"sha256/{hex_digest[:2]}/{hex_digest}"

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def url_of(self, digest: str) -> str:
        """The URL ``digest`` is (or would be) stored at."""
        return f"{self.url}/{self._rel(hex_of(digest))}"

    # -- reading and writing -------------------------------------------------------------------

    def _read(self, rel: str, what: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(rel)))
        except FileNotFoundError:
            raise ArtifactError(f"{what} not in registry {self.url} (no {self.url}/{rel})",
                                code="NOT_FOUND") from None
        except OSError as exc:
            raise ArtifactError(f"{what}: cannot read {self.url}/{rel}: {exc}",
                                code="UNAVAILABLE") from None

    def _write(self, rel: str, data: bytes) -> None:
        if not self.writable:
            raise ArtifactError(
                f"registry {self.url} is read-only: HTTP registries are served, not written. "
                f"Export into a directory, a file:// URL or a writable object store (s3://, "
                f"gs://) and serve that directory over HTTP")
        path = self._path(rel)
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        if self._local:
            # Readers see the old file or the whole new one: write aside, then rename.
            tmp = f"{path.rpartition('/')[0]}/.tmp-{uuid.uuid4().hex}"
            self.fs.pipe_file(tmp, data)
            try:
                self.fs.mv(tmp, path)
            finally:
                if self.fs.exists(tmp):
                    self.fs.rm(tmp)
        else:  # object stores replace an object atomically on PUT
            self.fs.pipe_file(path, data)

    def put(self, data: bytes, meta: Mapping[str, Any] | None = None) -> str:
        """Store ``data`` (and its metadata sidecar); see :meth:`LocalRegistry.put`.

        Raises:
            ArtifactError: the registry is read-only (HTTP), or ``meta`` is not JSON.
        """
        data = bytes(data)
        digest = digest_of(data)
        rel = self._rel(hex_of(digest))
        text = None
        if meta is not None:
            try:
                text = json.dumps(dict(meta), indent=1, sort_keys=True).encode()
            except (TypeError, ValueError) as exc:
                raise ArtifactError(f"metadata for artifact {digest} is not JSON-serializable: "
                                    f"{exc}") from exc
        if not self.has(digest) or digest_of(self._read(rel, f"artifact {digest}")) != digest:
            self._write(rel, data)
            log.info("stored artifact %s (%d bytes) in %s", digest, len(data), self.url)
        if text is not None:
            self._write(rel + ".json", text)
        return digest

    def get(self, digest: str) -> bytes:
        """Read an artifact and check its digest.

        Raises:
            ArtifactError: malformed digest, missing, unreadable, or the bytes hash to another
                digest (the message names the digest and the URL).
        """
        rel = self._rel(hex_of(digest))
        data = self._read(rel, f"artifact {digest}")
        found = digest_of(data)
        if found != digest:
            raise ArtifactError(
                f"artifact {digest} from {self.url}/{rel} is corrupt: its {len(data)} bytes hash "
                f"to {found}. The registry copy is damaged or was replaced; export or copy it "
                f"again")
        return data

    def has(self, digest: str) -> bool:
        try:
            return bool(self.fs.exists(self._path(self._rel(hex_of(digest)))))
        except OSError as exc:
            raise ArtifactError(f"registry {self.url}: cannot check {digest}: {exc}",
                                code="UNAVAILABLE") from None

    def meta(self, digest: str) -> dict[str, Any] | None:
        """The artifact's sidecar metadata, or ``None`` if it has none.

        Raises:
            ArtifactError: the artifact is missing, or the sidecar is not JSON.
        """
        rel = self._rel(hex_of(digest))
        if not self.has(digest):
            raise ArtifactError(f"artifact {digest} not in registry {self.url}",
                                code="NOT_FOUND")
        try:
            text = self._read(rel + ".json", f"metadata of {digest}")
        except ArtifactError as exc:
            if exc.code == "NOT_FOUND":
                return None
            raise
        try:
            meta: dict[str, Any] = json.loads(text)
            return meta
        except ValueError as exc:
            raise ArtifactError(f"metadata of artifact {digest} at {self.url}/{rel}.json is not "
                                f"valid JSON: {exc}") from None

    def _find(self, rel_dir: str) -> dict[str, Mapping[str, Any]]:
        try:
            found: dict[str, Mapping[str, Any]] = self.fs.find(self._path(rel_dir), detail=True)
        except FileNotFoundError:
            return {}
        except (OSError, NotImplementedError) as exc:
            raise ArtifactError(f"registry {self.url}: cannot list {rel_dir}/ ({exc}); the "
                                f"server must list directories (an HTML index) for ls and gc; "
                                f"fetching by digest works without") from None
        for path, info in found.items():
            if info.get("size") is None:  # HTTP listings are links only: ask each file
                try:
                    found[path] = {**info, **self.fs.info(path)}
                except OSError:
                    pass
        return found

    def list(self) -> builtins.list[ArtifactEntry]:
        """Every artifact, sorted by digest (needs a listable filesystem; see module doc)."""
        entries = []
        for path, info in self._find("sha256").items():
            name = path.rstrip("/").rpartition("/")[2]
            if len(name) == 64 and all(c in "0123456789abcdef" for c in name):
                entries.append(ArtifactEntry(f"sha256:{name}", int(info.get("size") or 0),
                                             _mtime(info)))
        return sorted(entries, key=lambda e: e.digest)

    def delete(self, digest: str) -> None:
        rel = self._rel(hex_of(digest))
        if not self.writable:
            self._write(rel, b"")  # raises the read-only error
        if not self.has(digest):
            raise ArtifactError(f"artifact {digest} not in registry {self.url}", code="NOT_FOUND")
        self.fs.rm(self._path(rel))
        if self.fs.exists(self._path(rel + ".json")):
            self.fs.rm(self._path(rel + ".json"))

    # -- manifests -----------------------------------------------------------------------------

    def put_manifest(self, data: bytes, name: str) -> ManifestEntry:
        data = bytes(data)
        digest = digest_of(data)
        rel = f"{MANIFESTS}/{manifest_filename(name, digest)}"
        self._write(rel, data)
        return ManifestEntry(name, digest, len(data), 0.0, f"{self.url}/{rel}")

    def list_manifests(self) -> builtins.list[ManifestEntry]:
        entries = []
        for path, info in self._find(MANIFESTS).items():
            filename = path.rstrip("/").rpartition("/")[2]
            parsed = parse_manifest_filename(filename)
            if parsed is not None:
                entries.append(ManifestEntry(parsed[0], parsed[1], int(info.get("size") or 0),
                                             _mtime(info), f"{self.url}/{MANIFESTS}/{filename}"))
        return sorted(entries, key=lambda e: (e.mtime, e.name))

    def find_manifest(self, ref: str) -> ManifestEntry:
        return find_manifest(self.list_manifests(), ref, f"registry {self.url}")

    def get_manifest(self, digest: str) -> bytes:
        """A manifest's bytes, checked against its digest (needs a listing to find its name)."""
        entry = next((e for e in self.list_manifests() if e.digest == digest), None)
        if entry is None:
            raise ArtifactError(f"manifest {digest} not in registry {self.url}", code="NOT_FOUND")
        rel = entry.location[len(self.url) + 1:]
        data = self._read(rel, f"manifest {digest}")
        if digest_of(data) != digest:
            raise ArtifactError(f"manifest {digest} from {entry.location} is corrupt: its bytes "
                                f"hash to {digest_of(data)}. Export it again")
        return data

    def delete_manifest(self, digest: str) -> None:
        entries = [e for e in self.list_manifests() if e.digest == digest]
        if not entries:
            raise ArtifactError(f"manifest {digest} not in registry {self.url}", code="NOT_FOUND")
        for e in entries:
            rel = e.location[len(self.url) + 1:]
            if not self.writable:
                self._write(rel, b"")  # raises the read-only error
            self.fs.rm(self._path(rel))
