"""The installed package holds every module: pyproject.toml lists each package of the tree.

An editable install (``pip install -e .``, what the tests run on) finds every module whatever
the list says, so a package left out of it would break only a wheel (a container image, a
plain ``pip install``); this test catches that here.
"""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config["package-dir"]
    found = set()
    for top, folder in dirs.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            found.add(".".join((top, *init.parent.relative_to(base).parts)))
    assert set(config["packages"]) == found
