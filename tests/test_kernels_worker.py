"""Quantized GGUF files on real workers: K-quant parity, kernel capability negotiation, the
refusals, and the GGUF variants llama.cpp accepts (no tokenizer, split in parts).

Every expected token comes from tests/quant_reference.py (a numpy forward pass with llama.cpp's
activation quantization) or from a single-process run of the same exported functions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import ggml_blocks
import pytest
from deploy_utils import cli
from quant_reference import QuantLlama

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.coordinator.spawn import spawn_workers, stop_workers
from jaxdist.core import kernels
from jaxdist.core.errors import ArtifactError, SpecError
from jaxdist.exporters.llama import llama_model
from jaxdist.registry.publish import publish

pytestmark = pytest.mark.skipif(not kernels.load().available,
                                reason=f"CPU kernels unavailable: {kernels.load().reason}")

# What a Q4_K_M file mixes: K-quants in the layers, Q8_0 embedding, Q6_K output.
KQUANTS = {"embed": "Q8_0", "attn": "Q4_K", "ffn": "Q5_K", "down": "Q6_K", "output": "Q6_K"}
OTHERS = {"embed": "Q4_0", "attn": "Q3_K", "ffn": "Q2_K", "down": "Q5_1", "output": "F16"}
PROMPT = [1, 2, 3, 4, 5, 6]
N_NEW = 10
NEAR_TIE = 0.25  # logits, as in tests/test_quantized_llm.py


def _model(name: str, root: pathlib.Path, **kw: object):
    model = llama_model(name, roots=[root], max_slots=2, max_seq=32, prefill_buckets=(8,), **kw)
    return dataclasses.replace(model, buckets=[{"b": 1, "s": 1}, {"b": 1, "s": 8}])


def _generate(pipe, model) -> list[int]:
    gen = Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                    max_slots=2, max_seq=32, prefill_buckets=(8,))
    (r,) = gen.run([PROMPT], SamplingParams(max_tokens=N_NEW, ignore_eos=True))
    return r.tokens


def _check_tokens(got: list[int], path: pathlib.Path) -> None:
    want, margins = QuantLlama(str(path)).greedy(PROMPT, N_NEW)
    first_tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(want))
    assert first_tie >= 3, f"the test model is too flat to test with: margins {margins}"
    assert got[:first_tie] == want[:first_tie], (got, want, margins)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("quant_gguf")
    ggml_blocks.write_llama_gguf(root / "kq.gguf", types=KQUANTS, seed=1)
    ggml_blocks.write_llama_gguf(root / "other.gguf", types=OTHERS, seed=2)
    ggml_blocks.write_llama_gguf(root / "split.gguf", types=KQUANTS, seed=1, parts=3)
    return root


@pytest.fixture(scope="module")
def workers(files: pathlib.Path) -> Iterator[tuple[list[str], str]]:
    """(two workers with the CPU kernels, one without): shared by this module's tests, which
    deploy and unload on them but never stop or kill them."""
    plain = spawn_workers(2, weights_roots=[str(files)])
    bare = spawn_workers(1, weights_roots=[str(files)], extra_args=["--no-kernels",
                                                                   "--kernel-threads", "1"])
    try:
        yield [w.address for w in plain], bare[0].address
    finally:
        stop_workers(plain + bare)


@pytest.mark.parametrize("name", ["kq.gguf", "other.gguf"])
def test_quantized_gguf_on_two_workers_matches_reference(files: pathlib.Path, workers,
                                                         name: str) -> None:
    model = _model(name, files)
    packed = {p.quant for u in model.units for p in u.params.values() if p.packed}
    assert packed == set((KQUANTS if name == "kq.gguf" else OTHERS).values())
    with Cluster.connect(workers[0]) as cluster:
        with cluster.deploy(model, stages=2) as pipe:
            got = _generate(pipe, model)
            memory = pipe.stage_memory()
    _check_tokens(got, files / name)
    assert all(m["packed_bytes"] > 0 and not m["dequantized_types"] for m in memory)


def test_split_gguf_loads_as_one_model(files: pathlib.Path) -> None:
    """The parts of a split GGUF (split.count 3) are one model: the same tokens as the whole
    file, each weight URI naming the part that holds it."""
    parts = sorted(p.name for p in files.glob("split-*.gguf"))
    assert parts == [f"split-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    model = _model(parts[0], files)
    used = {p.uri.split("#")[0].removeprefix("gguf://") for u in model.units
            for p in u.params.values()}
    assert used == set(parts)
    with InProcessPipeline(model, weights_roots=[str(files)], stages=2) as pipe:
        split_tokens = _generate(pipe, model)
    with InProcessPipeline(_model("kq.gguf", files), weights_roots=[str(files)]) as pipe:
        whole_tokens = _generate(pipe, _model("kq.gguf", files))
    assert split_tokens == whole_tokens
    _check_tokens(split_tokens, files / "kq.gguf")


def test_error_split_gguf_not_its_first_part(files: pathlib.Path) -> None:
    with pytest.raises(SpecError, match=r"'split-00002-of-00003.gguf' is part 2 of a GGUF split "
                                        r"in 3 \(split.count\); give the first part"):
        _model("split-00002-of-00003.gguf", files)
    (files / "split-00003-of-00003.gguf").rename(files / "gone.gguf")
    try:
        with pytest.raises(Exception, match=r"split-00003-of-00003.gguf"):
            _model("split-00001-of-00003.gguf", files)
    finally:
        (files / "gone.gguf").rename(files / "split-00003-of-00003.gguf")


def test_gguf_without_tokenizer_generates_from_prompt_ids(files: pathlib.Path) -> None:
    """tokenizer.ggml.model = "none" (llama.cpp accepts it): generate takes --prompt-ids and
    prints text null."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", "generate", "--model", str(files / "kq.gguf"),
         "--local", "1", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens",
         str(N_NEW), "--max-seq", "32", "--slots", "2", "--buckets", "8", "--json"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] is None and out["prompt_ids"] == PROMPT
    _check_tokens(out["tokens"], files / "kq.gguf")
    assert len(out["stage_weight_bytes"]) == 1 and out["stage_memory"][0]["packed_bytes"] > 0
    noprompt = cli("generate", "--model", str(files / "kq.gguf"), "--local", "1",
                   "--prompt", "hello")  # refused before any worker starts: in this process
    assert noprompt.returncode != 0 and "has no tokenizer here; pass --prompt-ids" in \
        noprompt.stderr
    assert "spawning" not in noprompt.stderr


def test_worker_info_advertises_its_kernels(workers) -> None:
    with Cluster.connect([workers[0][0], workers[1]]) as cluster:
        k_plain, k_bare = (c.info().kernels for c in cluster.clients)
    assert k_plain.version.startswith(f"{kernels.ABI_VERSION}+ggml-")
    assert tuple(k_plain.types) == kernels.KERNEL_TYPES
    assert set(k_plain.targets) == kernels.OWN_TARGETS and not k_plain.unavailable_reason
    # the worker's dot products and CPUs are this process's (same machine, same library)
    here = kernels.load()
    assert (k_plain.isa, k_plain.cpus) == (here.isa, here.cpus) and k_plain.cpus >= 1
    assert (k_bare.version, list(k_bare.types), list(k_bare.targets)) == ("", [], [])
    assert k_bare.unavailable_reason == "disabled (--no-kernels)"


def test_worker_without_kernels_gets_its_stage_dequantized(files: pathlib.Path, workers, caplog
                                                           ) -> None:
    """A mixed cluster: the stage on the worker with kernels stays packed; the stage on the
    worker without binds float32, and the coordinator says so. Same function, so the tokens
    equal a single-process run that dequantizes at stage 1 only."""
    model = _model("kq.gguf", files)
    bare = workers[1]
    with Cluster.connect([workers[0][0], bare]) as cluster:
        with caplog.at_level(logging.WARNING, logger="jaxdist.coordinator.cluster"):
            with cluster.deploy(model, stages=2) as pipe:
                got = _generate(pipe, model)
                memory = pipe.stage_memory()
                split = [len(r) for r in _ranges(pipe, model)]
    assert f"worker {bare} advertises no CPU kernels" in caplog.text
    assert memory[0]["packed_bytes"] > 0 and not memory[0]["dequantized_types"]
    assert memory[1]["packed_bytes"] == 0
    assert set(memory[1]["dequantized_types"]) <= set(KQUANTS.values())
    assert memory[1]["dequantized_types"]
    # The reference: stage 1's units dequantized, in one process.
    from jaxdist.export.stages import _unpacked

    units = list(model.units)
    units[split[0]:] = [_unpacked(u) for u in units[split[0]:]]
    mixed = dataclasses.replace(model, units=units)
    with InProcessPipeline(mixed, weights_roots=[str(files)], split=split) as pipe:
        assert _generate(pipe, mixed) == got


def _ranges(pipe, model) -> list[range]:
    """The unit ranges of a deployed pipeline, from its specs' weight names."""
    names = [u.name for u in model.units]
    out = []
    for spec in pipe.specs:
        idx = sorted({names.index(w.param.rsplit(".", 1)[0]) for w in spec.weights})
        out.append(range(idx[0], idx[-1] + 1))
    return out


def test_error_kernel_manifest_refused_at_load_stage(files: pathlib.Path, workers,
                                                     tmp_path: pathlib.Path) -> None:
    """A manifest exported with packed weights, deployed onto a worker that has no kernels:
    LoadStage refuses it and names the kernel and the worker, before any frame."""
    pub = publish(_model("kq.gguf", files), tmp_path / "registry", stages=1)
    bare = workers[1]
    with Cluster.connect([bare]) as cluster:
        with pytest.raises(ArtifactError) as err:
            cluster.deploy_manifest(pub.manifest, registry=pub.registry)
        assert cluster.clients[0].info().stages == []
    msg = str(err.value)
    assert "calls the CPU kernels jaxdist_cache_attention_v1, jaxdist_ggml_" in msg
    assert f"worker {bare} does not have (disabled (--no-kernels))" in msg


def test_error_half_precision_refused_on_cpu(files: pathlib.Path, workers) -> None:
    model = _model("kq.gguf", files, dtype="bfloat16")
    with Cluster.connect(workers[0][:1]) as cluster:
        with pytest.raises(SpecError, match=r"stage 0 of 'kq.gguf' binds bfloat16 weights on "
                                            r"CPU worker .*no fast half-precision matmul"):
            cluster.deploy(model)


def test_kernel_stages_call_the_attention_kernel_and_dequantized_ones_none(
        files: pathlib.Path) -> None:
    """A stage bound packed calls the matmul and the decode attention kernels (its CPU
    lowering); the same stage bound dequantized (a worker without kernels) calls none."""
    from jaxdist.export.stages import build_stage_specs

    model = _model("kq.gguf", files)
    ranges = [range(len(model.units))]
    (packed,) = build_stage_specs(model, ranges)
    (plain,) = build_stage_specs(model, ranges, unpack=[True])
    assert {kernels.TARGET, kernels.ATTENTION_TARGET} <= set(packed.artifact.meta.
                                                             custom_call_targets)
    assert not set(plain.artifact.meta.custom_call_targets) & kernels.OWN_TARGETS
