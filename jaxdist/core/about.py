"""What a ``--version`` prints: this jaxdist and the jax it runs on, read without importing jax.

Example:
    >>> version_line("jaxdist").startswith("jaxdist ")
    True
"""

from __future__ import annotations

import sys
from importlib import metadata

__all__ = ["version_line"]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_line(program: str) -> str:
    """``PROGRAM 0.1.0 (jax 0.10.2, jaxlib 0.10.2, python 3.11.7)``."""
    return (f"{program} {_version('jaxdist')} (jax {_version('jax')}, jaxlib "
            f"{_version('jaxlib')}, python {sys.version.split()[0]})")
