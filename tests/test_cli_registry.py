"""``jaxdist registry ls | show | gc`` on a directory and over HTTP."""

from __future__ import annotations

import json
import pathlib

import pytest
from deploy_utils import assert_one_line_error, cli, serve_directory
from models import mlp

from jaxdist.registry.local import LocalRegistry
from jaxdist.registry.publish import Published, publish


@pytest.fixture
def reg(tmp_path: pathlib.Path) -> tuple[pathlib.Path, Published, str]:
    root = tmp_path / "reg"
    pub = publish(mlp(), root, stages=2, platforms=("cpu",), model_path="mlp.safetensors")
    stray = LocalRegistry(root).put(b"orphan bytes")
    return root, pub, stray


def test_ls(reg: tuple[pathlib.Path, Published, str]) -> None:
    root, pub, stray = reg
    proc = cli("registry", "ls", "--registry", str(root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for digest in pub.manifest.digests:
        (row,) = [line for line in lines if digest in line]
        assert row.split()[-1] == "1"  # used by one manifest
    (row,) = [line for line in lines if stray in line]
    assert row.split()[-1] == "0" and "B" in row
    assert any(line.split()[:2] == ["mlp", pub.digest[:19]] for line in lines)
    doc = json.loads(cli("registry", "ls", "--registry", str(root), "--json").stdout)
    assert {a["digest"]: a["manifests"] for a in doc["artifacts"]} == {
        **{d: 1 for d in pub.manifest.digests}, stray: 0}
    assert [m["digest"] for m in doc["manifests"]] == [pub.digest]


def test_ls_and_show_over_http(reg: tuple[pathlib.Path, Published, str]) -> None:
    root, pub, _ = reg
    with serve_directory(root.parent) as base:
        ls = cli("registry", "ls", "--registry", f"{base}/reg", "--json")
        show = cli("registry", "show", pub.manifest.digests[1][7:20], "--registry",
                   f"{base}/reg")
    assert {a["digest"] for a in json.loads(ls.stdout)["artifacts"]} >= set(pub.manifest.digests)
    assert show.returncode == 0, show.stderr
    assert f"artifact {pub.manifest.digests[1]}" in show.stdout and "verified" in show.stdout


def test_show_artifact_and_manifest(reg: tuple[pathlib.Path, Published, str]) -> None:
    root, pub, stray = reg
    proc = cli("registry", "show", pub.manifest.digests[0], "--registry", str(root))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "platforms:    cpu" in out and "inputs:       x float32[b, 32]" in out
    assert "params:       2 (l0.w .. l1.w)" in out and "custom calls: shape_assertion" in out
    meta = json.loads(cli("registry", "show", pub.manifest.digests[0], "--registry", str(root),
                          "--json").stdout)["meta"]
    assert meta == LocalRegistry(root).meta(pub.manifest.digests[0])
    manifest = cli("registry", "show", "mlp", "--registry", str(root))
    assert manifest.stdout == pathlib.Path(pub.location).read_text()
    bare = cli("registry", "show", stray, "--registry", str(root))
    assert "no metadata sidecar" in bare.stdout


def test_gc(reg: tuple[pathlib.Path, Published, str]) -> None:
    root, pub, stray = reg
    dry = cli("registry", "gc", "--registry", str(root), "--dry-run", "--min-age", "0")
    assert f"would delete {stray}" in dry.stdout and LocalRegistry(root).has(stray)
    young = cli("registry", "gc", "--registry", str(root))  # default --min-age keeps it
    assert "deleted 0 unreferenced" in young.stdout and "kept 1 younger" in young.stdout
    gone = cli("registry", "gc", "--registry", str(root), "--min-age", "0", "--json")
    assert json.loads(gone.stdout)["deleted"] == [stray]
    reg_now = LocalRegistry(root)
    assert not reg_now.has(stray) and all(reg_now.has(d) for d in pub.manifest.digests)


def test_error_show_unknown(reg: tuple[pathlib.Path, Published, str]) -> None:
    assert_one_line_error(cli("registry", "show", "zzzz", "--registry", str(reg[0])),
                          "nothing named 'zzzz' in registry")


def test_error_gc_over_http(reg: tuple[pathlib.Path, Published, str]) -> None:
    with serve_directory(reg[0].parent) as base:
        proc = cli("registry", "gc", "--registry", f"{base}/reg", "--min-age", "0")
    assert_one_line_error(proc, "is read-only (HTTP)")


def test_error_ls_missing_registry(tmp_path: pathlib.Path) -> None:
    assert_one_line_error(cli("registry", "ls", "--registry", str(tmp_path / "none")),
                          "does not exist")
