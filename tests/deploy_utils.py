"""Helpers for the registry and deploy tests: the CLI, an HTTP server over a directory, a tiny
Llama."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import pathlib
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
from safetensors.numpy import save_file

from jaxdist.cli import main


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        pass


@contextlib.contextmanager
def serve_directory(directory: pathlib.Path) -> Iterator[str]:
    """Serve ``directory`` over HTTP on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="http-registry", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def write_tiny_llama(path: pathlib.Path, *, seed: int = 0, vocab: int = 96, d: int = 32,
                     layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 64) -> None:
    """A random Llama checkpoint in the Hugging Face layout (config.json + model.safetensors),
    without a tokenizer. Weights are scaled so greedy decoding has no near-ties."""
    rng = np.random.default_rng(seed)
    hd = d // heads

    def w(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, d, scale=1.0),
               "model.norm.weight": 1 + w(d, scale=0.1), "lm_head.weight": w(vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": 1 + w(d, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(d, scale=0.1),
                    p + "self_attn.q_proj.weight": w(heads * hd, d),
                    p + "self_attn.k_proj.weight": w(kv_heads * hd, d),
                    p + "self_attn.v_proj.weight": w(kv_heads * hd, d),
                    p + "self_attn.o_proj.weight": w(d, heads * hd),
                    p + "mlp.gate_proj.weight": w(ffn, d), p + "mlp.up_proj.weight": w(ffn, d),
                    p + "mlp.down_proj.weight": w(d, ffn)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": d, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "hidden_act": "silu"}))


def jaxdist(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The command in a subprocess."""
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in this process (stdout/stderr captured), as a CompletedProcess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess[str], text: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxdist: error: ") and text in last, proc.stderr
    assert "Traceback" not in proc.stderr
