"""Tests for jaxdist.registry.url: the registry layout read through fsspec, over file:// and over
a real HTTP server (http.server in a thread on 127.0.0.1)."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from deploy_utils import serve_directory

from jaxdist.core.errors import ArtifactError
from jaxdist.core.vetting import digest_of
from jaxdist.registry.local import LocalRegistry, open_registry
from jaxdist.registry.url import UrlRegistry, read_url

A, B = b"artifact A " * 50, b"artifact B"
META = {"platforms": ["cpu"], "inputs": [{"name": "x", "dtype": "float32", "dims": ["b", "4"]}]}
MANIFEST = b'{"manifest_version": 1}\n'


@pytest.fixture(scope="module")
def reg_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("served") / "reg"
    reg = LocalRegistry(root)
    reg.put(A, meta=META)
    reg.put(B)
    reg.put_manifest(MANIFEST, "tiny")
    return root


@pytest.fixture(scope="module")
def http_base(reg_dir: pathlib.Path) -> Iterator[str]:
    with serve_directory(reg_dir.parent) as base:
        yield base


@pytest.fixture(params=["file", "http"])
def url(request: pytest.FixtureRequest, reg_dir: pathlib.Path, http_base: str) -> str:
    return reg_dir.as_uri() if request.param == "file" else f"{http_base}/reg"


def test_reads(url: str) -> None:
    reg = open_registry(url)
    assert isinstance(reg, UrlRegistry) and reg.location == url
    da, db = digest_of(A), digest_of(B)
    assert reg.get(da) == A and reg.get(db) == B
    assert reg.has(da) and not reg.has(digest_of(b"nope"))
    assert reg.meta(da) == META and reg.meta(db) is None
    entries = reg.list()
    assert [e.digest for e in entries] == sorted([da, db])
    assert {e.digest: e.size for e in entries} == {da: len(A), db: len(B)}
    assert all(e.mtime > 0 for e in entries)


def test_manifests(url: str) -> None:
    reg = open_registry(url)
    (entry,) = reg.list_manifests()
    assert entry.name == "tiny" and entry.digest == digest_of(MANIFEST)
    assert entry.location == f"{url}/manifests/tiny-{digest_of(MANIFEST)[7:]}.json"
    assert reg.find_manifest("tiny") == entry == reg.find_manifest(entry.digest[7:15])
    assert reg.get_manifest(entry.digest) == MANIFEST
    assert read_url(entry.location) == MANIFEST


def test_file_url_writes(tmp_path: pathlib.Path) -> None:
    reg = open_registry((tmp_path / "w").as_uri(), create=True)
    assert reg.writable
    d = reg.put(A, meta=META)
    entry = reg.put_manifest(MANIFEST, "m")
    local = LocalRegistry(tmp_path / "w")  # the same layout as a directory registry
    assert local.get(d) == A and local.meta(d) == META
    assert local.get_manifest(entry.digest) == MANIFEST
    assert not [p for p in (tmp_path / "w").rglob(".tmp-*")]
    reg.delete(d)
    reg.delete_manifest(entry.digest)
    assert not local.has(d) and local.list_manifests() == []


def test_error_http_is_read_only(http_base: str) -> None:
    reg = open_registry(f"{http_base}/reg")
    assert not reg.writable
    for write in (lambda: reg.put(b"new"), lambda: reg.put_manifest(MANIFEST, "x"),
                  lambda: reg.delete(digest_of(A))):
        with pytest.raises(ArtifactError, match=rf"registry {http_base}/reg is read-only: HTTP "
                                                r"registries are served, not written"):
            write()


def test_error_corrupt_artifact_names_digest_and_url(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "reg"
    digest = LocalRegistry(root).put(A)
    path = LocalRegistry(root).path_of(digest)
    path.write_bytes(b"X" + A[1:])
    found = digest_of(b"X" + A[1:])
    with serve_directory(tmp_path) as base:
        for url in (f"{base}/reg", root.as_uri()):
            with pytest.raises(ArtifactError) as info:
                open_registry(url).get(digest)
            msg = str(info.value)
            assert f"artifact {digest} from {url}/sha256/{digest[7:9]}/{digest[7:]} is corrupt" in (
                msg)
            assert f"hash to {found}" in msg


def test_error_missing_artifact_names_url(url: str) -> None:
    missing = digest_of(b"nope")
    with pytest.raises(ArtifactError, match=rf"artifact {missing} not in registry {url} \(no "
                                            rf"{url}/sha256/") as info:
        open_registry(url).get(missing)
    assert info.value.code == "NOT_FOUND"


def test_error_unknown_scheme() -> None:
    with pytest.raises(ArtifactError, match=r"registry nosuch://x: fsspec cannot open nosuch:// "
                                            r"URLs"):
        open_registry("nosuch://x")


def test_error_missing_local_registry(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ArtifactError, match=r"artifact registry .*/absent does not exist"):
        open_registry(tmp_path / "absent")
