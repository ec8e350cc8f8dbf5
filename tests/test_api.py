"""The public API: every name in ``jaxdist.__all__`` has a docstring with an example, and the
examples run (those that need workers or model files say ``# doctest: +SKIP``)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pathlib
import tempfile

import jax
import numpy as np
import pytest

import jaxdist

CONSTANTS = {"__version__", "SPEC_VERSION"}  # values: they carry no docstring of their own
NAMES = sorted(set(jaxdist.__all__) - CONSTANTS)


def test_all_is_the_facade() -> None:
    assert set(jaxdist.__all__) == set(jaxdist._EXPORTS) | {"__version__"}
    assert all(getattr(jaxdist, n) is not None for n in jaxdist.__all__)


@pytest.mark.parametrize("name", NAMES)
def test_public_name_has_a_running_example(name: str, tmp_path: pathlib.Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    obj = getattr(jaxdist, name)
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"jaxdist.{name} has no example in its docstring"
    module = importlib.import_module(jaxdist._EXPORTS[name])
    globs = {**vars(module), **{n: getattr(jaxdist, n) for n in NAMES}, "np": np, "jax": jax}
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, module=module, globs=globs)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # an example that writes a file writes it here
    # ... and its tempfile.mkdtemp() too: a reader's example need not clean up after itself.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        for test in tests:
            runner.run(test)
    finally:
        os.chdir(cwd)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"the example of jaxdist.{name} failed (output above)"
