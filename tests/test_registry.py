"""Tests for jaxdist.registry.local.LocalRegistry."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jaxdist.core.artifacts import digest_of, export_stage, load_artifact
from jaxdist.core.errors import ArtifactError
from jaxdist.registry.local import (
    ArtifactEntry,
    ArtifactStore,
    LocalRegistry,
    ManifestEntry,
    find_manifest,
)

A = b"artifact A " * 100
B = b"artifact B"


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp-")]


def test_is_an_artifact_store(tmp_path: Path) -> None:
    assert isinstance(LocalRegistry(tmp_path), ArtifactStore)


def test_put_get_has_list_delete(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path / "reg")
    da, db = reg.put(A), reg.put(B)
    assert da == digest_of(A) and db == digest_of(B)
    hexa = da.removeprefix("sha256:")
    assert (tmp_path / "reg" / "sha256" / hexa[:2] / hexa).read_bytes() == A
    assert reg.get(da) == A and reg.get(db) == B
    assert reg.has(da) and reg.has(db)
    entries = reg.list()
    assert [e.digest for e in entries] == sorted([da, db])
    assert {e.digest: e.size for e in entries} == {da: len(A), db: len(B)}
    assert all(isinstance(e, ArtifactEntry) and e.mtime > 0 for e in entries)
    reg.delete(da)
    assert not reg.has(da)
    assert [e.digest for e in reg.list()] == [db]


def test_put_is_idempotent(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    digest = reg.put(A)
    path = reg.path_of(digest)
    before = path.stat().st_mtime_ns
    assert reg.put(A) == digest
    assert path.stat().st_mtime_ns == before  # not rewritten
    assert len(reg.list()) == 1


def test_put_heals_a_corrupt_file(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    digest = reg.put(A)
    path = reg.path_of(digest)
    path.write_bytes(b"X" + A[1:])
    reg.put(A)
    assert reg.get(digest) == A


def test_sidecar_meta(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    digest = reg.put(A, meta={"platforms": ["cpu"], "outputs": [{"name": "y"}]})
    assert reg.meta(digest) == {"platforms": ["cpu"], "outputs": [{"name": "y"}]}
    assert reg.meta(reg.put(B)) is None
    assert len(reg.list()) == 2  # sidecars are not artifacts
    reg.delete(digest)
    assert not reg.path_of(digest).with_name(reg.path_of(digest).name + ".json").exists()


def test_round_trip_real_artifact(tmp_path: Path) -> None:
    art = export_stage(lambda p, s, x: ({"y": x["x"] * p["w"]}, {}),
                       params={"w": ((4,), "float32")}, inputs={"x": ("b, 4", "float32")},
                       platforms=("cpu",))
    reg = LocalRegistry(tmp_path)
    assert reg.put(art.data, meta=art.meta.to_dict()) == art.digest
    exported = load_artifact(reg.get(art.digest), expected_digest=art.digest, platform="cpu")
    assert exported.platforms == ("cpu",)
    assert reg.meta(art.digest)["inputs"][0]["dims"] == ["b", 4]  # a constant dim is an int


def test_atomic_write_leaves_no_temp_files(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    reg.put(A, meta={"k": 1})
    reg.put(B)
    reg.put(A, meta={"k": 2})
    assert _temp_files(tmp_path) == []


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = LocalRegistry(tmp_path)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        reg.put(A)
    monkeypatch.undo()
    assert _temp_files(tmp_path) == []
    assert not reg.has(digest_of(A))
    assert reg.list() == []


def test_error_corrupt_on_read(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    digest = reg.put(A)
    path = reg.path_of(digest)
    damaged = bytearray(path.read_bytes())
    damaged[7] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(ArtifactError) as info:
        reg.get(digest)
    message = str(info.value)
    assert f"artifact {digest} in registry at {tmp_path} is corrupt" in message
    assert f"hashes to {digest_of(bytes(damaged))}" in message
    assert "Delete it and put the artifact again" in message


def test_error_missing(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    digest = digest_of(b"never stored")
    with pytest.raises(ArtifactError, match=f"artifact {digest} not in registry at {tmp_path}"):
        reg.get(digest)
    with pytest.raises(ArtifactError, match="not in registry"):
        reg.delete(digest)
    with pytest.raises(ArtifactError, match="not in registry"):
        reg.meta(digest)
    assert not reg.has(digest)


@pytest.mark.parametrize(
    "digest",
    ["", "sha256:", "sha256:abc", "md5:" + "0" * 64, "sha256:" + "G" * 64, "sha256:" + "A" * 64,
     "sha256:../../etc/passwd", "0" * 64],
)
def test_error_malformed_digest(tmp_path: Path, digest: str) -> None:
    reg = LocalRegistry(tmp_path)
    for call in (reg.get, reg.has, reg.delete, reg.meta):
        with pytest.raises(ArtifactError) as info:
            call(digest)
        message = str(info.value)
        assert f"artifact digest {digest!r} is malformed" in message
        assert "expected 'sha256:' followed by 64 lowercase hex digits" in message


def test_error_meta_not_json(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    with pytest.raises(ArtifactError, match="is not JSON-serializable"):
        reg.put(A, meta={"x": object()})
    assert reg.list() == []  # nothing stored when the metadata is bad
    digest = reg.put(A, meta={"ok": True})
    sidecar = reg.path_of(digest).with_name(reg.path_of(digest).name + ".json")
    sidecar.write_text("{broken")
    with pytest.raises(ArtifactError, match="is not valid JSON"):
        reg.meta(digest)


def test_error_root_is_a_file(tmp_path: Path) -> None:
    root = tmp_path / "file"
    root.write_text("x")
    with pytest.raises(ArtifactError, match="exists and is not a directory"):
        LocalRegistry(root)


# --- manifests (the layout every registry shares; see also test_urlregistry.py)

M1, M2 = b'{"manifest_version": 1, "n": 1}\n', b'{"manifest_version": 1, "n": 2}\n'


def test_manifests_put_find_get_delete(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    e1 = reg.put_manifest(M1, "my model/v1")
    assert Path(e1.location) == tmp_path / "manifests" / f"my_model_v1-{digest_of(M1)[7:]}.json"
    assert reg.put_manifest(M1, "my model/v1") == e1  # idempotent
    e2 = reg.put_manifest(M2, "my model/v1")
    os.utime(e1.location, (1, 1))  # e1 older: a name means its newest manifest
    assert [e.digest for e in reg.list_manifests()] == [e1.digest, e2.digest]
    assert reg.find_manifest("my_model_v1").digest == e2.digest
    assert reg.find_manifest(e1.digest[7:13]).digest == e1.digest
    assert reg.find_manifest(Path(e1.location).name).digest == e1.digest
    assert reg.get_manifest(e1.digest) == M1
    reg.delete_manifest(e1.digest)
    assert [e.digest for e in reg.list_manifests()] == [e2.digest]
    assert reg.list() == []  # manifests are not artifacts


def test_error_corrupt_manifest(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    e = reg.put_manifest(M1, "m")
    Path(e.location).write_bytes(M2)
    with pytest.raises(ArtifactError, match=f"manifest {e.digest} in registry at {tmp_path} is "
                                            f"corrupt"):
        reg.get_manifest(e.digest)


def test_error_manifest_ref_ambiguous_or_unknown() -> None:
    entries = [ManifestEntry("m", "sha256:" + h * 64, 1, 0.0, f"/r/manifests/m-{h * 64}.json")
               for h in ("a", "b")] + [
        ManifestEntry("n", "sha256:" + "a" * 63 + "c", 1, 0.0, "/r/manifests/n.json")]
    assert find_manifest(entries, "bbbbbb", "registry r").digest == "sha256:" + "b" * 64
    with pytest.raises(ArtifactError, match="manifest digest prefix 'aaaaaa' is ambiguous in "
                                            "registry r"):
        find_manifest(entries, "aaaaaa", "registry r")
    with pytest.raises(ArtifactError, match=r"no manifest 'zzz' in registry r; it holds "
                                            r"manifests of \['m', 'n'\]"):
        find_manifest(entries, "zzz", "registry r")


def test_registry_files_are_world_readable(tmp_path: Path) -> None:
    reg = LocalRegistry(tmp_path)
    path = reg.path_of(reg.put(A))
    assert path.stat().st_mode & 0o777 == 0o644  # a web server may serve it as another user
