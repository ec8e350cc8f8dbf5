"""Weights where users keep them (issue #14 item 4): ``--model-path`` with ``--workers``.

A real worker process holds SmolLM2 at ``models/smol.gguf`` under its weights root. The
coordinator either traces its own copy and tells the worker where the worker keeps it, or, with
no copy at all, plans the model from the worker's disk (``DescribeWeights``: the GGUF header
holds the config and the tokenizer). Either way the tokens match transformers' own run of the
same file (``--dequantize``: float32, what transformers computes).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from conftest import SMOLLM2_PROMPT
from jaxdist.coordinator.spawn import LocalWorker, spawn_workers, stop_workers

pytestmark = pytest.mark.reference

_GEN = ("--max-tokens", "8", "--max-seq", "64", "--slots", "1", "--buckets", "16",
        "--dequantize", "--json", "--prompt", SMOLLM2_PROMPT)


def _jaxdist(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def worker(smollm2: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LocalWorker]:
    """One worker whose weights root holds the model one directory down, under another name."""
    root = tmp_path_factory.mktemp("worker-root")
    (root / "models").mkdir()
    try:
        os.link(smollm2, root / "models" / "smol.gguf")
    except OSError:  # another file system
        shutil.copyfile(smollm2, root / "models" / "smol.gguf")
    (w,) = spawn_workers(1, weights_roots=[str(root)])
    yield w
    stop_workers([w])


@pytest.mark.slow
def test_planned_from_the_workers_disk_without_a_local_copy(worker, smollm2_reference):
    prompt, want = smollm2_reference
    proc = _jaxdist("generate", "--workers", worker.address, "--model-path", "models/smol.gguf",
                    *_GEN)
    assert proc.returncode == 0, proc.stderr
    assert f"planning models/smol.gguf from the disk of worker {worker.address}" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == prompt  # the tokenizer rebuilt from the worker's GGUF header
    assert out["tokens"] == want[:8]


@pytest.mark.slow
def test_local_copy_traced_and_read_by_the_worker_at_model_path(worker, smollm2,
                                                                 smollm2_reference):
    prompt, want = smollm2_reference
    proc = _jaxdist("generate", "--workers", worker.address, "--model", str(smollm2),
                    "--model-path", "models/smol.gguf", *_GEN)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == prompt
    assert out["tokens"] == want[:8]


def test_model_missing_on_the_worker_is_refused_before_tracing(worker, smollm2):
    """Without --model-path the worker is asked for the file name; it holds no such file."""
    proc = _jaxdist("generate", "--workers", worker.address, "--model", str(smollm2), *_GEN)
    assert proc.returncode != 0
    assert worker.address in proc.stderr
    assert smollm2.name in proc.stderr and "--model-path" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "export stage" not in proc.stderr  # refused before any stage was traced


def test_model_path_outside_the_workers_root_names_it(worker):
    proc = _jaxdist("generate", "--workers", worker.address, "--model-path", "../elsewhere.gguf",
                    *_GEN)
    assert proc.returncode != 0
    assert "../elsewhere.gguf" in proc.stderr and worker.address in proc.stderr
    assert "Traceback" not in proc.stderr


def test_model_path_needs_workers_and_a_gguf(worker, tmp_path):
    proc = _jaxdist("generate", "--local", "1", "--model-path", "models/smol.gguf", *_GEN)
    assert proc.returncode != 0 and "--model-path" in proc.stderr and "--workers" in proc.stderr
    proc = _jaxdist("generate", "--workers", worker.address, "--model-path", "models/bert",
                    *_GEN)
    assert proc.returncode != 0 and ".gguf" in proc.stderr and "--model" in proc.stderr
    assert "Traceback" not in proc.stderr
