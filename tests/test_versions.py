"""jaxdist runs with the versions it is tested with: pyproject's pins, and a check at import."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest

from jaxdist.core import about

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_installed_versions_are_the_tested_ones() -> None:
    assert about.untested_versions() == []
    for dist in about.TESTED:  # the tests ran with each of them, so each must be here
        metadata.version(dist)


def test_pyproject_pins_the_tested_window() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {re.match(r"[A-Za-z0-9_.-]+", d).group(0): d for d in deps}  # type: ignore[union-attr]
    for dist, (low, high) in about.TESTED.items():
        spec = pins[dist].split(";")[0].strip()
        want = f"{dist}=={low}" if low == high else f"{dist}>={low},<{high}"
        assert spec == want, f"pyproject.toml pins {spec!r}; about.TESTED says {want!r}"


def _check_with(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    real = metadata.version
    monkeypatch.setattr(about.metadata, "version",
                        lambda dist: versions.get(dist.replace("-", "_"), None) or real(dist))
    about.check_versions()


@pytest.mark.parametrize(("dist", "found"), [("jax", "0.12.0"), ("jaxlib", "0.10.1"),
                                             ("libggml_python", "0.21.0")])
def test_error_an_untested_version_names_it(monkeypatch: pytest.MonkeyPatch, dist: str,
                                            found: str) -> None:
    monkeypatch.delenv(about.ALLOW_ENV, raising=False)
    name = dist.replace("_", "-")
    low, high = about.TESTED[name]
    with pytest.raises(ImportError) as err:
        _check_with(monkeypatch, **{dist: found})
    msg = str(err.value)
    assert f"{name} {found} is installed" in msg and low in msg and about.ALLOW_ENV in msg, msg
    if low != high:
        assert high in msg


def test_untested_versions_may_be_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(about.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="jax 0.12.0 is installed"):
        _check_with(monkeypatch, jax="0.12.0")


def test_versions_inside_the_window_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(about.ALLOW_ENV, raising=False)
    _check_with(monkeypatch, jax="0.11.2", jaxlib="0.10.2")


def test_the_check_runs_where_jax_internals_are_imported() -> None:
    """A fresh interpreter whose jax reports another version stops at importing the export
    machinery, in one line, before any jax._src import could fail obscurely."""
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda d: '0.99.0' if d == 'jax' else real(d); "
            "import jaxdist.core.artifacts")
    env = {k: v for k, v in os.environ.items() if k != about.ALLOW_ENV}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: jax 0.99.0 is installed; jaxdist") and "0.10.2" in last
