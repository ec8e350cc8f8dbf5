"""What a ``--version`` prints, and the versions jaxdist is tested with: read without importing jax.

jaxdist reaches inside jax (``jax._src``'s export serialization and config, the compilation
cache's file layout) and its parity tests depend on ggml's kernels, so it runs only with the
versions it was tested with (:data:`TESTED`, the same window as ``pyproject.toml``'s pins).
:func:`check_versions` is called where those internals are imported, so another version fails
at import, in one line naming the package, the version found and the window;
``JAXDIST_ALLOW_UNTESTED_VERSIONS=1`` turns that into a warning, to try another version.

Example:
    >>> version_line("jaxdist").startswith("jaxdist ")
    True
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from importlib import metadata

__all__ = ["ALLOW_ENV", "TESTED", "check_versions", "untested_versions", "version_line"]

TESTED: dict[str, tuple[str, str]] = {
    # CI runs every test with 0.10.2; the GPU machine's 0.11.2 ran workers (README, "What has
    # run where")
    "jax": ("0.10.2", "0.12"),
    "jaxlib": ("0.10.2", "0.12"),
    "libggml-python": ("0.20.2.post1", "0.20.2.post1"),
}
"""package -> (lowest, highest) tested: ``lowest <= version < highest``, or exactly ``lowest``
where the two are equal. ``pyproject.toml`` pins the same (tests/test_versions.py checks)."""

ALLOW_ENV = "JAXDIST_ALLOW_UNTESTED_VERSIONS"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_line(program: str) -> str:
    """``PROGRAM 0.1.0 (jax 0.10.2, jaxlib 0.10.2, python 3.11.7)``."""
    return (f"{program} {_version('jaxdist')} (jax {_version('jax')}, jaxlib "
            f"{_version('jaxlib')}, python {sys.version.split()[0]})")


def _key(version: str) -> tuple[int, ...]:
    """The numeric release of a version (``0.10.2rc1`` -> ``(0, 10, 2)``)."""
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0].split("rc")[0]
                                                       .split("dev")[0].split("post")[0])[:3])


def untested_versions() -> list[str]:
    """One line per installed package of :data:`TESTED` outside its window (a package that
    is not installed is not listed: whoever needs it says so)."""
    out = []
    for dist, (low, high) in TESTED.items():
        try:
            found = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        ok = found == low if low == high else _key(low) <= _key(found) < _key(high)
        if not ok:
            window = f"== {low}" if low == high else f">= {low}, < {high}"
            out.append(f"{dist} {found} is installed; jaxdist {_version('jaxdist')} is tested "
                       f"with {dist} {window}")
    return out


def check_versions() -> None:
    """Refuse, at import, the versions jaxdist was not tested with (see the module docstring).

    Raises:
        ImportError: a package of :data:`TESTED` is outside its window, naming it, the version
            found, the window, the fix and :data:`ALLOW_ENV`.
    """
    bad = untested_versions()
    if not bad:
        return
    message = (f"{'; '.join(bad)}. Install the tested versions (pip install 'jaxdist[...]' "
               f"resolves them), or set {ALLOW_ENV}=1 to try these")
    if os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes"):
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise ImportError(message)
