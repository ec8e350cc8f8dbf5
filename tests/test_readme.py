"""Every ```python block of README.md runs as written and prints what its comments say.

The convention the README follows (its "Using it" section says so too):

- Each block runs alone, in a fresh interpreter and an empty directory. It makes the files it
  needs and starts its own workers (``Cluster.local``); nothing carries over between blocks.
- A ``print(...)`` whose line ends in a comment shows what it prints: ``# (8, 256) 16``. The
  printed lines must match those comments in order. ``<...>`` in a comment stands for any text
  (a digest, an id).

Blocks in other languages (``bash``, ``text``) are not run. A block that cannot run here (it
needs a GPU, say) is marked ``text``, and the prose says why.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, source) of every ```python block, in order."""
    blocks: list[tuple[int, str]] = []
    lang: str | None = None
    start, lines = 0, []
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m is None:
            if lang is not None:
                lines.append(line)
            continue
        if lang is None:  # an opening fence
            lang, start, lines = m.group(1), no + 1, []
        else:  # a closing fence
            if lang == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            lang = None
    assert lang is None, f"README.md: the block opened on line {start - 1} is never closed"
    return blocks


def expected_output(source: str) -> list[re.Pattern[str]]:
    """What the block's ``print(...)  # shown`` lines say it prints, as patterns."""
    out = []
    for line in source.splitlines():
        code, sep, comment = line.partition("  # ")
        if sep and code.strip().startswith("print("):
            parts = re.split(r"<[^<>]*>", comment.strip())
            out.append(re.compile(".+".join(re.escape(p) for p in parts)))
    return out


BLOCKS = python_blocks(README.read_text())


def test_readme_has_the_python_blocks() -> None:
    # The model API, a stateful session, and export into a registry then deploy.
    assert len(BLOCKS) >= 3, BLOCKS
    assert all(expected_output(src) for _, src in BLOCKS), "every block shows what it prints"


def test_expected_output_pattern() -> None:
    src = "x = 1\nprint(x)   # 1\n    print(p.location)  # registry/SmolLM2-<sha256>.json\n"
    one, location = expected_output(src)
    assert one.fullmatch("1") and not one.fullmatch("11")
    assert location.fullmatch("registry/SmolLM2-3f9c01ab.json")
    assert not location.fullmatch("registry/SmolLM2-.jsonx")


@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"line{no}" for no, _ in BLOCKS])
def test_readme_block_runs(line: int, source: str, tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    where = f"README.md block at line {line}"
    assert proc.returncode == 0, (f"{where} exited with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}")
    printed = [ln.strip() for ln in proc.stdout.splitlines()]
    want = expected_output(source)
    got = iter(printed)
    for pat in want:
        assert any(pat.fullmatch(ln) for ln in got), (
            f"{where}: expected a line matching {pat.pattern!r} (in order); it printed:\n"
            + "\n".join(printed))
