"""The type check of ``make typecheck`` (run by CI): mypy over the package as it is installed.

``worker/`` and ``exporters/`` are installed as ``jaxdist.worker`` and ``jaxdist.exporters``
(``package-dir`` in ``pyproject.toml``), a mapping mypy does not know: given the folders, it
checks them as modules ``worker.*`` and ``exporters.*``, and every ``import jaxdist.worker...``
elsewhere resolves to nothing (``Any``, silently, under ``ignore_missing_imports``). So this
builds the installed layout out of symlinks under ``build/typecheck/`` (``jaxdist/`` with
``worker`` and ``exporters`` inside it), runs ``mypy -p jaxdist`` there with the project's
config, and prints each reported path as the file in the repository.

Usage::

    python scripts/typecheck.py [mypy options]
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
MOUNTED = {"worker": "worker", "exporters": "exporters"}  # jaxdist.<name> -> folder at the top


def build_tree() -> pathlib.Path:
    """``build/typecheck/jaxdist``: the installed package, made of symlinks to the sources."""
    pkg = TREE / "jaxdist"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for entry in sorted((ROOT / "jaxdist").iterdir()):
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    for name, folder in MOUNTED.items():
        (pkg / name).symlink_to(ROOT / folder)
    return pkg


def repo_path(line: str) -> str:
    """A line of mypy's output with its path as the file in the repository."""
    for name, folder in MOUNTED.items():
        prefix = f"jaxdist/{name}/"
        if line.startswith(prefix):
            return folder + "/" + line[len(prefix):]
    return line


def main(argv: list[str]) -> int:
    build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "--cache-dir", str(TREE / ".mypy_cache"), "-p", "jaxdist", *argv]
    proc = subprocess.run(cmd, cwd=TREE, capture_output=True, text=True,
                          env={**os.environ, "MYPYPATH": ""})
    for line in proc.stdout.splitlines():
        print(repo_path(line))
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
